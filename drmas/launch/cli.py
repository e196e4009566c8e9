"""`drmas` console command. Parses arguments before importing torch, so --help is instant.

    drmas train   [overrides]                 everything on this machine
    drmas prepare [overrides]                 resolve models, write RUN_DIR/config.yaml only
    drmas plan    [overrides] [--gpu-gib G]   the placement and its memory budget, no models needed
    drmas broker  [overrides] [--config F]    the coordinator (one per run)
    drmas actor   [overrides] [--config F]    a rollout actor; attach more at any time
    drmas learner --model M [overrides]       one learner rank (under torchrun for R > 1)
    drmas retriever [overrides]               serve retriever.name (bm25/dense) over HTTP
    drmas probe   [overrides] [--config F]    Lemma 4.2 on the team's learner: RUN_DIR/probe.json
    drmas eval    [RUN_DIR] [--step N] [--model M=DIR] [--data F]  avg@k / pass@k per source
    drmas status  RUN_DIR|ADDRESS [--json]    what is attached to a running broker
    drmas keys    DIR [--clients a,b]         CURVE key pairs for broker and clients
    drmas data    math|search FILE... --out F downloaded datasets -> drmas task JSONL
    drmas report  RUN_DIR... --out DIR        plots and gradient-spike statistics of runs
    drmas config  [GROUP] [overrides]         the resolved config, or one group of it
    drmas show    RUN_DIR [--last N]          the latest sampled episodes, as text

Overrides use hydra syntax (`train.steps=10 experiment=tiny_math_shared`). `--config`
loads a resolved RUN_DIR/config.yaml instead of composing configs/.

Each command is one row of COMMANDS (name, help, its arguments, the function it runs);
`main` parses and looks the command up. Commands import what they run only once chosen.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from drmas.launch.commands import TOOLS, Command, Run, setup_logging
from drmas.launch.plan import plan_arguments

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

RoleRun = Callable[[argparse.Namespace, "DrmasConfig"], int]
"""A command that runs on a loaded config (train, prepare, probe and the roles)."""


# --- the commands that run on a config: train, prepare, probe and the role processes


def _role_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("overrides", nargs="*", help="hydra overrides, e.g. train.steps=10")
    sp.add_argument("--config", help="a resolved RUN_DIR/config.yaml to load instead of configs/")


def _actor_arguments(sp: argparse.ArgumentParser) -> None:
    _role_arguments(sp)
    sp.add_argument("--id", default="", help="actor id (default actor-HOST-PID)")


def _learner_arguments(sp: argparse.ArgumentParser) -> None:
    _role_arguments(sp)
    sp.add_argument("--model", required=True, help="which model this learner group trains")


def _configured(run: RoleRun) -> Run:
    """Log lines named after the role, then the config composed from configs/ (or loaded
    with --config); a config that does not load exits 2 with the reason."""

    def start(args: argparse.Namespace) -> int:
        from drmas.config import ConfigError, load_config

        setup_logging(args.command if args.command != "actor" else f"actor[{args.id}]")
        try:
            cfg = load_config(args.overrides, args.config)
        except ConfigError as exc:
            print(f"drmas: {exc}", file=sys.stderr)
            return 2
        return run(args, cfg)

    return start


def _process(run: RoleRun, *, needs_built_models: bool = True) -> Run:
    """A role process others connect to. builtin: models are built once per run by `drmas
    train` / `drmas prepare`, so a role that loads them needs their RUN_DIR/config.yaml; a
    security error (missing keys, an insecure bind) has nothing to retry: both exit 2."""

    def start(args: argparse.Namespace, cfg: DrmasConfig) -> int:
        unresolved = sorted(m for m, mc in cfg.models.items() if mc.path.startswith("builtin:"))
        if needs_built_models and unresolved and args.config is None:
            print(
                f"drmas {args.command}: models {unresolved} are builtin: models, which `drmas "
                "train` or `drmas prepare` builds once per run; start this role with --config "
                "RUN_DIR/config.yaml (written by `drmas prepare`), or set models.<name>.path "
                "to a checkpoint folder",
                file=sys.stderr,
            )
            return 2
        from drmas.transports.security import SecurityError

        try:
            return run(args, cfg)
        except SecurityError as exc:
            print(f"drmas {args.command}: {exc}", file=sys.stderr)
            return 2

    return _configured(start)


def _train(args: argparse.Namespace, cfg: DrmasConfig) -> int:
    from drmas.launch.train import train

    return train(cfg, args.overrides)


def _prepare(args: argparse.Namespace, cfg: DrmasConfig) -> int:
    from drmas.launch.placement import adapter_plan
    from drmas.launch.train import prepare_run

    try:
        _, run_dir, placement = prepare_run(cfg)
    except (FileNotFoundError, ValueError) as exc:
        print(f"drmas prepare: {exc}", file=sys.stderr)
        return 2
    if placement is not None:
        print(placement.describe(), file=sys.stderr)
    if adapters := adapter_plan(cfg):
        print(adapters, file=sys.stderr)
    print(run_dir / "config.yaml")
    return 0


def _plan(args: argparse.Namespace, cfg: DrmasConfig) -> int:
    from drmas.launch.plan import run_plan

    return run_plan(args, cfg)


def _probe(args: argparse.Namespace, cfg: DrmasConfig) -> int:
    from drmas.launch.probe import run_probe

    try:
        return run_probe(cfg)
    except (FileNotFoundError, ValueError) as exc:
        print(f"drmas probe: {exc}", file=sys.stderr)
        return 2


def _broker(args: argparse.Namespace, cfg: DrmasConfig) -> int:
    from drmas.launch.roles import run_broker

    return run_broker(cfg)


def _actor(args: argparse.Namespace, cfg: DrmasConfig) -> int:
    from drmas.actors.main import run_actor

    return run_actor(cfg, args.id)


def _learner(args: argparse.Namespace, cfg: DrmasConfig) -> int:
    """drmas/learners/entry.py places the rank (RANK, WORLD_SIZE, MASTER_*), sets its
    threads and leaves the process once the learner is done; a wrong invocation exits 2."""
    from drmas.config import ConfigError
    from drmas.learners.entry import start

    try:
        start(cfg, args.model)
    except ConfigError as exc:
        print(f"drmas learner: {exc}", file=sys.stderr)
        return 2


def _retriever(args: argparse.Namespace, cfg: DrmasConfig) -> int:
    from drmas.retrieval.server import run_retriever
    from drmas.teams.resolve import team_class

    return run_retriever(cfg, team_class(cfg.workflow).prepare)  # the team's corpus


ROLES: tuple[Command, ...] = (
    Command(
        "train",
        "train on this machine: broker, learners and actors as child processes",
        _role_arguments,
        _configured(_train),
        config_docs=True,
    ),
    Command(
        "prepare",
        "build/resolve models and write RUN_DIR/config.yaml for per-role launches",
        _role_arguments,
        _configured(_prepare),
        config_docs=True,
    ),
    Command(
        "plan",
        "print where each process would go and its memory budget, from the config alone "
        "(the models need not be downloaded)",
        plan_arguments,
        _configured(_plan),
        config_docs=True,
    ),
    Command(
        "broker",
        "run the broker (coordinator)",
        _role_arguments,
        _process(_broker),
        config_docs=True,
    ),
    Command("actor", "run one rollout actor", _actor_arguments, _process(_actor), config_docs=True),
    Command(
        "learner",
        "run one learner rank (RANK/WORLD_SIZE/MASTER_* from torchrun)",
        _learner_arguments,
        _process(_learner),
        config_docs=True,
    ),
    Command(
        "retriever",
        "serve a bm25 or dense index over HTTP (Search-R1's /retrieve API)",
        _role_arguments,
        _process(_retriever, needs_built_models=False),
        config_docs=True,
    ),
    Command(
        "probe",
        "measure each agent's gradient second moment under global baselines vs agent-wise "
        "advantages (probe.rewards='{agent: [mean, std], ...}' for synthetic scores)",
        _role_arguments,
        _configured(_probe),
        config_docs=True,
    ),
)
COMMANDS: tuple[Command, ...] = (*ROLES, *TOOLS)
"""Every command, in the order `drmas --help` lists them."""
_BY_NAME = {c.name: c for c in COMMANDS}


def _parser() -> argparse.ArgumentParser:
    from drmas.config import DrmasConfig  # no torch: --help stays instant
    from drmas.config.schema import options_help

    p = argparse.ArgumentParser(prog="drmas", description=(__doc__ or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    epilog = options_help(DrmasConfig)
    for command in COMMANDS:
        sp = sub.add_parser(command.name, help=command.help, description=command.description)
        if command.config_docs:
            sp.epilog = epilog
            sp.formatter_class = argparse.RawDescriptionHelpFormatter
        command.arguments(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return _BY_NAME[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
