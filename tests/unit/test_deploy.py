"""Deploy configs (configs/deploy) and the Slurm entry point, without a cluster."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drmas.config import ConfigError, load_config
from drmas.launch.slurm import _first_host, task_threads, torch_distributed_env
from drmas.transports.weights import advertised_host


def test_multinode_needs_an_explicit_broker_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRMAS_BROKER_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=r"broker\.address"):
        load_config(["deploy=multinode"])  # neither DRMAS_BROKER_ADDRESS nor an override
    cfg = load_config(["deploy=multinode", "broker.address=tcp://10.0.0.1:5555"])
    assert cfg.broker.address == "tcp://10.0.0.1:5555"
    assert cfg.weights.host == "auto" and cfg.security.curve
    slurm = load_config(["deploy=slurm", "broker.address=tcp://10.0.0.1:5555"])
    assert slurm.security.curve and slurm.weights.host == "auto"


def test_local_is_the_default_and_stays_on_loopback() -> None:
    cfg = load_config([])
    assert cfg.broker.address.startswith("tcp://127.0.0.1:")
    assert cfg.weights.host == "127.0.0.1" and not cfg.security.curve


def test_weights_host_auto_follows_the_route_to_the_broker() -> None:
    assert advertised_host("auto", "tcp://127.0.0.1:5555") == "127.0.0.1"
    assert advertised_host("10.0.0.7", "tcp://127.0.0.1:5555") == "10.0.0.7"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node7", "node7"), ("a1,b2", "a1"), ("gpu[03-05,07]", "gpu03"), ("gpu[12]", "gpu12")],
)
def test_first_host_of_a_slurm_nodelist(nodelist: str, first: str) -> None:
    assert _first_host(nodelist) == first


def test_learner_task_reads_its_rank_from_slurm() -> None:
    env = torch_distributed_env(
        {
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "4",
            "SLURM_JOB_NODELIST": "gpu[01-02]",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert env == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu01",
        "MASTER_PORT": str(20000 + 123456 % 20000),
    }
    with pytest.raises(RuntimeError, match="not inside a Slurm task"):
        torch_distributed_env({})


def test_slurm_learner_port_is_chosen_as_drmas_learner_chooses_it() -> None:
    task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1",
            "SLURM_JOB_ID": "41"}  # fmt: skip
    assert torch_distributed_env(task)["MASTER_PORT"] == "20041"  # every task derives it
    assert torch_distributed_env(task, master_port=29500)["MASTER_PORT"] == "29500"
    assert torch_distributed_env({**task, "MASTER_PORT": "1234"}, 29500)["MASTER_PORT"] == "1234"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SLURM_CPUS_PER_TASK": "4"}, {"DRMAS_TORCH_THREADS": "4"}),
        ({"SLURM_CPUS_PER_TASK": "4", "DRMAS_TORCH_THREADS": "2"}, {}),  # the user's choice
        ({}, {}),  # no --cpus-per-task: keep drmas's default
        ({"SLURM_CPUS_PER_TASK": "0"}, {}),
    ],
)
def test_a_slurm_task_takes_the_cpus_slurm_gave_it(
    environ: dict[str, str], expected: dict[str, str]
) -> None:
    assert task_threads(environ) == expected


def _installed(module: str) -> bool:
    """Whether `module` can be imported (find_spec of a submodule raises when its parent
    package is missing too: hydra_plugins is only there with a Hydra plug-in)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(
    not _installed("hydra_plugins.hydra_submitit_launcher"),
    reason="hydra-submitit-launcher not installed (pip install 'drmas[slurm]')",
)
def test_slurm_launch_config_composes_with_the_submitit_launcher() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "drmas.launch.slurm",
            "--cfg",
            "hydra",
            "run_config=/x",
            "role=actor",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SlurmLauncher" in out.stdout and "tasks_per_node: 1" in out.stdout


SLURM_TASK = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "gpu01"}


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("critic", r"model='critic' is not one of the run's models"),
        ("solver", r"this job has 3 tasks but model 'solver' has 1 learner ranks: set "
         r"hydra\.launcher\.tasks_per_node"),
    ],
)  # fmt: skip
def test_slurm_learner_task_refuses_a_job_that_does_not_fit_the_model(
    monkeypatch: pytest.MonkeyPatch, model: str, message: str
) -> None:
    from drmas.launch.slurm import learner_task

    for name, value in SLURM_TASK.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=message):
        learner_task(load_config([]), model)
    assert "RANK" not in os.environ  # refused before the rank's environment was set


@pytest.mark.skipif(
    importlib.util.find_spec("submitit") is None,
    reason="submitit not installed (pip install 'drmas[slurm]')",
)
@pytest.mark.parametrize(("outcome", "code"), [("success", 0), ("error", 3), (None, 3)])
def test_a_finished_slurm_learner_leaves_as_drmas_learner_does(
    tmp_path: Path, outcome: str | None, code: int
) -> None:
    """Once submitit has written a successful result, the task leaves with os._exit(0) at
    interpreter exit (torch's teardown cannot turn it into a failed job); with an error
    result or none the exit status is the interpreter's own (here 3)."""
    if outcome is not None:
        from submitit.core.utils import cloudpickle_dump

        cloudpickle_dump((outcome, None), tmp_path / "7_0_result.pkl")
    script = (
        "import atexit, sys\n"
        "from drmas.launch.slurm import _leave_once_the_result_is_written\n"
        "atexit.register(_leave_once_the_result_is_written)\n"
        "sys.exit(3)\n"
    )
    env = {**os.environ, "SUBMITIT_FOLDER": str(tmp_path), "SUBMITIT_EXECUTOR": "slurm",
           "SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_JOB_NODELIST": "n1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], env=env, timeout=120)
    assert out.returncode == code


def test_the_controller_names_each_job_as_submitit_does() -> None:
    from drmas.launch.slurm_jobs import parse_jobs

    text = (
        "JobId=7 ArrayJobId=7 ArrayTaskId=0 JobName=drmas-actor JobState=CANCELLED "
        "Reason=None NodeList=n1\n"
        "JobId=8 ArrayJobId=7 ArrayTaskId=1 JobName=drmas-actor JobState=RUNNING NodeList=n1\n"
        "JobId=9 ArrayJobId=9 ArrayTaskId=0-1%2 JobState=PENDING NodeList=(null)\n"
        "JobId=12 JobName=wrap JobState=COMPLETED NodeList=n2\n"
    )
    assert parse_jobs(text) == {
        "7_0": {"JobID": "7_0", "State": "CANCELLED", "NodeList": "n1"},
        "7_1": {"JobID": "7_1", "State": "RUNNING", "NodeList": "n1"},
        "12": {"JobID": "12", "State": "COMPLETED", "NodeList": "n2"},
    }  # the pending range names no single element: not ended, left out
