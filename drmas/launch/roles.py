"""Single-role entry points that need more than one call (the broker)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from drmas.config import DrmasConfig

log = logging.getLogger("drmas.broker")


def run_broker(cfg: DrmasConfig) -> int:
    from drmas.broker.server import BrokerServer

    # run.resume continues in the resumed run's folder unless run.dir names another
    folder = cfg.run.dir or cfg.run.resume
    run_dir = Path(folder) if folder else None
    if run_dir:
        run_dir.mkdir(parents=True, exist_ok=True)
    server = BrokerServer(cfg, run_dir)
    server.install_signal_handlers()
    print(f"drmas broker listening on {server.address}", flush=True)
    server.serve()
    lost = server.state.learners.lost  # a learner left mid-run: drmas/broker/seats.py
    if lost:
        print(f"drmas broker: {lost} (RUN_DIR: {run_dir})", file=sys.stderr, flush=True)
        return 1
    return 0
