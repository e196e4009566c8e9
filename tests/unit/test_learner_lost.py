"""A learner that leaves mid-run stops the run unless its seat is taken back in time
(drmas/broker/seats.py: a cancelled learner job used to leave the run waiting for ever).

The policy on its own (times are plain numbers), then through the broker loop: the seat
left with a reason that names a Slurm job, nobody takes it back, every peer is told
Shutdown with that reason, the loop ends and broker_summary.json keeps it."""

from __future__ import annotations

import collections
import json
import os
import signal
import threading
from pathlib import Path

from drmas.broker.seats import LearnerSeats
from drmas.broker.server import BrokerServer
from drmas.config import load_config
from drmas.config.broker import BrokerConfig
from drmas.protocol.messages import Goodbye, Shutdown
from drmas.transports.channel import BrokerClient

STEPS = 5
REJOIN = 60.0
TIMEOUT = 600.0
SIGTERM = "SIGTERM to pid 4242 on gpu03, Slurm job 812 task 0"


def seats(**versions: int) -> LearnerSeats:
    """solver and verifier ranks 0 and 1 seated at t=0, the models at `versions`."""
    broker = BrokerConfig(learner_timeout_s=TIMEOUT, learner_rejoin_s=REJOIN)
    s = LearnerSeats(broker, {"solver": 0, "verifier": 0, **versions}, STEPS)
    for model in ("solver", "verifier"):
        for rank in (0, 1):
            s.add(f"learner-{model}-{rank}", model, rank, 2, 0.0, "gpu03", 4242 + rank)
    return s


def reap(s: LearnerSeats, now: float) -> None:
    """Everyone still seated was heard from just now: only the reap of vacancies acts."""
    for record in s.values():
        record.last_seen = now
    s.reap(now, collections.Counter())


def test_a_seat_taken_back_within_the_window_keeps_the_run() -> None:
    s = seats(solver=3, verifier=3)
    s.leave("learner-solver-1", SIGTERM, 10.0)
    reap(s, 50.0)
    assert s.vacant and not s.lost  # 40 s vacant < 60 s
    s.add("learner-solver-1", "solver", 1, 2, 60.0, "gpu04", 77)  # the rank restarted
    assert not s.vacant
    reap(s, 10.0 + 10 * REJOIN)
    assert not s.lost


def test_a_seat_not_taken_back_stops_the_run_naming_the_rank_and_why() -> None:
    s = seats(solver=3, verifier=2)
    s.leave("learner-solver-1", SIGTERM, 10.0)
    reap(s, 10.0 + REJOIN)  # exactly the window: not yet
    assert not s.lost
    reap(s, 10.0 + REJOIN + 1)
    assert s.lost.startswith(
        "learner solver rank 1 ('learner-solver-1' on gpu03 pid 4243) left at version 3: "
        "SIGTERM to pid 4242 on gpu03, Slurm job 812 task 0; nobody took the seat back within "
        "broker.learner_rejoin_s=60 s, so the run stops."
    ), s.lost
    assert "run.resume=RUN_DIR" in s.lost
    said = s.lost
    s.leave("learner-verifier-0", "", 80.0)  # told Shutdown, the others leave: no new reason
    reap(s, 500.0)
    assert s.lost == said


def test_both_ranks_of_a_cancelled_job_are_named() -> None:
    s = seats(solver=1)
    s.leave("learner-solver-0", "SIGTERM, Slurm job 812 task 0", 0.0)
    s.leave("learner-solver-1", "SIGTERM, Slurm job 812 task 1", 0.5)
    reap(s, 61.0)
    assert "solver rank 0 " in s.lost and "Slurm job 812 task 0" in s.lost
    assert "solver rank 1 " in s.lost and "Slurm job 812 task 1" in s.lost


def test_goodbyes_at_the_normal_end_stop_nothing() -> None:
    s = seats(solver=STEPS, verifier=4)
    s.leave("learner-solver-0", "", 0.0)  # solver done: its ranks leave while verifier trains
    s.leave("learner-solver-1", "", 0.0)
    reap(s, 1000.0)
    assert not s.vacant and not s.lost
    s.versions["verifier"] = STEPS
    s.leave("learner-verifier-0", "", 1000.0)
    s.leave("learner-verifier-1", "", 1000.0)
    reap(s, 5000.0)
    assert not s and not s.vacant and not s.lost


def test_a_silent_rank_is_reaped_and_then_stops_the_run() -> None:
    s = seats(solver=2)
    s.reap(TIMEOUT + 1, collections.Counter())  # nobody heard from since t=0: all four dropped
    assert len(s.vacant) == 4 and not s.lost
    s.reap(TIMEOUT + 1 + REJOIN + 1, collections.Counter())
    assert "learner solver rank 0 ('learner-solver-0' on gpu03 pid 4242) left at version 2: " in (
        s.lost
    )
    assert "silent for 600 s (broker.learner_timeout_s), no Goodbye" in s.lost


def test_a_model_that_finishes_meanwhile_is_not_lost() -> None:
    """A rank 1 that fails after rank 0 reported the last step: the model is done."""
    s = seats(solver=4)
    s.leave("learner-solver-1", "", 0.0)
    s.versions["solver"] = STEPS
    reap(s, 100.0)
    assert not s.lost


def loop_server(tmp_path: Path, *overrides: str, run_dir: bool = True) -> BrokerServer:
    """A broker over two models whose folder holds only a config (vocabulary 64), 3 steps
    of 2 groups of 2, no validation, no trackers, plus `overrides`; its run folder in
    tmp_path/run unless `run_dir` is False."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 64}))
    run = tmp_path / "run"
    cfg = load_config(
        [f"models.solver.path={folder}", f"models.verifier.path={folder}", "val.every=0",
         "train.steps=3", "group_size=2", "batch_groups=2", "logger=[]", *overrides,
         *([f"run.dir={run}"] if run_dir else [])]
    )  # fmt: skip
    if run_dir:
        run.mkdir()
    return BrokerServer(cfg, run if run_dir else None)


def say_hello(server: BrokerServer, actor: str) -> dict[str, BrokerClient]:
    """Both models' rank-0 learners and one actor, each welcomed by `server`."""
    peers = {}
    for cid, role, models in [
        ("learner-solver-0", "learner", ["solver"]),
        ("learner-verifier-0", "learner", ["verifier"]),
        (actor, "actor", ["solver", "verifier"]),
    ]:
        peers[cid] = BrokerClient(server.address, cid)
        peers[cid].hello(role, models, timeout_s=10)  # type: ignore[arg-type]
    return peers


def test_the_broker_loop_stops_a_run_that_lost_a_learner(tmp_path: Path) -> None:
    server = loop_server(tmp_path, "broker.learner_rejoin_s=0.5")
    loop = threading.Thread(target=server.serve, kwargs={"max_seconds": 60}, daemon=True)
    loop.start()
    peers: dict[str, BrokerClient] = {}
    try:
        peers = say_hello(server, "actor-0")
        peers["learner-solver-0"].send(Goodbye("learner-solver-0", reason=SIGTERM))
        for cid in ("learner-verifier-0", "actor-0"):
            told = peers[cid].recv(20)
            assert isinstance(told, Shutdown), told
            assert "'learner-solver-0'" in told.reason and "Slurm job 812 task 0" in told.reason
        peers["learner-verifier-0"].send(Goodbye("learner-verifier-0"))
        loop.join(20)
        assert not loop.is_alive(), "the broker did not end once the learners had left"
    finally:
        server._stop = "the test is over"
        loop.join(10)
        for peer in peers.values():
            peer.close()
    summary = json.loads((tmp_path / "run" / "broker_summary.json").read_text())
    assert summary["done"] is False
    assert summary["learner_lost"] == server.state.learners.lost
    assert "solver rank 0" in summary["learner_lost"] and "Slurm job 812" in summary["learner_lost"]


def test_a_signal_stops_the_broker_gracefully(tmp_path: Path) -> None:
    """SIGTERM to the broker (drmas train's Ctrl-C, a scheduler's stop): every client, an
    actor attached from elsewhere too, is told Shutdown at once; the broker serves on
    while a learner is still at work (it saves before it leaves), and ends when the last
    learner says Goodbye, with broker_summary.json written."""
    server = loop_server(tmp_path)
    previous = signal.getsignal(signal.SIGTERM)
    server.install_signal_handlers()  # this thread's: the loop runs in another
    loop = threading.Thread(target=server.serve, kwargs={"max_seconds": 60}, daemon=True)
    loop.start()
    peers: dict[str, BrokerClient] = {}
    try:
        peers = say_hello(server, "extra-actor")
        os.kill(os.getpid(), signal.SIGTERM)
        for peer in peers.values():
            told = peer.recv(20)
            assert isinstance(told, Shutdown), told
            assert told.reason == "the broker was stopped (SIGTERM)"
        peers["learner-solver-0"].send(Goodbye("learner-solver-0"))
        loop.join(2)
        assert loop.is_alive(), "the broker ended while the verifier's learner was at work"
        peers["learner-verifier-0"].send(Goodbye("learner-verifier-0"))
        loop.join(20)
        assert not loop.is_alive(), "the broker did not end once the learners had left"
    finally:
        signal.signal(signal.SIGTERM, previous)
        server._stop = "the test is over"
        loop.join(10)
        for peer in peers.values():
            peer.close()
    summary = json.loads((tmp_path / "run" / "broker_summary.json").read_text())
    assert summary["done"] is False and summary["leases"]["balanced"] == 1


def test_a_second_signal_stops_the_broker_at_once(tmp_path: Path) -> None:
    """A learner that never leaves cannot hold a stopped broker: a second signal ends it
    without waiting for broker.stop_grace_s."""
    server = loop_server(tmp_path, "broker.stop_grace_s=600", run_dir=False)
    previous = signal.getsignal(signal.SIGTERM)
    server.install_signal_handlers()
    loop = threading.Thread(target=server.serve, kwargs={"max_seconds": 120}, daemon=True)
    loop.start()
    learner = BrokerClient(server.address, "learner-solver-0")
    try:
        learner.hello("learner", ["solver"], timeout_s=10)
        os.kill(os.getpid(), signal.SIGTERM)
        assert isinstance(learner.recv(20), Shutdown)
        loop.join(1)
        assert loop.is_alive()  # the learner is still at work: the broker waits
        os.kill(os.getpid(), signal.SIGTERM)
        loop.join(20)
        assert not loop.is_alive(), "a second SIGTERM did not stop the broker"
    finally:
        signal.signal(signal.SIGTERM, previous)
        server._stop = "the test is over"
        loop.join(10)
        learner.close()
