"""How `python -m drmas.launch.slurm` (the submitting command) learns that its jobs ended:
from the Slurm controller (`scontrol show job`), not only from accounting (`sacct`).

submitit, under hydra's submitit launcher, waits for each job's result file and learns
that a job ended without one (cancelled, preempted, killed, node failure) only from
`sacct`, which needs Slurm's accounting database (slurmdbd). Many clusters have none; there
the submitting command of a cancelled job would wait forever. `install()` gives submitit
a watcher that asks the controller first (it knows every job until MinJobAge after its
end, 300 s by default) and `sacct` only for jobs the controller no longer lists; the
command then stops with submitit's error naming the job and its state.

Talks to: the Slurm controller (scontrol, sacct), nothing of drmas.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable

SCONTROL_TIMEOUT_S = 30


def parse_jobs(text: str) -> dict[str, dict[str, str]]:
    """`scontrol show job --oneliner` output -> {submitit job id: {"State", "NodeList"}}.

    An array element is "<array job id>_<index>" as submitit names it; a pending array
    shown as one line of a range ("0-1%2") names no single element and is left out (not
    ended: submitit keeps waiting)."""
    states: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if "JobId" not in fields or "JobState" not in fields:
            continue
        array, task = fields.get("ArrayJobId"), fields.get("ArrayTaskId")
        if array and task is not None and not task.isdigit():
            continue
        job_id = f"{array}_{task}" if array and task is not None else fields["JobId"]
        states[job_id] = {
            "JobID": job_id,
            "State": fields["JobState"],
            "NodeList": fields.get("NodeList", ""),
        }
    return states


def controller_states(job_ids: Iterable[str]) -> dict[str, dict[str, str]]:
    """The controller's view of these jobs (array job ids cover their elements); a job it
    no longer lists, or a controller that does not answer, is simply absent."""
    states: dict[str, dict[str, str]] = {}
    for job_id in sorted(set(job_ids)):
        try:
            out = subprocess.run(
                ["scontrol", "show", "job", "--oneliner", job_id],
                capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0:
            states.update(parse_jobs(out.stdout))
    return states


def install() -> None:
    """Make every submitit Slurm job this process submits use the controller-first watcher
    (SlurmJob.watcher is the one watcher submitit shares among them). Once, before any job
    is submitted: jobs registered with the previous watcher would not be seen by this one."""
    from submitit.slurm import slurm

    class ControllerWatcher(slurm.SlurmInfoWatcher):
        def update(self) -> None:
            pending = self._registered - self._finished
            if not pending:
                return
            self._info_dict.update(controller_states(j.split("_")[0] for j in pending))
            if pending - self._info_dict.keys():
                super().update()  # sacct, for what the controller does not list
                return
            self._num_calls += 1
            self._last_status_check = time.time()
            for job_id in pending:
                if self.is_done(job_id, mode="cache"):
                    self._finished.add(job_id)

    slurm.SlurmJob.watcher = ControllerWatcher(delay_s=60)
