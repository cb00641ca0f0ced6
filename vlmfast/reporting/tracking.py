"""Experiment tracking next to metrics.jsonl and TensorBoard: Weights & Biases (`log.wandb`) and MLflow
(`log.mlflow`). Both are optional installs (`pip install 'vlmfast[wandb]'` / `'vlmfast[mlflow]'`) and both work with
no network: W&B in offline mode (``wandb sync`` uploads later), MLflow into a local folder.

Every tracker receives exactly the per-step dict written to metrics.jsonl (numbers only; booleans as 0/1), with the
optimizer step as its step, so the figures in the W&B or MLflow UI are the ones in metrics.jsonl.

Usage::

    trackers = open_trackers(spec.log, config=spec.to_dict())   # [] when neither is enabled
    for tracker in trackers:
        tracker.log({"loss": 2.3, "lr": 1e-3}, step=1)
        tracker.close()
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from vlmfast.common.sections import Field, Section, SpecError

__all__ = ["MLflowSpec", "MLflowTracker", "Tracker", "TrackerError", "WandbSpec", "WandbTracker", "check_trackers",
           "close_trackers", "numeric_metrics", "open_trackers"]

log = logging.getLogger(__name__)


class WandbSpec(Section):
    """Weights & Biases logging (needs wandb)."""

    enabled: bool = Field(False, description="log every step's metrics to Weights & Biases (needs wandb)")
    project: str = Field("vlmfast", description="W&B project")
    entity: str | None = Field(None, description="W&B team or user (default: yours)")
    name: str | None = Field(None, description="run name (default: W&B picks one)")
    mode: Literal["online", "offline"] | None = Field(
        None, description="offline: write to log.dir/wandb with no network (wandb sync uploads it later); "
        "default: WANDB_MODE, else online")
    tags: list[str] = Field(default_factory=list, description="run tags")


class MLflowSpec(Section):
    """MLflow logging (needs mlflow or mlflow-skinny)."""

    enabled: bool = Field(False, description="log every step's metrics to MLflow (needs mlflow or mlflow-skinny)")
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default: MLFLOW_TRACKING_URI, else the local folder log.dir/mlruns "
        "(or ./mlruns)")
    experiment: str = Field("vlmfast", description="experiment name")
    run_name: str | None = Field(None, description="run name (default: MLflow picks one)")


class Tracker(Protocol):
    """What the metrics logger calls: one `log` per written step, `close` at the end."""

    name: str

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record (booleans as 0/1), without `step` (that is the tracker's step)."""
    return {key: float(value) for key, value in metrics.items()
            if key != "step" and isinstance(value, (int, float))}


class WandbTracker:
    """A W&B run; `log` sends a step's numbers (``wandb.log(..., step=step)``)."""

    name = "wandb"

    def __init__(self, spec: WandbSpec, log_dir: Path | None, config: Mapping[str, Any] | None = None) -> None:
        wandb = _require("wandb", "log.wandb", "wandb")
        folder = Path(log_dir) if log_dir is not None else Path.cwd()
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=spec.project, entity=spec.entity, name=spec.name, mode=spec.mode,
                              tags=spec.tags or None, dir=str(folder), config=dict(config or {}), reinit="create_new")
        self.dir = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log(numeric_metrics(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    """An MLflow run in its own client (no process-global active run is touched)."""

    name = "mlflow"

    def __init__(self, spec: MLflowSpec, log_dir: Path | None, config: Mapping[str, Any] | None = None) -> None:
        _require("mlflow", "log.mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_tracking_uri(spec, log_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(spec.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(spec.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=spec.run_name).info.run_id
        for key, value in _flatten(config or {}).items():
            self.client.log_param(self.run_id, key, str(value)[:500])  # MLflow caps a param value's length

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        timestamp = _now_ms()
        batch = [Metric(key, value, timestamp, step) for key, value in numeric_metrics(metrics).items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_tracking_uri(spec: MLflowSpec, log_dir: Path | None) -> str:
    """The URI in use: the spec's, else MLFLOW_TRACKING_URI, else a local folder (log.dir/mlruns or ./mlruns).

    A local folder needs MLflow's file store, which MLflow 3 keeps in maintenance mode behind
    ``MLFLOW_ALLOW_FILE_STORE=true``; that variable is set for this process when unset (and said so)."""
    uri = _mlflow_uri(spec, log_dir)
    if (uri.startswith("file:") or "://" not in uri) and "MLFLOW_ALLOW_FILE_STORE" not in os.environ:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        log.info("log.mlflow: a local folder (%s) uses MLflow's file store; set MLFLOW_ALLOW_FILE_STORE=true for "
                 "this process (MLflow 3 asks for it); to read it: MLFLOW_ALLOW_FILE_STORE=true mlflow ui "
                 "--backend-store-uri %s. Use a sqlite:/// or http:// tracking_uri for a database", uri, uri)
    return uri


def _mlflow_uri(spec: MLflowSpec, log_dir: Path | None) -> str:
    uri = spec.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None:
        uri = (Path(log_dir) if log_dir is not None else Path.cwd()).resolve().joinpath("mlruns").as_uri()
    return uri


def _mlflow_local_folder(uri: str) -> Path | None:
    """The folder a local MLflow store writes (a file store, or a sqlite database's folder); None for a server."""
    from urllib.parse import unquote, urlparse

    if "://" not in uri:
        return Path(uri)
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "sqlite" and uri.startswith("sqlite:///"):  # sqlite:///rel.db, sqlite:////abs/path.db
        return Path(unquote(uri[len("sqlite:///"):])).parent
    return None


class TrackerError(SpecError):
    """An enabled tracker cannot start (package missing, folder not writable, its own set-up failed)."""


def check_trackers(spec: Any) -> None:
    """Fail before any work when an enabled tracker cannot start: its package missing or the local folder it writes
    not writable; the error names the field and the fix. Creates nothing. Usage: ``check_trackers(spec.log)``."""
    from vlmfast.checkpoints.save_dir import check_output_dir

    if spec.tensorboard:
        _require("tensorboard", "log.tensorboard", "tensorboard", import_now=False)
    if spec.wandb.enabled:
        _require("wandb", "log.wandb", "wandb", import_now=False)
        if spec.dir is None:  # under log.dir it is checked with log.dir
            check_output_dir("log.dir (unset: W&B writes to the working folder)", Path.cwd())
    if spec.mlflow.enabled:
        _require("mlflow", "log.mlflow", "mlflow", import_now=False)
        folder = _mlflow_local_folder(_mlflow_uri(spec.mlflow, spec.dir))
        if folder is not None:
            check_output_dir("log.mlflow.tracking_uri (a local store)", folder)


def open_trackers(spec: Any, config: Mapping[str, Any] | None = None) -> list[Tracker]:
    """The trackers `spec` (a LogSpec) enables, opened; their writes go under `spec.dir` unless told otherwise.
    When one fails to open, those already open are closed (no run left half open) and a TrackerError names it."""
    trackers: list[Tracker] = []
    kinds = [(kind, getattr(spec, field)) for kind, field in ((WandbTracker, "wandb"), (MLflowTracker, "mlflow"))]
    for kind, section in kinds:
        if not section.enabled:
            continue
        try:
            trackers.append(kind(section, spec.dir, config))
        except Exception as exc:
            close_trackers(trackers)
            if isinstance(exc, TrackerError):
                raise
            raise TrackerError(f"log.{kind.name} could not start its run ({type(exc).__name__}: {exc}); fix it or "
                               f"turn log.{kind.name}.enabled off") from exc
    return trackers


def close_trackers(trackers: list[Tracker]) -> list[str]:
    """Close every tracker even when one fails; returns the failures, one line each (the caller warns)."""
    failures = []
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as exc:  # one tracker's failure never leaves the others open
            failures.append(f"log.{tracker.name}: closing failed ({type(exc).__name__}: {exc})")
    return failures


def _require(module: str, field: str, extra: str, import_now: bool = True) -> Any:
    import importlib
    import importlib.util

    try:
        if not import_now:
            if importlib.util.find_spec(module) is None:
                raise ImportError(module)
            return None
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerError(f"{field} is on but {module} is not installed: pip install 'vlmfast[{extra}]' (or "
                           f"pip install {extra}), or turn {field} off") from exc


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
