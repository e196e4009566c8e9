"""The broker's checkpoint file: BrokerState's snapshot (drmas/broker/state.py) on disk,
and the choice of where each model resumes.

Written by the broker (drmas/broker/server.py) to CHECKPOINT_ROOT/broker.json, atomically
(temp file + os.replace): when a model reports a step that is a multiple of
`checkpoint.every`, and when the broker stops (end of run, or brought down because a
learner died). Read back by the broker on `run.resume`, and by `drmas train` (drmas/launch/
train.py) to say what a resume would continue from.

What is saved (each part by its owner's `snapshot()`, put back by its `restore()`): the
task source's cursor (epoch, index, seed, requeued tasks), model versions, counters,
group ids trained per model, the next lease/group ids (drmas/broker/leases.py), the
validation rounds (drmas/broker/evaluation.py) and the last metrics step; this module adds
the format, the time and `covered` (each model's newest complete learner checkpoint).

Consistency with the learners' checkpoints (each model saves its own, asynchronously):
on resume each model continues from the version v_m of its newest complete checkpoint
that the snapshot knows about (v_m <= the model's version in the snapshot). Work the
checkpoints do not hold is NOT in the snapshot; its tasks go back to the queue, in group
order, before the cursor moves on:
- groups leased to actors (in flight) when the snapshot was taken (their leases are
  counted under `leases_requeued_on_resume`, so lease accounting balances),
- groups accepted but still buffered or cut into a batch not yet trained,
- groups trained by model m after v_m (the "trained log": every trained group with its
  model and version, kept until a complete checkpoint of that model covers it).
Such a task is then served again as a new group; no group is trained twice by a model
within the model's version history (trained_groups after v_m are forgotten). Where a task
can repeat for a model (with fresh episodes, as a new group): a group that model A's
checkpoint holds but model B's does not (the models were on different sides of a
checkpoint) is re-served to both; and a group that one model dropped as stale (its task
requeued at the drop) while another model still buffered it comes back twice.

Complete learner checkpoints newer than the version a model resumes from belong to the
abandoned history and are set aside (renamed, never read); metrics lines of steps after
the resumed step move to metrics.rewound.jsonl so metrics.jsonl keeps increasing steps.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.checkpoints import store

if TYPE_CHECKING:
    from drmas.broker.state import BrokerState
    from drmas.config import DrmasConfig

log = logging.getLogger("drmas.broker")

FORMAT = 1


class BrokerCheckpoints:
    """Saves the broker's snapshots and, on resume, restores one into a BrokerState."""

    def __init__(self, cfg: DrmasConfig, run_dir: Path | None) -> None:
        self.cfg = cfg
        self.root = store.root_for(run_dir, cfg.checkpoint.dir) if run_dir else None
        self.every = cfg.checkpoint.every
        self.resumed: dict[str, Any] | None = None
        self.versions: dict[str, int] = {}
        if cfg.run.resume:
            resume_root = store.root_for(cfg.run.resume, cfg.checkpoint.dir)
            self.resumed = read_snapshot(resume_root / store.BROKER_STATE)
            self.versions = choose_versions(self.resumed, resume_root, sorted(cfg.models))
            if run_dir is not None:
                rewind_metrics(run_dir, min(self.versions.values()))
            for model, version in self.versions.items():
                for c in store.complete(resume_root / model):
                    if c.version > version:
                        moved = store.set_aside(c.path, "abandoned")
                        log.warning("%s: checkpoint v%d set aside (%s)", model, c.version, moved)

    def restore(self, state: BrokerState) -> None:
        """On resume: load the snapshot into a freshly built `state`."""
        if self.resumed is not None:
            state.restore(self.resumed, self.versions)

    def after_step(self, state: BrokerState, model: str, version: int) -> None:
        if self.every and version % self.every == 0:
            self.save(state, f"{model} v{version}")

    def save(self, state: BrokerState, why: str) -> None:
        if self.root is None:
            return
        start = time.monotonic()
        data = snapshot(state, self.root)
        store.write_json_atomic(self.root / store.BROKER_STATE, data)
        log.info(
            "broker state saved (%s): versions %s, %d groups to requeue on resume, %.3fs",
            why, data["versions"], len(data["pending"]) + len(data["trained_log"]),
            time.monotonic() - start,
        )  # fmt: skip


# ---------------------------------------------------------------------- snapshot
def snapshot(state: BrokerState, root: Path) -> dict[str, Any]:
    """The file's content: `state`'s snapshot, what the learners' checkpoints under `root`
    cover, format and time. Prunes the state's trained log to what no complete checkpoint
    covers (those groups never need to be trained again)."""
    covered = {m: _latest_version(root / m) for m in state.models}
    state.forget_trained(covered)
    return {"format": FORMAT, "time": time.time(), "covered": covered, **state.snapshot()}


def read_snapshot(path: Path) -> dict[str, Any]:
    """The broker's state as saved: JSON only (json.loads builds no objects but dicts,
    lists, strings and numbers), so the file cannot run code at a resume."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"run.resume: {path} does not exist; resume needs a run folder that was started "
            "with this version of drmas (its broker writes the file at every checkpoint)"
        ) from None
    except (ValueError, RecursionError) as err:
        raise ValueError(
            f"run.resume: {path} is not the broker's JSON ({type(err).__name__}); the file was "
            "changed or damaged: resume from a run folder whose broker.json drmas wrote"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"run.resume: {path} is not a JSON object; it was not written by drmas")
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} has format {data.get('format')}, this drmas reads {FORMAT}")
    return dict(data)


def choose_versions(snap: dict[str, Any], root: Path, models: list[str]) -> dict[str, int]:
    """Each model's resume version: its newest complete checkpoint that the snapshot knows
    (version <= the snapshot's) and that its trained log reaches back to (>= covered)."""
    if sorted(snap["versions"]) != models:
        raise ValueError(
            f"run.resume: the broker state is for models {sorted(snap['versions'])}, the "
            f"config has {models}; resume with the run's own config.yaml"
        )
    chosen = {}
    for m in models:
        known, covered = int(snap["versions"][m]), int(snap["covered"][m])
        usable = [c for c in store.complete(root / m) if covered <= c.version <= known]
        if usable:
            newest = max(usable, key=lambda c: c.version)
            store.check_format(newest.path, store.read_manifest(newest.path))  # before any learner
            chosen[m] = newest.version
        elif covered == 0:
            chosen[m] = 0  # nothing trained is covered by a checkpoint: start over
            if known:
                log.warning(
                    "%s reached v%d but %s holds no complete checkpoint of it: it starts over "
                    "from v0 (learners on other hosts must write to shared storage: set "
                    "checkpoint.dir)", m, known, root / m,
                )  # fmt: skip
        else:
            raise FileNotFoundError(
                f"run.resume: no complete checkpoint of {m} between v{covered} and v{known} "
                f"in {root / m}; the checkpoint folder does not match the broker state"
            )
    return chosen


def rewind_metrics(run_dir: Path, step: int) -> None:
    """Keep metrics.jsonl lines of steps <= `step`; later ones (to be redone) are appended
    to metrics.rewound.jsonl. Atomic (temp + os.replace)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    keep: list[str] = []
    moved: list[str] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            later = int(json.loads(line).get("step", 0)) > step
        except (ValueError, AttributeError):
            later = False
        (moved if later else keep).append(line)
    if moved:
        with (run_dir / "metrics.rewound.jsonl").open("a") as f:
            f.write("".join(x + "\n" for x in moved))
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in keep))
    tmp.replace(path)


def _latest_version(model_dir: Path) -> int:
    newest = store.latest(model_dir)
    return newest.version if newest else 0
