"""Trackers read back: the lines the broker writes reach TensorBoard's event file, an
offline W&B run and an MLflow file store, with their steps, and transcripts as text."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from drmas.broker.trackers import make_sink
from drmas.config import ConfigError, load_config
from drmas.launch.train import check_run
from drmas.teams.resolve import resolve

LINES = [
    {"step": 1, "loss/solver": 0.5, "time_s": 1.0},
    {"step": 1, "val/avg@8": 0.7, "val/tasks": 256.0, "time_s": 1.5},
    {"step": 2, "loss/solver": 0.25, "skipped": float("nan"), "time_s": 2.0},
]


def write_run(tmp_path: Path, names: list[str]) -> Path:
    sink = make_sink(tmp_path, ["jsonl", *names], "drmas-test", {"train": {"steps": 2}})
    for line in LINES:
        sink.write(line)
    sink.text("samples", "[solver] → \\boxed{7}", 1)
    sink.close()
    assert sorted(sink.trackers) == sorted(names)  # none failed and was dropped
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # jsonl always
    return tmp_path


def tfrecords(path: Path) -> list[bytes]:
    """The records of a TFRecord file (length, crc, data, crc)."""
    raw, out, pos = path.read_bytes(), [], 0
    while pos < len(raw):
        (length,) = struct.unpack("<Q", raw[pos : pos + 8])
        out.append(raw[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
    return out


def test_tensorboard_events_hold_every_scalar_at_its_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto.event_pb2 import Event

    write_run(tmp_path, ["tensorboard"])
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars, texts = {}, []
    for data in tfrecords(events):
        event = Event.FromString(data)
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars[(value.tag, event.step)] = round(value.simple_value, 6)
            elif value.tag.startswith("samples"):
                texts.append(event.step)
    assert scalars == {("loss/solver", 1): 0.5, ("val/avg_at_8", 1): 0.7, ("val/tasks", 1): 256.0,
                       ("loss/solver", 2): 0.25}  # fmt: skip  # NaN and time_s left out
    assert texts == [1]


def wandb_history(run: Path) -> list[dict[str, str]]:
    """History records of an offline W&B run file (LevelDB log blocks of protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run.glob("wandb/offline-run-*/run-*.wandb")
    raw, records, pos, partial = path.read_bytes(), [], 7, b""  # 7: the W&B file header
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(partial + data)
            partial = b""
        elif kind in (2, 3):
            partial += data
    out = []
    for data in records:
        record = pb.Record.FromString(data)
        if record.WhichOneof("record_type") == "history":
            out.append({i.key or "/".join(i.nested_key): i.value_json for i in record.history.item})
    return out


def test_wandb_runs_offline_in_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="optional: pip install 'drmas[trackers]'")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default, no network
    history = wandb_history(write_run(tmp_path, ["wandb"]))
    got = [(h["step"], k, h[k]) for h in history for k in ("loss/solver", "val/avg@8") if k in h]
    assert got == [("1", "loss/solver", "0.5"), ("1", "val/avg@8", "0.7"),
                   ("2", "loss/solver", "0.25")]  # fmt: skip
    assert any("samples/_type" in h for h in history)  # the transcript table


def test_mlflow_file_store_in_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlflow = pytest.importorskip("mlflow", reason="optional: pip install 'drmas[trackers]'")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    write_run(tmp_path, ["mlflow"])
    client = mlflow.MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("drmas-test").experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss/solver")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.25)]
    assert client.get_metric_history(run.info.run_id, "val/avg_at_8")[0].value == 0.7
    assert run.data.params["train.steps"] == "2"


def test_an_unknown_or_uninstalled_tracker_is_refused_before_the_run(monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"logger\[1\]='neptune' is not one of \['jsonl'"):
        load_config(["logger=[jsonl,neptune]"])
    import drmas.broker.trackers as trackers

    monkeypatch.setattr(trackers, "_PACKAGES", {**trackers._PACKAGES, "wandb": "no_such_pkg"})
    cfg = load_config(["logger=[jsonl,wandb]"])  # the config itself is fine on any node
    resolve(cfg, "actor")  # an actor or learner node without wandb may run it
    resolve(cfg, "learner")
    with pytest.raises(ConfigError, match=r"pip install 'drmas\[trackers\]'"):
        check_run(cfg)  # drmas train starts the broker, which writes to wandb: refused
