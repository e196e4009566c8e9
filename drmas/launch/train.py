"""`drmas train`: the whole job on this machine as separate OS processes.

    launcher (this) ── starts ──> broker, learner ranks (per model), actors
                     ── reads ──> RUN_DIR/metrics.jsonl for the progress display

Order: resolve every model to a checkpoint folder (builtin models are built and
warm-started once, then cached), write RUN_DIR/config.yaml with concrete paths, ports
and addresses, start the broker, then learners and actors (which retry their Hello until
the broker answers). The run ends when every learner has exited 0; any child that fails
brings everything down (its log tail is printed), and the launcher then names the
checkpoints a `drmas train run.resume=RUN_DIR` would continue from. Ctrl-C stops all
children cleanly.

Resume: `drmas train run.resume=RUN_DIR [key=value ...]` continues in RUN_DIR with the
run's own config.yaml, the command line's overrides applied on top (a finished run says
so and how to extend it). The broker restores its state and chooses each model's
checkpoint (drmas/broker/checkpoint.py), the learners load it, and the actors,
which start from the model folders, get the resumed weights by the broker's re-publish
(the same path as an actor that attaches mid-run; the digest check covers it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from drmas.config import ConfigError, DrmasConfig, to_yaml
from drmas.launch.placement import Placement, adapter_plan, plan_placement, visible_gpus
from drmas.launch.progress import Progress
from drmas.launch.supervisor import Child, Supervisor
from drmas.launch.team_failures import FailureReports
from drmas.teams.resolve import resolve
from drmas.threads import CPU_SHARE, env_threads
from drmas.transports.ports import free_port

if TYPE_CHECKING:
    from drmas.teams.base import Team


def check_run(cfg: DrmasConfig) -> type[Team]:
    """What every role of the run will load, checked before any process starts: the team,
    its tools and reward, the task source, and the broker's trackers. Returns the team."""
    from drmas.broker.trackers import missing_packages

    team = resolve(cfg, "run")
    assert team is not None
    absent = missing_packages(list(cfg.logger))
    if absent:
        raise ConfigError(
            f"logger={list(cfg.logger)}: {absent} not installed here; pip install "
            "'drmas[trackers]' (tensorboardX, wandb, mlflow-skinny)"
        )
    return team


def prepare_run(cfg: DrmasConfig) -> tuple[DrmasConfig, Path, Placement | None]:
    """Resolve run folder, model folders, addresses, ports and the GPU placement (None on
    CPU); write config.yaml. Raises ValueError (PlacementError) for a plan that cannot work,
    before any model is built."""
    from drmas.models.builtin import resolve_model_path
    from drmas.transports.learner_secret import ACTOR_FILE_NAME as ACTOR_FILE
    from drmas.transports.learner_secret import FILE_NAME as SECRET_FILE
    from drmas.transports.learner_secret import ensure_secret
    from drmas.transports.security import check_bind, check_keys, keys_dir

    team = check_run(cfg)
    # fail before building anything; children read keys_dir from config.yaml: absolute
    security = dataclasses.replace(cfg.security, keys_dir=str(keys_dir(cfg.security)))
    check_bind(cfg.broker.address, security)
    check_keys(security)
    placement = plan_placement(cfg, visible_gpus(cfg))
    weights = cfg.weights
    if placement is not None and placement.weights_backend == "gloo":
        weights = dataclasses.replace(weights, backend="gloo")
    run_dir = Path(cfg.run.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    # the learner ranks' proof of their seats, the actors' of theirs (learner_secret.py)
    secret = ensure_secret(Path(security.learner_secret or run_dir / SECRET_FILE).expanduser())
    actors = ensure_secret(Path(security.actor_secret or run_dir / ACTOR_FILE).expanduser())
    security = dataclasses.replace(security, learner_secret=str(secret), actor_secret=str(actors))
    models = {
        name: dataclasses.replace(
            m,
            path=str(
                resolve_model_path(m.path, cfg.run.cache_dir or None, m.warmstart, m.revision)
            ),
        )
        for name, m in cfg.models.items()
    }
    retriever = team.prepare(cfg).retriever
    address = cfg.broker.address
    if address.endswith(":0"):
        host = address.rsplit(":", 1)[0]
        address = f"{host}:{free_port(host.split('//')[-1])}"
    resolved = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=str(run_dir)),
        workflow=dataclasses.replace(cfg.workflow, name=team.name),  # what logs call it
        models=models,
        broker=dataclasses.replace(cfg.broker, address=address),
        security=security,
        retriever=retriever,
        weights=weights,
    )
    (run_dir / "config.yaml").write_text(to_yaml(resolved))
    return resolved, run_dir, placement


def thread_plan(cfg: DrmasConfig) -> int:
    """Torch threads for each learner rank and actor `drmas train` starts on this machine:
    the CPUs it may use shared evenly among the processes that compute at the same time,
    at least 1 (DRMAS_TORCH_THREADS, when set, wins). The broker is not counted: it is one
    Python thread, mostly waiting.

    Asynchronous (algorithm.max_staleness > 0), actors generate while learners train, so
    every learner rank and actor shares the CPUs. Synchronous (0), they take turns: the
    actors generate a batch and wait for its weights while the learners train on it, so
    each side may use every CPU while the other waits (on 2 cores a SmolLM2 learner step
    took 0.8x the time on 2 threads than on 1). Oversubscribing is what costs: two
    learners spinning 2 OpenMP threads each on 2 cores took 10 s per step where 1 thread
    each took 0.8 s."""
    try:
        asked = env_threads()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if asked is not None:
        return asked
    learners = sum(cfg.world_size_of(m) for m in cfg.models)
    actors = cfg.actor.num_actors
    # synchronous: one side computes while the other waits
    synchronous = cfg.algorithm.max_staleness == 0
    processes = max(learners, actors) if synchronous else learners + actors
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // max(1, processes))


def cpu_share_env(cfg: DrmasConfig, run_dir: Path, placement: Placement | None) -> dict[str, str]:
    """DRMAS_CPU_SHARE for the children of an asynchronous CPU run (placement None) whose
    threads nobody fixed: learners and actors lend each other the CPUs the other leaves
    idle (drmas/cpu_share.py). Synchronous runs need it not (each side takes every CPU
    while the other waits), nor GPU runs, nor a run given DRMAS_TORCH_THREADS or
    learner.threads (a fixed count is what was asked for)."""
    fixed = env_threads() is not None or cfg.learner.threads > 0
    if placement is not None or cfg.algorithm.max_staleness == 0 or fixed:
        return {}
    return {CPU_SHARE: str(run_dir / "cpu_share")}


def start_children(
    cfg: DrmasConfig, run_dir: Path, sup: Supervisor, placement: Placement | None = None
) -> None:
    cli = [sys.executable, "-m", "drmas.launch.cli"]
    config = ["--config", str(run_dir / "config.yaml")]
    threads = {"DRMAS_TORCH_THREADS": str(thread_plan(cfg))} | cpu_share_env(
        cfg, run_dir, placement
    )
    sup.start("broker", "broker", [*cli, "broker", *config])
    for model in sorted(cfg.models):
        world = cfg.world_size_of(model)
        port = str(free_port())
        for rank in range(world):
            env = threads | {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
            if placement is not None:
                env |= placement.env_learner(model, rank)
            sup.start(
                f"learner-{model}-{rank}",
                "learner",
                [*cli, "learner", *config, "--model", model],
                env,
            )
    for i in range(cfg.actor.num_actors):
        env = threads | (placement.env_actor(i) if placement is not None else {})
        sup.start(f"actor-{i}", "actor", [*cli, "actor", *config, "--id", f"actor-{i}"], env)


def resumed_config(cfg: DrmasConfig, overrides: list[str] | None = None) -> DrmasConfig:
    """The config of a resumed run: RUN_DIR/config.yaml (unless `cfg` was loaded from it,
    with --config) with this command line's `overrides` applied on top, continuing in
    RUN_DIR, with a fresh broker port if the port was free. A config group (experiment=,
    deploy=) cannot be changed on a saved config: ConfigError says what to run instead."""
    from drmas.config import ConfigError, load_config
    from drmas.config.schema import GROUPS

    run_dir = Path(cfg.run.resume).resolve()
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise FileNotFoundError(f"run.resume={cfg.run.resume}: {saved} does not exist")
    base = cfg
    if not cfg.run.dir or Path(cfg.run.dir).resolve() != run_dir:
        mine = [
            o for o in overrides or [] if not o.lstrip("+~").startswith(("run.resume=", "run.dir="))
        ]
        groups = [o for o in mine if o.split("=", 1)[0].lstrip("+~") in GROUPS]
        if groups:
            raise ConfigError(
                f"{', '.join(groups)} cannot change when resuming {run_dir}: its config is "
                f"saved in {saved}; start a new run, or edit a copy of that file and pass it "
                f"with --config COPY run.resume={run_dir}"
            )
        base = load_config(mine, str(saved))  # the run's config, this command's overrides
        if mine:
            print(f"drmas train: resuming {run_dir} with {' '.join(mine)}", file=sys.stderr)
    address = base.broker.address
    if cfg.broker.address.endswith(":0"):
        address = f"{address.rsplit(':', 1)[0]}:0"
    return dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, dir=str(run_dir), resume=str(run_dir)),
        broker=dataclasses.replace(base.broker, address=address),
    )


def finished_message(cfg: DrmasConfig, run_dir: Path) -> str:
    """ "" unless every model of the run being resumed is already at train.steps: then
    what to run to train it further."""
    from drmas.broker import checkpoint as broker_state
    from drmas.checkpoints import store

    root = store.root_for(run_dir, cfg.checkpoint.dir)
    try:
        snap = broker_state.read_snapshot(root / store.BROKER_STATE)
        versions = broker_state.choose_versions(snap, root, sorted(cfg.models))
    except (OSError, ValueError):
        return ""  # nothing to read: the resume itself will say why
    if min(versions.values(), default=0) < cfg.train.steps:
        return ""
    held = ", ".join(f"{m} v{v}" for m, v in versions.items())
    return (
        f"drmas train: {run_dir} is finished: every model reached train.steps="
        f"{cfg.train.steps} ({held}). To train it further: drmas train run.resume={run_dir} "
        f"train.steps={cfg.train.steps + max(1, cfg.train.steps)}"
    )


def resume_hint(cfg: DrmasConfig, run_dir: Path) -> str:
    """What to run to continue, and from which checkpoint of each model."""
    from drmas.broker import checkpoint as broker_state
    from drmas.checkpoints import store

    root = store.root_for(run_dir, cfg.checkpoint.dir)
    try:
        snap = broker_state.read_snapshot(root / store.BROKER_STATE)
        versions = broker_state.choose_versions(snap, root, sorted(cfg.models))
    except (OSError, ValueError) as exc:
        return f"drmas train: this run cannot be resumed: {exc}"
    where = ", ".join(
        f"{m} v{v} ({root / m / store.step_name(v)})" if v else f"{m} v0 (no checkpoint yet)"
        for m, v in versions.items()
    )
    return (
        f"drmas train: the run can continue from its last complete checkpoints: {where}.\n"
        f"  resume with: drmas train run.resume={run_dir}"
    )


def train(cfg: DrmasConfig, overrides: list[str] | None = None) -> int:
    """`overrides`: the command line's, applied on top of a resumed run's saved config."""
    started = time.monotonic()
    try:
        if cfg.run.resume:
            cfg = resumed_config(cfg, overrides)
            finished = finished_message(cfg, Path(cfg.run.dir))
            if finished:
                print(finished, file=sys.stderr)
                return 0
        thread_plan(cfg)  # a bad DRMAS_TORCH_THREADS is refused here too
        cfg, run_dir, placement = prepare_run(cfg)
    except (FileNotFoundError, ValueError) as exc:  # a bad model path: nothing started yet
        print(f"drmas train: {exc}", file=sys.stderr)
        return 2
    print(f"drmas train: run folder {run_dir}", flush=True)
    if placement is not None:
        print(placement.describe(), flush=True)
    if adapters := adapter_plan(cfg):
        print(adapters, flush=True)
    code = run_children(cfg, run_dir, placement)
    if code != 0:  # every child is down: the broker has written its state
        print(resume_hint(cfg, run_dir), file=sys.stderr, flush=True)
    wall = time.monotonic() - started
    summary = {"wall_s": wall, "exit_code": code, "run_dir": str(run_dir)}
    (run_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
    if code == 0:
        print(f"drmas train: done in {wall:.0f}s; weights in {run_dir / 'models'}", flush=True)
    return code


def run_children(cfg: DrmasConfig, run_dir: Path, placement: Placement | None) -> int:
    """Start every child and watch them: 0 when every learner has finished, 1 when a child
    failed, 130 on SIGINT/SIGTERM. Every child is stopped before this returns."""
    sup = Supervisor(run_dir / "logs")
    signals: list[int] = []  # appended to by the handler; the watch loop stops on any

    def on_signal(signum: int, _frame: object) -> None:
        signals.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    progress = Progress(run_dir, list(cfg.agents), cfg.train.steps, enabled=cfg.train.progress)
    reports = FailureReports(run_dir / "logs")
    try:
        start_children(cfg, run_dir, sup, placement)
        code = _watch(sup, progress, signals, reports)
        if code == 0:
            code = _await_broker(sup, progress, signals, cfg.val.final_timeout_s)
    finally:
        # The broker last. Stopped, it tells every client still connected (actors attached
        # from elsewhere) Shutdown and ends once the learners have said Goodbye; those are
        # stopped already, and one that died without a Goodbye cannot come back, so a
        # second signal after a moment tells it to wait for nobody (drmas/broker/server.py)
        sup.stop([c for c in sup.children if c.role != "broker"])
        sup.stop(insist_after_s=2.0)
        progress.close()
    return code


def _watch(sup: Supervisor, progress: Progress, signals: list[int], reports: FailureReports) -> int:
    """Until the learners are done (0), a child fails (1) or a signal arrives (130). The
    team's failures the actors report are printed as they come."""
    while True:
        progress.update()
        reports.poll()
        failed = sup.failed()
        if failed is not None:
            print(_failed_message(failed, reports), file=sys.stderr, flush=True)
            return 1
        if signals:
            print("drmas train: interrupted; stopping all processes", file=sys.stderr)
            return 130
        if not sup.alive("learner"):
            return 0  # every learner finished its steps and saved its weights
        time.sleep(0.2)


def _failed_message(child: Child, reports: FailureReports) -> str:
    """Why the run stops: an actor that gave up on its team says so (its traceback was
    printed already); any other child shows the last lines of its log."""
    code = child.proc.returncode
    failure = reports.gave_up(child.name) if child.role == "actor" else None
    if failure is not None:
        return (
            f"drmas train: {child.name} stopped (exit code {code}): {failure.stop_message()} "
            f"Stopping the run; the actor's log: {child.log_path}"
        )
    return (
        f"drmas train: {child.name} exited with code {code}; stopping the run. "
        f"Last lines of {child.log_path}:\n{child.tail()}"
    )


def _await_broker(sup: Supervisor, progress: Progress, signals: list[int], timeout_s: float) -> int:
    """Let the broker finish the final validation round (it exits once the round is in)
    before it is stopped: 0 when it did or `timeout_s` (val.final_timeout_s) passed, which
    a warning says; 1 when a child failed meanwhile, 130 on a signal."""
    deadline = time.monotonic() + timeout_s
    while sup.alive("broker"):
        progress.update()
        failed = sup.failed()
        if failed is not None:
            print(f"drmas train: {failed.name} failed during the final validation; stopping "
                  f"the run. Last lines of {failed.log_path}:\n{failed.tail()}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return 1
        if signals:
            print("drmas train: interrupted during the final validation; stopping all "
                  "processes", file=sys.stderr, flush=True)  # fmt: skip
            return 130
        if time.monotonic() >= deadline:
            print(f"drmas train: warning: the final validation did not finish within "
                  f"val.final_timeout_s={timeout_s:g} s; stopping without it (the weights "
                  f"are saved: `drmas evaluate` scores them; or raise val.final_timeout_s, "
                  f"or lower val.num_tasks or val.n)", file=sys.stderr, flush=True)  # fmt: skip
            return 0
        time.sleep(0.2)
    return 0
