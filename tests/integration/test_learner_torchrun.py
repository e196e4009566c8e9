"""A learner group started by hand exactly as docs/deploy.md's multi-node section says:
`drmas prepare`, `drmas broker --config RUN/config.yaml`, `drmas actor --config ...` and

    torchrun --nnodes 1 --nproc-per-node 2 -m drmas.learners --config RUN/config.yaml --model NAME

(`python -m torch.distributed.run` is torchrun's own module; a free --master-port keeps
parallel test runs off torchrun's default port). The group trains against the real
broker, publishes to the actor, saves, and every process exits 0 on its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from drmas.checkpoints import store
from drmas.transports.ports import free_port
from tests.integration.conftest import REPO, drmas, read_metrics, read_summary

pytestmark = pytest.mark.slow

STEPS = 2
SHORT = [
    f"train.steps={STEPS}",
    "group_size=4",
    "batch_groups=2",
    "val.every=0",
    "experiment=tiny_math_shared",
    "models.policy.warmstart.steps=60",  # the short build the other runs share
    "learner.world_size=2",
    # margin for a loaded 2-core machine
    "broker.heartbeat_timeout_s=10",
    "weights.timeout_s=10",
]


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    # each role takes one torch thread: 4 processes share the CI machine's 2 cores
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DRMAS_TORCH_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_torchrun_learner_group_trains_and_exits_cleanly(tmp_path: Path, model_cache: Path) -> None:
    run_dir = tmp_path / "run"
    prep = drmas("prepare", *SHORT, f"run.dir={run_dir}", f"run.cache_dir={model_cache}")
    assert prep.returncode == 0, prep.stderr[-3000:]
    config = str(run_dir / "config.yaml")
    cli = [sys.executable, "-m", "drmas.launch.cli"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port())]
    logs = {role: tmp_path / f"{role}.log" for role in ("broker", "actor", "learners")}
    broker = start([*cli, "broker", "--config", config], logs["broker"])
    actor = start([*cli, "actor", "--config", config, "--id", "actor-0"], logs["actor"])
    learners = start(
        [*torchrun, "--nnodes", "1", "--nproc-per-node", "2",
         "-m", "drmas.learners", "--config", config, "--model", "policy"],
        logs["learners"],
    )  # fmt: skip
    try:
        learners.wait(600)
        broker.wait(120)  # a finished broker exits once every learner rank said Goodbye
        actor.wait(120)  # and tells its actors to stop
    finally:
        for proc in (learners, broker, actor):
            stop(proc)
        for role, log in logs.items():  # shown when the test fails
            print(f"--- {role} log tail:\n{log.read_text()[-3000:]}")
    assert (learners.returncode, broker.returncode, actor.returncode) == (0, 0, 0)

    text = logs["learners"].read_text()
    for rank in (0, 1):
        assert f"policy rank {rank}/2 ready at version 0" in text
    assert "Traceback" not in text and "terminate called" not in text
    train = [x for x in read_metrics(run_dir) if "val/tasks" not in x]
    assert [x["step"] for x in train] == list(range(1, STEPS + 1))
    assert all("loss/policy" in x and "weight_sync_s/policy" in x for x in train)
    summary = read_summary(run_dir)
    assert summary["trained_groups"]["policy"] == STEPS * 2  # train.steps × batch_groups
    # every publish the actor needs reached it: all but the last step's, which the broker
    # plans without members (no validation and no generation uses those weights; or the
    # actor was told to stop already)
    assert summary["counters"]["weight_loads"] == STEPS - 1
    # the end is checkpointed by both ranks and the model saved as an HF folder
    checkpoint = store.find(store.root_for(str(run_dir), "") / "policy", STEPS)
    assert checkpoint is not None and checkpoint.world_size == 2
    assert load_file(str(run_dir / "models" / "policy" / "model.safetensors"))
