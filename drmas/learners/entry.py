"""The one way a learner rank starts. `drmas learner`, `python -m drmas.learners` (under
torchrun) and a Slurm learner task (drmas/launch/slurm.py) all come here.

The rank's place in its group comes from the environment its launcher set: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun, `drmas train`, or Slurm via
drmas/launch/slurm.py). It is checked against the config before torch is imported, so a
wrong invocation answers at once with a ConfigError that says what to run. Then this
process's torch threads and logging are set and drmas/learners/main.py's Learner runs.
SIGTERM and SIGINT make the rank tell the broker why it leaves, then exit at once
(drmas/learners/leaving.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from functools import partial
from typing import TYPE_CHECKING, NoReturn

from drmas.config import ConfigError
from drmas.learners.leaving import Leaving
from drmas.threads import env_threads
from drmas.transports.ports import free_port

if TYPE_CHECKING:
    from drmas.config import DrmasConfig
    from drmas.learners.main import Learner
    from drmas.transports.channel import BrokerClient


def start(cfg: DrmasConfig, model: str) -> NoReturn:
    """Run this process as one rank of `model`'s learner group, then leave the process.

    Raises ConfigError (before anything starts) for a wrong invocation, and whatever the
    learner raised when it failed. A finished learner leaves with os._exit(0) after
    flushing its logs: everything is saved and the process groups are destroyed, and the
    interpreter's teardown of torch's C++ objects once aborted a finished rank (a gloo
    thread still joinable: "terminate called without an active exception", exit -6, seen
    on a rank > 0 in a loaded CI run), which made `drmas train` stop a finished run as
    failed."""
    run(cfg, model)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(cfg: DrmasConfig, model: str) -> None:
    """Everything `start` does except leaving the process, for a caller that must return
    (a Slurm job writes its result once its function returns)."""
    rank, world_size = group_place(cfg, model)
    set_rendezvous(cfg, model, world_size)
    try:
        threads = cpu_threads(cfg.learner.threads)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    logging.basicConfig(  # a no-op when the caller (drmas learner) set up logging already
        level=os.environ.get("DRMAS_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s learner[{model}:{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import torch

    if threads:
        torch.set_num_threads(threads)
    from drmas.learners.main import Learner

    learner = Learner(cfg, model, rank, world_size)
    leaving = Leaving(model, rank, partial(_connection, learner))
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:  # signal handlers can only be set there
        leaving.install()
    try:
        learner.run()
    finally:
        if main_thread:
            leaving.uninstall()


def _connection(learner: Learner) -> BrokerClient | None:
    """The rank's broker connection, None before it has said Hello."""
    try:
        return learner.client
    except RuntimeError:
        return None


def group_place(cfg: DrmasConfig, model: str) -> tuple[int, int]:
    """(RANK, WORLD_SIZE) from the environment (alone: 0 of 1), checked against the config."""
    if model not in cfg.models:
        raise ConfigError(
            f"--model {model!r} is not one of the run's models {sorted(cfg.models)}: "
            "pass the name of the model this learner group trains"
        )
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    expected = cfg.world_size_of(model)
    if world_size != expected:
        raise ConfigError(
            f"WORLD_SIZE={world_size} but the config gives model {model!r} {expected} learner "
            f"rank(s) (models.{model}.world_size, else learner.world_size): start that many, "
            f"e.g. torchrun --nproc-per-node {expected} -m drmas.learners --config "
            f"RUN_DIR/config.yaml --model {model}"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"RANK={rank} is not in 0..{world_size - 1} (WORLD_SIZE={world_size}): let torchrun "
            "set RANK"
        )
    return rank, world_size


def set_rendezvous(cfg: DrmasConfig, model: str, world_size: int) -> None:
    """MASTER_ADDR (default loopback) and MASTER_PORT (learner.master_port, else a free port
    for a group of one) of the group's torch.distributed rendezvous, unless already set."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in os.environ:
        return
    if cfg.learner.master_port:
        os.environ["MASTER_PORT"] = str(cfg.learner.master_port)
    elif world_size == 1:
        os.environ["MASTER_PORT"] = str(free_port())
    else:
        raise ConfigError(
            f"MASTER_PORT is not set for {model!r}'s {world_size} learner ranks: start them "
            f"with torchrun --nproc-per-node {world_size} -m drmas.learners --config "
            f"RUN_DIR/config.yaml --model {model} (it sets the rendezvous), or set MASTER_ADDR "
            "and learner.master_port the same for every rank"
        )


def cpu_threads(setting: int) -> int:
    """Threads for this process's torch ops: `setting` (learner.threads) if > 0, else the
    plan `drmas train` hands its children in DRMAS_TORCH_THREADS, else 0 (keep torch's
    default). ValueError for a DRMAS_TORCH_THREADS that is not a whole number >= 1."""
    if setting > 0:
        return setting
    return env_threads() or 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number: unset it or let torchrun set it"
        ) from None
