"""`python -m drmas.launch.slurm -m role=learner|actor ...`: drmas roles as Slurm jobs.

Hydra's submitit launcher (pip install 'drmas[slurm]') turns each sweep value into a job
and a sweep over `index` into a job array; configs/slurm/launch.yaml holds the job's
resources. Each job loads the run's resolved config (written by `drmas prepare`) and runs
one role against the broker at its explicit address:

  learner: one job per model, `tasks_per_node` x `nodes` tasks = the model's world size;
           every task reads its rank and the rendezvous from Slurm's environment and
           starts like any learner rank (drmas/learners/entry.py).
  actor:   one array element per actor, id actor-<index>.

The broker is not a Slurm job: it runs on the head node whose address the config names.
Talks to: the broker (as the role it runs), nothing else.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

ROLES = ("learner", "actor")


def torch_distributed_env(environ: dict[str, str]) -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT of a Slurm task (srun sets
    SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NODELIST, SLURM_JOB_ID)."""
    missing = [
        k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST") if k not in environ
    ]
    if missing:
        raise RuntimeError(f"not inside a Slurm task: {missing} unset; submit with -m (multirun)")
    first = _first_host(environ["SLURM_JOB_NODELIST"])
    port = 20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000  # same for every task
    return {
        "RANK": environ["SLURM_PROCID"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "MASTER_ADDR": first,
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


def run_role(job: Any) -> None:
    """Run one role as this Slurm task (the body of each submitted job)."""
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
    cfg = load_config(list(job.overrides), str(run_config))
    if job.role == "learner":
        learner_task(cfg, job.model)
        return
    from drmas.actors.main import run_actor

    run_actor(cfg, f"actor-{job.index}-{socket.gethostname()}")


def learner_task(cfg: DrmasConfig, model: str) -> None:
    """This Slurm task as one rank of `model`'s learner group: its rank and rendezvous from
    Slurm, then the learner's one entry (drmas/learners/entry.py)."""
    from drmas.config import ConfigError

    if model not in cfg.models:
        raise ConfigError(f"model={model!r} is not one of the run's models {sorted(cfg.models)}")
    env = torch_distributed_env(dict(os.environ))
    if int(env["WORLD_SIZE"]) != cfg.world_size_of(model):
        raise ConfigError(
            f"this job has {env['WORLD_SIZE']} tasks but model {model!r} has "
            f"{cfg.world_size_of(model)} learner ranks: set hydra.launcher.tasks_per_node "
            "and nodes so that nodes x tasks_per_node equals it"
        )
    os.environ.update(env)
    from drmas.learners.entry import run

    # `run`, not `start`: submitit writes the job's result once this function returns,
    # which start's os._exit would skip (the sweep would then report the job as failed)
    run(cfg, model)


def main() -> None:
    import hydra

    from drmas.config import config_dir

    app = hydra.main(
        config_path=str(config_dir() / "slurm"), config_name="launch", version_base="1.3"
    )(run_role)
    app()


if __name__ == "__main__":
    main()
