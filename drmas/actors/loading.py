"""An actor's load of a weight publish into an engine that lives in its own process (hf,
sim): the receive from learner rank 0's weight group (drmas/transports/weights/receiver.py)
and where the load's time went. Actor.sync_weights (main.py) decides when a load runs,
resumes the engine and answers the broker with WeightsLoaded.

The engine is paused (and its weights kept aside, RollsBack) only when the first bucket
has arrived (`Pausing`): the roll call and the group's rendezvous, which may wait up to
weights.join_timeout_s for the other members and fail when one never joins, cost the
engine no generation, and a publish that fails before its first bucket leaves it as it was.

Engines whose workers join the group themselves (vLLM, SGLang: ReceivesWeights) do not
come through here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from itertools import pairwise

from drmas.actors.engines import ReadsBack, RollsBack
from drmas.actors.engines.base import Engine
from drmas.config import DrmasConfig
from drmas.config.model import weights_dtype
from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.weights import NamedTensors, WeightReceiver

log = logging.getLogger("drmas.actor")


def wants_digest(cfg: DrmasConfig, model: str) -> bool:
    """Whether the actor fingerprints what it loads of `model`: weights.verify_digest, and
    the engine holds the dtype the learner sends (a cast changes the bytes)."""
    same_dtype = cfg.actor.engine_of(model).dtype == weights_dtype(cfg.models[model].precision)
    return cfg.weights.verify_digest and same_dtype


class Pausing:
    """Pauses an engine at most once for a load, keeping its weights aside first when it
    can roll back (`backup`); `paused` says whether anything of the engine was touched (a
    failed load then restores or quarantines it; else it serves on as it was). Each step is
    a mark in `marks` (where the load's time went)."""

    def __init__(self, engine: Engine, marks: list[tuple[str, float]]) -> None:
        self.engine, self.marks = engine, marks
        self.paused = False
        self.backup: object | None = None

    async def __call__(self) -> None:
        if self.paused:
            return
        self.marks.append(("pause", time.monotonic()))
        await self.engine.pause()
        self.paused = True
        self.marks.append(("backup", time.monotonic()))
        if isinstance(self.engine, RollsBack):
            self.backup = self.engine.backup_weights()
        self.marks.append(("receive", time.monotonic()))


async def load_here(
    engine: Engine,
    receiver: WeightReceiver,
    join: JoinWeightGroup,
    want_digest: bool,
    pausing: Pausing,
) -> str:
    """Receive `join`'s publish into `engine` in a worker thread, pausing it when the first
    bucket is in (`pausing`, run on this event loop); returns the fingerprint of what it
    now serves ("" unless `want_digest`). An engine that reads back (ReadsBack) has its
    loaded tensors hashed as each bucket goes in: that one pass checks rank 0's digest and
    is the fingerprint; others are fingerprinted after the load (a "digest" mark)."""
    loop = asyncio.get_running_loop()

    def load(tensors: NamedTensors) -> None:
        if not pausing.paused:  # the first bucket: from here on the engine is changed
            asyncio.run_coroutine_threadsafe(pausing(), loop).result(join.timeout_s)
        engine.load_weights(tensors, join.version)
        _fault_kill_mid_sync(join)

    live = engine.loaded_view() if want_digest and isinstance(engine, ReadsBack) else None
    got = await asyncio.to_thread(receiver.receive_into, join, load, None, live)
    if got.tensors == 0:  # a LoRA publish of no adapter: the version alone
        await pausing()
        engine.load_weights([], join.version)
    if not want_digest or got.digest:
        return got.digest
    pausing.marks.append(("digest", time.monotonic()))
    return engine.weights_digest()


def _fault_kill_mid_sync(join: JoinWeightGroup) -> None:
    """Fault injection for tests: DRMAS_FAULT_KILL_IN_WEIGHTS=MODEL:VERSION SIGKILLs this
    actor right after the first bucket of a publish of MODEL at VERSION or later arrived,
    i.e. in the middle of a weight broadcast (tests/integration/test_faults.py)."""
    spec = os.environ.get("DRMAS_FAULT_KILL_IN_WEIGHTS", "")
    if spec:
        model, _, version = spec.partition(":")
        if join.model == model and join.version >= int(version or 0):
            log.warning("fault injection: SIGKILL in the middle of %s", join.group_name)
            os.kill(os.getpid(), signal.SIGKILL)


def log_load(join: JoinWeightGroup, ok: bool, marks: list[tuple[str, float]]) -> None:
    """One line per load: its seconds and where they went (`marks`: (phase, start)...)."""
    parts = ", ".join(f"{what} {b - a:.2f}" for (what, a), (_, b) in pairwise(marks))
    seconds = marks[-1][1] - marks[0][1]
    state = "loaded" if ok else "not loaded"
    log.info("%s v%d %s in %.2fs (%s)", join.model, join.version, state, seconds, parts)
