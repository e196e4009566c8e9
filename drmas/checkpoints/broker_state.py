"""The broker's checkpoint: snapshot and restore of BrokerState (drmas/broker/state.py).

Written by the broker (drmas/broker/server.py) to CHECKPOINT_ROOT/broker.json, atomically
(temp file + os.replace): when a model reports a step that is a multiple of
`checkpoint.every`, and when the broker stops (end of run, or brought down because a
learner died). Read back by the broker on `run.resume`.

What is saved: the task source's cursor (epoch, index, seed, requeued tasks), model
versions, counters, group ids trained per model, the next lease/group ids, the validation
rounds and the last metrics step.

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

from drmas.broker.evaluation import EvalRound
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
            restore(state, self.resumed, self.versions)

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
    """JSON-able state. Prunes `state.trained_log` to what no complete checkpoint covers."""
    covered = {m: _latest_version(root / m) for m in state.models}
    state.trained_log[:] = [e for e in state.trained_log if e[1] > covered[e[0]]]
    pending: dict[int, str] = {}  # group id -> task id, not trained by any model yet
    for record in state.table.leases.values():
        if record.eval_round is None:
            pending[record.lease.group_id] = record.task.task_id
    for buf in state.buffers.values():
        for part in [*buf.slices, *(p for b in buf.cut.values() for p in b.slices)]:
            pending[part.group_id] = part.task.task_id
    return {
        "format": FORMAT,
        "time": time.time(),
        "run_id": state.run_id,
        "versions": dict(state.versions),
        "covered": covered,
        "source": state.source.state(),
        "pending": sorted([g, t] for g, t in pending.items()),
        "trained_log": [list(e) for e in state.trained_log],
        "trained_groups": {m: sorted(g) for m, g in state.trained_groups.items()},
        "accepted_groups": sorted(state.accepted_groups),
        "counters": dict(state.counters),
        "outstanding_leases": len(state.table.leases),
        "next_lease": state.table._next_lease,
        "next_group": state.table._next_group,
        "eval": {
            "scheduled": sorted(state.eval_scheduled),
            "rounds": {
                str(s): {"task_ids": [t.task_id for t in r.tasks], "successes": r.successes}
                for s, r in state.eval_rounds.items()
            },
        },
        "metrics_step": max(state.metrics.flushed, default=0),
    }


def read_snapshot(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"run.resume: {path} does not exist; resume needs a run folder that was started "
            "with this version of drmas (its broker writes the file at every checkpoint)"
        ) from None
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
        usable = [c.version for c in store.complete(root / m) if covered <= c.version <= known]
        if usable:
            chosen[m] = max(usable)
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


def restore(state: BrokerState, snap: dict[str, Any], versions: dict[str, int]) -> None:
    """Put `snap` into a freshly built `state`, continuing every model at `versions`."""
    state.source.load_state(snap["source"])
    retrain = {m: {g for mm, v, g, _ in snap["trained_log"] if mm == m and v > versions[m]}
               for m in state.models}  # fmt: skip
    requeue = {int(g): t for g, t in snap["pending"]}
    requeue |= {int(g): t for m, v, g, t in snap["trained_log"] if v > versions[m]}
    tasks = {t.task_id: t for t in state.source.train}
    for group_id in sorted(requeue, reverse=True):  # requeue() puts in front: oldest first
        state.source.requeue(tasks[requeue[group_id]])
    state.versions.update(versions)
    for m, buf in state.buffers.items():
        buf.batches_cut = versions[m]
        state.trained_groups[m] = set(snap["trained_groups"][m]) - retrain[m]
    state.accepted_groups = set(snap["accepted_groups"])
    state.counters.clear()
    state.counters.update(snap["counters"])
    state.counters["leases_requeued_on_resume"] += int(snap["outstanding_leases"])
    state.counters["groups_requeued_on_resume"] += len(requeue)
    state.counters["resumes"] += 1
    state.table._next_lease = int(snap["next_lease"])
    state.table._next_group = int(snap["next_group"])
    state.trained_log.clear()

    step = min(versions.values())  # validation rounds of steps after it are redone
    val = {t.task_id: t for t in state.source.val_tasks()}
    state.eval_scheduled = {s for s in snap["eval"]["scheduled"] if s <= step}
    state.eval_rounds.clear()
    state.eval_queue.clear()
    for key, saved in sorted(snap["eval"]["rounds"].items(), key=lambda kv: int(kv[0])):
        s = int(key)
        if s > step:
            continue
        tasks_of_round = [val[t] for t in saved["task_ids"]]
        rnd = EvalRound(s, tasks_of_round, state.cfg.val.n, state.cfg.val.k)
        rnd.successes = {k: int(v) for k, v in saved["successes"].items()}
        state.eval_rounds[s] = rnd
        state.eval_queue.extend((t, s) for t in tasks_of_round if t.task_id not in rnd.successes)
    # Lines up to the lowest resumed version stay (later ones were moved to
    # metrics.rewound.jsonl); a step between the lowest and a model's own version is
    # written again once the models behind report it: the models already past it count
    # as reported (their re-publish on resume is not a new line either).
    state.metrics.flushed.update(range(step + 1))
    for s in range(step + 1, max(versions.values()) + 1):
        state.metrics.reported[s] = {
            (m, part) for m, v in versions.items() if v >= s for part in ("step", "publish")
        }
    log.info(
        "broker resumed: versions %s, cursor epoch %d index %d, %d leases were in flight, "
        "requeued tasks %s",
        versions, snap["source"]["epoch"], snap["source"]["index"], snap["outstanding_leases"],
        json.dumps([requeue[g] for g in sorted(requeue)]),
    )  # fmt: skip


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
