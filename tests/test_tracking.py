"""Experiment tracking with no network: a W&B offline run and an MLflow local-folder run log what metrics.jsonl logs.

One short training run writes to all three; the W&B run file (a LevelDB-style log of protobuf records, read here
without wandb's internals) and the MLflow store are read back and compared with metrics.jsonl step by step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TinyCausalLM, TokenDataset

from vlmfast import OptimizedTrainer, TrainSpec

STEPS = 3


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of a .wandb file: a 7-byte header, then 32 KiB blocks of records (4-byte checksum,
    2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last; 0 is block padding)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending, rows = run_file.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.fixture
def tracked_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    for key in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))  # nothing written to the home folder
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # vlmfast sets it for a local folder
    monkeypatch.chdir(tmp_path)
    log = {"dir": "run", "progress": "off", "wandb": {"enabled": True, "mode": "offline", "project": "p"},
           "mlflow": {"enabled": True, "experiment": "e"}}
    spec = TrainSpec(max_steps=STEPS, batch_size=8, micro_batch_size=4, log=log)
    OptimizedTrainer(TinyCausalLM(), TokenDataset(32), spec).fit()
    return tmp_path / "run"


def jsonl_numbers(run: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return [{k: float(v) for k, v in row.items() if isinstance(v, (int, float))} for row in rows]


def test_wandb_offline_and_mlflow_folder_log_the_metrics_jsonl_figures(tracked_run: Path) -> None:
    from mlflow.tracking import MlflowClient

    expected = jsonl_numbers(tracked_run)
    # W&B, offline: one history row per step, same keys and values, its _step = our step
    (run_file,) = tracked_run.glob("wandb/offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    assert len(rows) == STEPS
    for want, got in zip(expected, rows, strict=True):
        assert got["_step"] == want["step"]
        assert {k: float(v) for k, v in got.items() if not k.startswith("_")} == {
            k: v for k, v in want.items() if k != "step"}
    # MLflow, in log.dir/mlruns: every metric's history is the jsonl column
    client = MlflowClient(tracking_uri=(tracked_run / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == str(STEPS) and run.data.params["log.mlflow.enabled"] == "True"
    keys = {key for row in expected for key in row} - {"step"}  # memory readings: on some steps only
    assert set(run.data.metrics) == keys
    for key in keys:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(row["step"], row[key]) for row in expected if key in row], key
