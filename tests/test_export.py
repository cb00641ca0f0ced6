"""Export without writing code: `save.export` at the end of a completed fit(), and `vlmfast export CHECKPOINT OUT`.

- `save.export.dir`: a LoRA run writes PEFT's adapter folder (or, with `merge`, the merged model), a plain run its
  weights; each folder reloads to the trained model's logits / weights; an interrupted run exports nothing; a
  folder that cannot be written is refused before any work.
- `vlmfast export`: the checkpoint's model rebuilt by its task on its saved spec, the checkpoint loaded, the folder
  written: the built-in tiny VLM's weights equal the checkpoint's; a LoRA checkpoint of a tiny LLaVA merges into a
  folder `from_pretrained` loads with the trained logits (within 1e-5, fp32); bad paths fail in one line.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import LlavaDataset, TinyCausalLM, TokenDataset, tiny_llava
from safetensors.torch import load_file

from vlmfast import Callback, OptimizedTrainer, SpecError, TrainSpec
from vlmfast.checkpoints.export import EXPORT_FILE, ExportWriteError
from vlmfast.checkpoints.store import load_checkpoint
from vlmfast.cli.main import main
from vlmfast.models import build_tiny_vlm_task

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5


def spec(tmp_path, **extra) -> TrainSpec:
    base = {"max_steps": 2, "batch_size": 4, "micro_batch_size": 4, "device": "cpu", "log": {"progress": "off"},
            "optimizer": {"name": "adamw", "lr": 1e-2}, "memory": {"leak_check": False},
            "save": {"dir": str(tmp_path / "ckpt")}}
    for key, value in extra.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    return TrainSpec(**base)


def logits(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


def llava_batch() -> dict[str, torch.Tensor]:
    return torch.utils.data.default_collate([LlavaDataset(8)[i] for i in range(8)])


# ---- save.export: the end of fit() exports ------------------------------------------------------------------------
@pytest.mark.parametrize("merge", [False, True], ids=["adapters", "merged"])
def test_save_export_writes_the_lora_folder_at_the_end_of_a_fit_and_the_report_says_where(tmp_path, merge):
    peft = pytest.importorskip("peft")
    out = tmp_path / "export"
    trainer = OptimizedTrainer(tiny_llava(0), LlavaDataset(16), spec(
        tmp_path, lora={"enabled": True, "r": 4}, save={"export": {"dir": str(out), "merge": merge}}))
    result = trainer.fit()
    trained = logits(trainer.engine.module, llava_batch())
    assert not torch.allclose(trained, logits(tiny_llava(0), llava_batch()), atol=1e-3)  # the adapters moved

    assert result.exported == out and result.report.extra["exported"] == str(out)
    assert f"exported: {out}" in result.report.to_text()
    if merge:
        assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
        loaded = type(tiny_llava(0)).from_pretrained(str(out))
    else:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
        loaded = peft.PeftModel.from_pretrained(tiny_llava(0), str(out))  # onto a fresh base
    torch.testing.assert_close(logits(loaded, llava_batch()), trained, rtol=TOLERANCE, atol=TOLERANCE)


def test_save_export_writes_the_weights_of_a_plain_run(tmp_path):
    out = tmp_path / "export"
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(16), spec(tmp_path, save={"export": {"dir": str(out)}}))
    trainer.task = "my_jobs:build"  # as `vlmfast train --task my_jobs:build` sets it
    assert trainer.fit().exported == out
    saved = load_file(str(out / "model.safetensors"))
    state = trainer.engine.module.state_dict()
    assert sorted(saved) == sorted(state) and all(torch.equal(saved[n], t) for n, t in state.items())
    record = json.loads((out / EXPORT_FILE).read_text())  # no config known: the class and the task that built it
    assert (record["kind"], record["model_class"], record["task"]) == ("safetensors", "conftest:TinyCausalLM",
                                                                       "my_jobs:build")
    assert "config" not in record and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "export"]  # no leftover


# ---- exports are written like checkpoints ---------------------------------------------------------------------------
def plain_trainer(tmp_path, out, **export) -> OptimizedTrainer:
    """A 2-step run exporting to `out` (no checkpoints: each run exports again)."""
    return OptimizedTrainer(TinyCausalLM(), TokenDataset(16), spec(tmp_path, save={"dir": None, "export": {
        "dir": str(out), **export}}))


def test_links_planted_in_a_previous_export_are_replaced_never_written_through(tmp_path):
    out, victim = tmp_path / "export", tmp_path / "victim.txt"
    victim.write_text("precious")
    plain_trainer(tmp_path, out).fit()  # a previous export of the same kind: replaced by the next one
    for name in ("model.safetensors", "README.md", "adapter_config.json"):
        (out / name).unlink(missing_ok=True)
        (out / name).symlink_to(victim)
    plain_trainer(tmp_path, out).fit()
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", EXPORT_FILE]  # the links are gone
    assert not (out / "model.safetensors").is_symlink() and load_file(str(out / "model.safetensors"))


def test_a_folder_holding_another_model_is_refused_when_the_trainer_is_built_unless_overwrite(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_text("another model")
    with pytest.raises(SpecError, match=rf"save.export.dir {out} holds files that are not a vlmfast export "
                       r"\(config.json, model.safetensors\).*save.export.overwrite: true"):
        plain_trainer(tmp_path, out)
    assert not (tmp_path / "ckpt").exists() and len(list(out.iterdir())) == 2  # before any work

    plain_trainer(tmp_path, out, overwrite=True).fit()
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", EXPORT_FILE]  # replaced, not mixed in


def test_an_export_of_another_kind_is_refused_naming_both_kinds(tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "export"
    plain_trainer(tmp_path, out).fit()
    with pytest.raises(SpecError, match=r"holds a vlmfast export of another kind \(safetensors; this one writes "
                       r"lora adapters\)"):
        OptimizedTrainer(tiny_llava(0), LlavaDataset(16), spec(
            tmp_path, lora={"enabled": True, "r": 4}, save={"export": {"dir": str(out)}}))


@pytest.mark.parametrize("failure", ["oserror", "safetensors"])
def test_a_full_disk_names_save_export_dir_and_leaves_the_previous_export_as_it_was(tmp_path, monkeypatch, failure):
    import safetensors
    import safetensors.torch

    out = tmp_path / "export"
    plain_trainer(tmp_path, out).fit()
    before = (out / "model.safetensors").read_bytes()

    def full_disk(model, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"partial")
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                          'message: "No space left on device" })')  # what safetensors raises

    monkeypatch.setattr(safetensors.torch, "save_model", full_disk)
    trainer = plain_trainer(tmp_path, out)
    with pytest.raises(ExportWriteError, match=rf"save.export.dir {out}: cannot write the export \(.*No space left "
                       r"on device.*\). Nothing was changed in"):
        trainer.fit()
    assert (out / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary folder left


class _SigtermAfterStep(Callback):
    def on_step_end(self, trainer, metrics) -> None:
        if metrics["step"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler: the run stops after this step


def test_an_interrupted_run_writes_its_checkpoint_but_exports_nothing(tmp_path):
    out = tmp_path / "export"
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(16), spec(tmp_path, save={"export": {"dir": str(out)}}),
                               callbacks=[_SigtermAfterStep()])
    result = trainer.fit()
    assert result.interrupted == "SIGTERM" and result.checkpoint is not None
    assert result.exported is None and not out.exists() and "exported" not in result.report.extra


def test_an_export_dir_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SpecError, match=r"save.export.dir .*a_file is a file, not a folder"):
        OptimizedTrainer(TinyCausalLM(), TokenDataset(16), spec(tmp_path, save={"export": {"dir": str(blocker)}}))
    assert not (tmp_path / "ckpt").exists()


# ---- vlmfast export CHECKPOINT OUT ----------------------------------------------------------------------------------
def load_with_the_documented_lines(folder):
    """Run docs/checkpoints.md's lines that load a plain-module export, exactly, on `folder`; their `model`."""
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    block = text.split("<!-- loads a plain-module export -->\n```python\n")[1].split("```")[0]
    assert block.count('folder = "out"') == 1
    namespace: dict = {}
    exec(block.replace('folder = "out"', f"folder = {str(folder)!r}"), namespace)  # the docs' own lines
    return namespace["model"]


def test_vlmfast_export_of_a_tiny_vlm_run_that_saved_every_step_reloads_with_the_documented_lines(tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["train", "--samples", "64", "--set", "max_steps=2", "--set", "batch_size=4",  # save.every_steps:
                 "--set", "log.progress=off", "--set", f"save.dir={ckpt}", "--set", "save.every_steps=1"]) == 0
    capsys.readouterr()
    assert main(["export", str(ckpt / "step_00000002"), str(out), "--samples", "64"]) == 0
    assert f"exported the model of step 2 ({ckpt / 'step_00000002'}) to {out}" in capsys.readouterr().out
    saved = load_file(str(out / "model.safetensors"))
    trained = load_checkpoint(ckpt / "step_00000002")["engine"]["model"]
    assert sorted(saved) == sorted(trained) and all(torch.equal(saved[n], t) for n, t in trained.items())
    record = json.loads((out / EXPORT_FILE).read_text())
    assert (record["model_class"], record["config_class"]) == ("vlmfast.models.tiny_vlm:TinyVLM",
                                                               "vlmfast.models.tiny_vlm:TinyVLMConfig")

    reference, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=8)
    reference.load_state_dict(trained)
    batch = collate([dataset[i] for i in range(4)])
    loaded = load_with_the_documented_lines(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, reference.eval()(**batch).logits, rtol=0, atol=0)

    again = tmp_path / "again"  # a save.dir names its newest checkpoint
    assert main(["export", str(ckpt), str(again), "--samples", "64"]) == 0
    assert load_file(str(again / "model.safetensors")).keys() == saved.keys()


LLAVA_TASK = '''
import json
from pathlib import Path

from conftest import LlavaDataset, tiny_llava


class Processor:
    """Stands in for a Hugging Face processor: what export saves next to the model."""

    def save_pretrained(self, directory):
        (Path(directory) / "processor_config.json").write_text(json.dumps({"kind": "stub"}))


def build():
    return {"model": tiny_llava(0), "train_data": LlavaDataset(16), "processor": Processor()}
'''


def test_vlmfast_export_merge_of_a_lora_checkpoint_loads_with_from_pretrained_and_gives_the_trained_logits(
        tmp_path, monkeypatch, capsys):
    pytest.importorskip("peft")
    (tmp_path / "llava_export_task.py").write_text(LLAVA_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    from llava_export_task import build

    job = build()
    trainer = OptimizedTrainer(job["model"], job["train_data"], spec(tmp_path, lora={"enabled": True, "r": 4}))
    checkpoint = trainer.fit().checkpoint
    trained = logits(copy.deepcopy(trainer.engine.module), llava_batch())
    assert not torch.allclose(trained, logits(tiny_llava(0), llava_batch()), atol=1e-3)  # the adapters moved

    out = tmp_path / "merged"
    assert main(["export", str(checkpoint), str(out), "--merge", "--task", "llava_export_task:build"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "processor_config.json"} <= names and "adapter_config.json" not in names
    loaded = pytest.importorskip("transformers").LlavaForConditionalGeneration.from_pretrained(str(out))  # no PEFT
    torch.testing.assert_close(logits(loaded, llava_batch()), trained, rtol=TOLERANCE, atol=TOLERANCE)


def test_vlmfast_export_names_a_missing_or_wrong_checkpoint_in_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {tmp_path / 'nope'} does not exist" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "is neither a checkpoint folder (no state.pt) nor a save.dir" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
