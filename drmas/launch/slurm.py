"""`python -m drmas.launch.slurm -m role=learner|actor ...`: drmas roles as Slurm jobs.

Hydra's submitit launcher (pip install 'drmas[slurm]') turns each sweep value into a job
and a sweep over `index` into a job array; configs/slurm/launch.yaml and the role's file
in configs/slurm/role/ hold the job's resources (partition, GPUs, CPUs, time). Each job
loads the run's resolved config (written by `drmas prepare`) and runs one role against the
broker at its explicit address:

  learner: one job per model, `tasks_per_node` x `nodes` tasks = the model's world size;
           every task reads its rank and the rendezvous from Slurm's environment and
           starts like any learner rank (drmas/learners/entry.py, as `drmas learner`).
  actor:   one array element per actor, id actor-<index>-<host>.

The submitting command waits for its jobs and exits non-zero when one failed or ended
without a result, naming it (submitit reads each job's result; drmas/launch/slurm_jobs.py
asks the controller for jobs that ended without one), so start one per learner group and
per actor array in the background. The broker is not a Slurm job: it runs on the head node whose address the
config names. Talks to: the broker (as the role it runs), nothing else.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

ROLES = ("learner", "actor")


def torch_distributed_env(environ: dict[str, str], master_port: int = 0) -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT of a Slurm task (srun sets
    SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NODELIST, SLURM_JOB_ID).

    The port is chosen as `drmas learner` chooses it: MASTER_PORT if set, else
    `master_port` (learner.master_port) if not 0. Otherwise every task of the job derives
    the same one from the job id: tasks cannot agree on a free port without talking."""
    missing = [
        k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST") if k not in environ
    ]
    if missing:
        raise RuntimeError(f"not inside a Slurm task: {missing} unset; submit with -m (multirun)")
    port = master_port or 20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000
    return {
        "RANK": environ["SLURM_PROCID"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "MASTER_ADDR": _first_host(environ["SLURM_JOB_NODELIST"]),
        "MASTER_PORT": environ.get("MASTER_PORT", str(port)),
    }


def _first_host(nodelist: str) -> str:
    """First host of a Slurm node list: "gpu[03-05,07],cpu1" -> "gpu03"."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    first = rest.split(",")[0].split("-")[0].rstrip("]")
    return prefix + first


def task_threads(environ: dict[str, str]) -> dict[str, str]:
    """DRMAS_TORCH_THREADS for this task: the CPUs Slurm gave it (SLURM_CPUS_PER_TASK), unless
    the user set the variable. Unlike a role started by hand, a Slurm task knows its share
    of the node, and torch's default (every core) would oversubscribe a shared node."""
    cpus = environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if "DRMAS_TORCH_THREADS" in environ or not cpus.isdigit() or int(cpus) < 1:
        return {}
    return {"DRMAS_TORCH_THREADS": cpus}


def run_role(job: Any) -> None:
    """Run one role as this Slurm task (the body of each submitted job). A role that ends
    with a failure raises, so Slurm and the submitting command see the job fail."""
    from drmas.config import ConfigError, load_config

    if job.role not in ROLES:
        raise ConfigError(
            f"role={job.role!r} is not one of {list(ROLES)} (the broker runs on the head node)"
        )
    run_config = Path(job.run_config)
    if not run_config.is_file():
        raise ConfigError(
            f"run_config={str(run_config)!r} not found: write it with `drmas prepare`"
        )
    client = [f"security.client_name={job.client}"] if job.client else []
    cfg = load_config([*client, *job.overrides], str(run_config))
    os.environ.update(task_threads(dict(os.environ)))
    if job.role == "learner":
        learner_task(cfg, job.model)
        return
    from drmas.actors.main import run_actor

    code = run_actor(cfg, f"actor-{job.index}-{socket.gethostname()}")
    if code != 0:
        raise RuntimeError(f"actor-{job.index} stopped with exit code {code} (see its log)")


def learner_task(cfg: DrmasConfig, model: str) -> None:
    """This Slurm task as one rank of `model`'s learner group: its rank and rendezvous from
    Slurm, then the learner's one entry (drmas/learners/entry.py)."""
    from drmas.config import ConfigError

    if model not in cfg.models:
        raise ConfigError(f"model={model!r} is not one of the run's models {sorted(cfg.models)}")
    env = torch_distributed_env(dict(os.environ), cfg.learner.master_port)
    if int(env["WORLD_SIZE"]) != cfg.world_size_of(model):
        raise ConfigError(
            f"this job has {env['WORLD_SIZE']} tasks but model {model!r} has "
            f"{cfg.world_size_of(model)} learner ranks: set hydra.launcher.tasks_per_node "
            "and nodes so that nodes x tasks_per_node equals it"
        )
    os.environ.update(env)
    # submitit set SIGTERM to be logged and ignored; `run` replaces that with the learner's
    # own handler, as for `drmas learner`: a cancelled or preempted rank tells the broker
    # its job id and leaves at once (drmas/learners/leaving.py)
    from drmas.learners.entry import run

    # `run`, then leave as `drmas learner` does (entry.start's os._exit(0)), but only once
    # submitit has written the job's result: it does so after this function returns
    run(cfg, model)
    atexit.register(_leave_once_the_result_is_written)


def _leave_once_the_result_is_written() -> None:
    """At interpreter exit of a finished learner task: os._exit(0) as entry.start does, so
    torch's C++ teardown cannot abort a finished rank (a joinable gloo thread once did, exit
    -6), which Slurm would record as a failed job. Only when submitit wrote a successful
    result: otherwise the normal exit keeps its status."""
    if "SUBMITIT_FOLDER" not in os.environ:  # not inside a submitit job
        return
    import submitit
    from submitit.core.utils import pickle_load

    result = submitit.JobEnvironment().paths.result_pickle
    if result.exists() and pickle_load(result)[0] == "success":
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main() -> None:
    import hydra

    from drmas.config import config_dir
    from drmas.launch import slurm_jobs

    slurm_jobs.install()  # a job that ends without a result is reported, even without sacct

    app = hydra.main(
        config_path=str(config_dir() / "slurm"), config_name="launch", version_base="1.3"
    )(run_role)
    app()


if __name__ == "__main__":
    main()
