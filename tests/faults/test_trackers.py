"""Trackers (TensorBoard, W&B, MLflow) that cannot start fail before any work naming the field and the fix; one
tracker failing never leaves another's run half open; a tracker failing mid-run never ends the training."""

from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import ClassVar

import pytest
from _faults import make_spec, train
from conftest import TinyCausalLM, TokenDataset

from vlmfast import OptimizedTrainer, SpecError
from vlmfast.cli.main import main
from vlmfast.reporting import tracking
from vlmfast.reporting.tracking import TrackerError, open_trackers


class _Blocked(importlib.abc.MetaPathFinder):
    """Makes `names` look uninstalled (what a machine without the optional extra sees)."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


@pytest.fixture
def uninstalled(monkeypatch):
    def block(*names: str) -> None:
        for name in list(sys.modules):
            if name.split(".")[0] in names:
                monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(sys, "meta_path", [_Blocked(*names), *sys.meta_path])
    return block


@pytest.mark.parametrize("field,package", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")])
def test_a_missing_tracker_package_is_refused_before_any_work_naming_the_field_and_the_extra(
        field, package, uninstalled, tmp_path):
    uninstalled(package)
    log = {"dir": str(tmp_path / "logs"), "tensorboard": True} if field == "tensorboard" else \
        {"dir": str(tmp_path / "logs"), field: {"enabled": True, "mode": "offline"} if field == "wandb" else
         {"enabled": True}}
    with pytest.raises(TrackerError, match=rf"log.{field} is on but {package} is not installed: pip install "
                                           rf"'vlmfast\[{field}\]'"):
        OptimizedTrainer(_tiny(), _data(), make_spec(log=log))
    assert not (tmp_path / "logs").exists()  # before any work: nothing written


def test_the_cli_says_it_in_one_line_without_a_traceback(uninstalled, capsys, tmp_path):
    uninstalled("wandb")
    code = main(["train", "--set", f"log.dir={tmp_path}", "--set", "log.wandb.enabled=true"])
    err = capsys.readouterr().err
    assert code == 2 and "log.wandb is on but wandb is not installed" in err and "Traceback" not in err


@pytest.mark.parametrize("uri", ["file://{blocker}/mlruns", "sqlite:///{blocker}/runs/mlflow.db", "{blocker}/store"])
def test_an_mlflow_store_that_cannot_be_written_is_refused_before_any_work(uri, tmp_path):
    blocker = tmp_path / "a_file"  # a file where the store's folder should be: unwritable even for root
    blocker.write_text("not a folder")
    spec = make_spec(log={"mlflow": {"enabled": True, "tracking_uri": uri.format(blocker=blocker)}})
    with pytest.raises(SpecError, match=r"log.mlflow.tracking_uri .*cannot be created: .*a_file is a file"):
        OptimizedTrainer(_tiny(), _data(), spec)


class _Recording:
    name = "wandb"
    opened: ClassVar[list[_Recording]] = []

    def __init__(self, *args) -> None:
        self.closed = False
        _Recording.opened.append(self)

    def log(self, metrics, step) -> None: ...

    def close(self) -> None:
        self.closed = True


class _FailsToOpen:
    name = "mlflow"

    def __init__(self, *args) -> None:
        raise OSError(30, "Read-only file system")


def test_one_tracker_failing_to_open_closes_the_ones_already_open(monkeypatch):
    monkeypatch.setattr(_Recording, "opened", [])
    monkeypatch.setattr(tracking, "WandbTracker", _Recording)
    monkeypatch.setattr(tracking, "MLflowTracker", _FailsToOpen)
    spec = make_spec(log={"wandb": {"enabled": True}, "mlflow": {"enabled": True}}).log
    with pytest.raises(TrackerError, match=r"log.mlflow could not start its run \(OSError: .*Read-only file system"):
        open_trackers(spec)
    assert [t.closed for t in _Recording.opened] == [True]  # W&B's run finished, not left half open


class _FailsAtStep3(_Recording):
    def log(self, metrics, step) -> None:
        if step == 3:
            raise OSError(30, "Read-only file system")


def test_a_tracker_failing_mid_run_is_dropped_with_a_warning_and_training_goes_on(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(_Recording, "opened", [])
    monkeypatch.setattr(tracking, "WandbTracker", _FailsAtStep3)
    monkeypatch.setattr(tracking, "check_trackers", lambda spec: None)  # wandb may be absent: the stub stands in
    spec = make_spec(max_steps=5, log={"dir": str(tmp_path), "wandb": {"enabled": True}})
    with caplog.at_level(logging.WARNING, logger="vlmfast"):
        _, result = train(spec)
    assert len(result.history) == 5
    assert "log.wandb failed at step 3 (OSError" in caplog.text and "training goes on without it" in caplog.text
    assert [t.closed for t in _Recording.opened] == [True]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5  # metrics.jsonl kept every step


def _tiny():
    return TinyCausalLM()


def _data():
    return TokenDataset(16)
