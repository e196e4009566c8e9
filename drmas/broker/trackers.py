"""Experiment trackers: the lines of metrics.jsonl, also sent to TensorBoard, W&B or MLflow.

Written by the broker, the one process that writes metrics (drmas/broker/metrics.py):
`make_sink` returns one sink that writes every line to RUN_DIR/metrics.jsonl (always) and
to each tracker named in `logger`, and sampled transcripts (drmas/broker/samples.py) to
the trackers as text tables. Each tracker writes under the run folder and needs no
network:
- tensorboard: RUN_DIR/tensorboard/ (tensorboardX; `tensorboard --logdir RUN_DIR`);
- wandb: an offline run in RUN_DIR/wandb/ unless WANDB_MODE says otherwise
  (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later);
- mlflow: a file store in RUN_DIR/mlruns/ unless MLFLOW_TRACKING_URI is set.
Training lines and validation lines share the `step` axis; validation keys start with
`val/`. TensorBoard and MLflow do not allow `@` in names: there `val/avg@8` is
`val/avg_at_8`. A tracker package that is not installed is refused before the run starts, with
the pip command (`pip install 'drmas[trackers]'`).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, get_args

from drmas.broker.metrics import JsonlSink
from drmas.config.types import TrackerName

log = logging.getLogger("drmas.broker")

TRACKERS = get_args(TrackerName)
"""Every tracker `logger` may name (the one list is the config's TrackerName)."""
_PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}


def missing_packages(names: list[str]) -> list[str]:
    """Trackers in `names` whose package does not import here."""
    import importlib.util

    return [n for n in names if n in _PACKAGES and importlib.util.find_spec(_PACKAGES[n]) is None]


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if k not in ("step", "time_s")
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


class TensorBoardSink:
    def __init__(self, run_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key.replace("@", "_at_"), value, step)  # @ is not a tag char
        self.writer.flush()

    def text(self, name: str, markdown: str, step: int) -> None:
        self.writer.add_text(name, markdown, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")  # no network unless asked for
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=project, dir=str(run_dir), name=run_dir.name, config=config, reinit=True
        )
        self.run.define_metric("*", step_metric="step")  # train and val lines, one axis
        self.wandb = wandb

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({"step": int(record.get("step", 0)), **_scalars(record)})

    def text(self, name: str, markdown: str, step: int) -> None:
        table = self.wandb.Table(columns=["step", "transcript"], data=[[step, markdown]])
        self.run.log({"step": step, name: table})

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        import mlflow

        if "MLFLOW_TRACKING_URI" not in os.environ:
            # a file store in the run folder: no server, no database package needed
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(project)
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_dir.name)
        flat = {k: str(v)[:250] for k, v in _flatten(config).items()}
        for start in range(0, len(flat), 100):  # the API takes at most 100 at a time
            mlflow.log_params(dict(list(flat.items())[start : start + 100]))

    def write(self, record: dict[str, Any]) -> None:
        # MLflow metric names allow / but not @: val/avg@8 -> val/avg_at_8
        metrics = {k.replace("@", "_at_"): v for k, v in _scalars(record).items()}
        self.mlflow.log_metrics(metrics, step=int(record.get("step", 0)))

    def text(self, name: str, markdown: str, step: int) -> None:
        self.mlflow.log_text(markdown, f"{name}/step-{step:06d}.md")

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): value}


class FanOut:
    """metrics.jsonl and every tracker; a tracker that fails is logged once and dropped
    (metrics.jsonl keeps every line)."""

    def __init__(self, jsonl: JsonlSink, trackers: dict[str, Any]) -> None:
        self.jsonl = jsonl
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        self._each("write", record)

    def text(self, name: str, markdown: str, step: int) -> None:
        self._each("text", name, markdown, step)

    def _each(self, method: str, *args: Any) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # a tracker must never stop training
                log.error(
                    "tracker %s failed (%s: %s); it is dropped", name, type(exc).__name__, exc
                )
                del self.trackers[name]

    def close(self) -> None:
        self.jsonl.close()
        for tracker in self.trackers.values():
            try:
                tracker.close()
            except Exception as exc:
                log.error("tracker close failed: %s", exc)


def make_sink(run_dir: Path, names: list[str], project: str, config: dict[str, Any]) -> FanOut:
    trackers: dict[str, Any] = {}
    for name in names:
        if name == "tensorboard":
            trackers[name] = TensorBoardSink(run_dir)
        elif name == "wandb":
            trackers[name] = WandbSink(run_dir, project, config)
        elif name == "mlflow":
            trackers[name] = MlflowSink(run_dir, project, config)
    return FanOut(JsonlSink(run_dir / "metrics.jsonl"), trackers)
