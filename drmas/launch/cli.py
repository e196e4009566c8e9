"""`drmas` console command. Parses arguments before importing torch, so --help is instant.

    drmas train   [overrides]                 everything on this machine
    drmas prepare [overrides]                 resolve models, write RUN_DIR/config.yaml only
    drmas broker  [overrides] [--config F]    the coordinator (one per run)
    drmas actor   [overrides] [--config F]    a rollout actor; attach more at any time
    drmas learner --model M [overrides]       one learner rank (under torchrun for R > 1)
    drmas retriever [overrides]               serve retriever.name (bm25/dense) over HTTP
    drmas probe   [overrides] [--config F]    Lemma 4.2 on the team's learner: RUN_DIR/probe.json
    drmas eval    [RUN_DIR] [--step N] [--model M=DIR] [--data F]  avg@k / pass@k per source
    drmas status  ADDRESS [--json] [--keys D] what is attached to a running broker
    drmas keys    DIR [--clients a,b]         CURVE key pairs for broker and clients
    drmas data    math|search FILE... --out F downloaded datasets -> drmas task JSONL
    drmas report  RUN_DIR... --out DIR        plots and gradient-spike statistics of runs
    drmas config  [GROUP] [overrides]         the resolved config, or one group of it
    drmas show    RUN_DIR [--last N]          the latest sampled episodes, as text

Overrides use hydra syntax (`train.steps=10 experiment=tiny_math_shared`). `--config`
loads a resolved RUN_DIR/config.yaml instead of composing configs/.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from drmas.config import DrmasConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="drmas", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    from drmas.config import DrmasConfig  # no torch: --help stays instant
    from drmas.config.schema import options_help

    epilog = options_help(DrmasConfig)

    def role(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(
            name, help=help_, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        sp.add_argument("overrides", nargs="*", help="hydra overrides, e.g. train.steps=10")
        sp.add_argument(
            "--config", help="a resolved RUN_DIR/config.yaml to load instead of configs/"
        )
        return sp

    role("train", "train on this machine: broker, learners and actors as child processes")
    role("prepare", "build/resolve models and write RUN_DIR/config.yaml for per-role launches")
    role("broker", "run the broker (coordinator)")
    actor = role("actor", "run one rollout actor")
    actor.add_argument("--id", default="", help="actor id (default actor-HOST-PID)")
    learner = role("learner", "run one learner rank (RANK/WORLD_SIZE/MASTER_* from torchrun)")
    learner.add_argument("--model", required=True, help="which model this learner group trains")
    role("retriever", "serve a bm25 or dense index over HTTP (Search-R1's /retrieve API)")
    role(
        "probe",
        "measure each agent's gradient second moment under global baselines vs agent-wise "
        "advantages (probe.rewards='{agent: [mean, std], ...}' for synthetic scores)",
    )
    evaluate = sub.add_parser(
        "eval",
        help="evaluate a run's final weights, a checkpoint or model folders on held-out "
        "tasks: avg@k / pass@k per data source with standard errors",
        description="Runs the team (one process, the actor's engines) n times on every task "
        "and reports avg@k, pass@k (unbiased) and pass@1 per data source and overall, with "
        "standard errors over tasks. Weights: RUN_DIR/models/<model> (the run's final ones), "
        "--step N (its learner checkpoints, exported to step-N/hf), or --model per model or "
        "agent. Tasks: --data files (jsonl/parquet, task.question_key/answer_key), else the "
        "task source's validation split. Defaults are the paper's: T 0.6, top-p 0.95, k 16.",
    )
    evaluate.add_argument("run_dir", nargs="?", default="", help="a run folder (optional)")
    evaluate.add_argument("overrides", nargs="*", help="hydra overrides, e.g. val.num_tasks=64")
    evaluate.add_argument("--config", help="a config file (default: RUN_DIR/config.yaml)")
    evaluate.add_argument("--step", type=int, default=None, help="learner checkpoint version")
    evaluate.add_argument(
        "--model", action="append", default=[], metavar="NAME=DIR",
        help="a Hugging Face folder for a model or agent (repeat per model)",
    )  # fmt: skip
    evaluate.add_argument("--data", action="append", default=[], help="task file (repeatable)")
    evaluate.add_argument("--tasks", type=int, default=0, help="first N tasks of each (0: all)")
    evaluate.add_argument("--k", type=int, default=16, help="k of avg@k and pass@k")
    evaluate.add_argument("--n", type=int, default=0, help="samples per task (>= k; 0: k)")
    evaluate.add_argument("--temperature", type=float, default=0.6)
    evaluate.add_argument("--top-p", type=float, default=0.95)
    evaluate.add_argument("--seed", type=int, default=0, help="added to the engines' seed")
    evaluate.add_argument("--out", default="", help="JSON to write (default RUN_DIR/eval.json)")
    transcripts = sub.add_parser(
        "show", help="print the latest sampled episodes of a run (RUN_DIR/samples.jsonl)"
    )
    transcripts.add_argument("run_dir", help="a run folder")
    transcripts.add_argument("--last", type=int, default=1, help="how many sampled groups")
    show = sub.add_parser(
        "config",
        help="print the resolved config (all of it, or one group such as algorithm)",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("group", nargs="?", default="", help="a dotted key, e.g. algorithm.loss")
    show.add_argument("overrides", nargs="*", help="hydra overrides, e.g. experiment=search_tiny")
    show.add_argument("--config", help="a resolved RUN_DIR/config.yaml instead of configs/")
    show.add_argument("--docs", action="store_true", help="each key with its one-line doc")
    status = sub.add_parser("status", help="show actors, versions and counters of a running broker")
    status.add_argument("address", help="broker address, e.g. tcp://127.0.0.1:5555")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    status.add_argument(
        "--keys", default="", help="keys folder of a CURVE broker (security.curve=true)"
    )
    status.add_argument(
        "--client",
        default="",
        help="client key pair in KEYS/clients (default: default, else the first one there)",
    )
    keys = sub.add_parser(
        "keys",
        help="write CURVE key pairs: the broker's and one per client (security.curve=true)",
        description="Writes DIR/broker.key(_secret), DIR/clients/NAME.key(_secret) and "
        "DIR/authorized/NAME.key (the public keys the broker admits). Secret files are "
        "mode 600. Copy broker.key_secret + authorized/ to the broker's node, broker.key + "
        "clients/NAME.key_secret to each client's node.",
    )
    keys.add_argument("dir", help="folder to write (security.keys_dir; the default is ./keys)")
    keys.add_argument(
        "--clients",
        default="default",
        help="comma-separated client names, one key pair each (security.client_name); "
        "NAME:ROLE binds a key to one role (actor, learner or observer = drmas status), so a "
        "stolen observer key cannot train or publish",
    )
    keys.add_argument(
        "--force", action="store_true", help="replace existing keys (all old keys stop working)"
    )
    data = sub.add_parser(
        "data",
        help="convert downloaded datasets (parquet/jsonl/json) into drmas task files",
        description="Reads the public datasets' shapes (DAPO-Math, MATH500, AIME, verl's "
        "prompt/reward_model parquet; NQ/HotpotQA in Search-R1's shape) and writes JSONL "
        "for task.train_path / task.val_path: math {question, answer, data_source}, search "
        "{question, golden_answers, data_source}. Validation reports each data_source.",
    )
    data.add_argument("kind", choices=["math", "search"])
    data.add_argument("inputs", nargs="+", help="downloaded .parquet / .jsonl / .json files")
    data.add_argument("--out", required=True, help="JSONL file to write")
    data.add_argument(
        "--source", default="", help="data_source of rows without one (default: file stem)"
    )
    data.add_argument(
        "--skip-bad", action="store_true", help="skip rows without question/answer (counted)"
    )
    report = sub.add_parser(
        "report",
        help="plot runs (reward, validation, gradient norms, advantages, staleness, "
        "throughput) and write gradient-spike statistics",
        description="Writes DIR/*.png (several runs overlaid, labelled from their configs), "
        "DIR/summary.json and DIR/summary.md (per model and agent: max / median / p95 "
        "gradient norm, spikes, skipped non-finite steps; first, final and best "
        "validation with standard errors).",
    )
    report.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl)")
    report.add_argument("--out", required=True, help="folder to write")
    return p


def _report(args: argparse.Namespace) -> int:
    from drmas.launch.report import write_report

    try:
        drawn = write_report(args.runs, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"drmas report: {exc}", file=sys.stderr)
        return 2
    skipped = drawn.pop("skipped")
    print(
        f"drmas report: {len(drawn)} plots and summary.md / summary.json in {args.out}"
        + (f"; skipped (no such metrics): {', '.join(skipped)}" if skipped else ""),
        file=sys.stderr,
    )
    return 0


def _data(args: argparse.Namespace) -> int:
    from pathlib import Path

    from drmas.tasks.convert import ConvertError, convert

    try:
        counts = convert(
            args.kind, [Path(p) for p in args.inputs], Path(args.out), args.source, args.skip_bad
        )
    except ConvertError as exc:
        print(f"drmas data: {exc}", file=sys.stderr)
        return 2
    skipped = counts.pop("skipped", 0)
    per_source = ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
    print(
        f"drmas data: wrote {sum(counts.values())} {args.kind} tasks to {args.out} "
        f"({per_source}){f'; skipped {skipped} rows' if skipped else ''}",
        file=sys.stderr,
    )
    return 0


def _keys(folder: str, clients: str, *, force: bool) -> int:
    from pathlib import Path

    from drmas.transports.security import SecurityError, write_keys

    root = Path(folder).expanduser().resolve()
    pairs = [c.strip().partition(":") for c in clients.split(",") if c.strip()]
    names = [name for name, _, _ in pairs]
    roles = {name: role for name, _, role in pairs if role}
    try:
        written = write_keys(root, names, force=force, roles=roles)
    except SecurityError as exc:
        print(exc, file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(
        f"drmas keys: broker and client key pairs ({', '.join(names)}) in {root}. Run with "
        f"security.curve=true security.keys_dir={root} (clients: security.client_name=NAME, "
        "default 'default'); the broker admits the public keys in authorized/.",
        file=sys.stderr,
    )
    return 0


def _config(args: argparse.Namespace) -> int:
    from drmas.config import ConfigError, load_config
    from drmas.config.schema import config_text

    group, overrides = args.group, list(args.overrides)
    if "=" in group:  # `drmas config key=value`: an override, no group
        group, overrides = "", [group, *overrides]
    try:
        cfg = load_config(overrides, args.config)
        print(config_text(cfg, group, docs=args.docs), end="")
    except (ConfigError, KeyError) as exc:
        print(f"drmas config: {exc}", file=sys.stderr)
        return 2
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from drmas.config import ConfigError, load_config
    from drmas.launch.evaluate import EvalError, EvalSettings, format_table, run_eval

    run_dir, overrides = args.run_dir, list(args.overrides)
    if "=" in run_dir:  # `drmas eval key=value ...`: an override, no run folder
        run_dir, overrides = "", [run_dir, *overrides]
    run = Path(run_dir).resolve() if run_dir else None
    config = args.config or (str(run / "config.yaml") if run else None)
    if run is not None and not (run / "config.yaml").is_file() and not args.config:
        print(f"drmas eval: {run} holds no config.yaml (is it a run folder?)", file=sys.stderr)
        return 2
    folders = {}
    for item in args.model:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            print(f"drmas eval: --model {item!r}: expected NAME=DIR", file=sys.stderr)
            return 2
        folders[name] = folder
    _logging("eval")
    settings = EvalSettings(args.k, args.n, args.temperature, args.top_p, args.tasks, args.seed)
    out = Path(args.out) if args.out else (run / "eval.json" if run else Path("eval.json"))
    try:
        cfg = load_config(overrides, config)
        report = run_eval(
            cfg, run, settings, step=args.step, folders=folders, data=args.data, out=out
        )
    except (ConfigError, EvalError, FileNotFoundError, ValueError) as exc:
        print(f"drmas eval: {exc}", file=sys.stderr)
        return 2
    weights = ", ".join(f"{m}: {w['from']}" for m, w in report["weights"].items())
    print(f"{report['team']} team ({weights}), T={settings.temperature}, top-p={settings.top_p}, "
          f"{settings.samples} samples per task, {report['wall_s']:.0f}s")  # fmt: skip
    print(format_table(report))
    print(f"wrote {out}")
    return 0


def _logging(role: str) -> None:
    logging.basicConfig(
        level=os.environ.get("DRMAS_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "status":
        from drmas.launch.status import print_status

        return print_status(
            args.address,
            as_json=args.json,
            timeout_s=args.timeout,
            keys_dir=args.keys,
            client_name=args.client,
        )
    if args.command == "keys":
        return _keys(args.dir, args.clients, force=args.force)
    if args.command == "data":
        return _data(args)
    if args.command == "report":
        return _report(args)
    if args.command == "show":
        from pathlib import Path

        from drmas.broker.samples import show

        return show(Path(args.run_dir), args.last)

    from drmas.config import ConfigError, load_config

    if args.command == "config":
        return _config(args)
    if args.command == "eval":
        return _eval(args)
    _logging(args.command if args.command != "actor" else f"actor[{args.id}]")
    try:
        cfg = load_config(args.overrides, args.config)
    except ConfigError as exc:
        print(f"drmas: {exc}", file=sys.stderr)
        return 2
    if args.command == "train":
        from drmas.launch.train import train

        return train(cfg, args.overrides)
    if args.command == "prepare":
        from drmas.launch.train import prepare_run

        try:
            _, run_dir, placement = prepare_run(cfg)
        except (FileNotFoundError, ValueError) as exc:
            print(f"drmas prepare: {exc}", file=sys.stderr)
            return 2
        if placement is not None:
            print(placement.describe(), file=sys.stderr)
        print(run_dir / "config.yaml")
        return 0
    if args.command == "probe":
        from drmas.launch.probe import run_probe

        try:
            return run_probe(cfg)
        except (FileNotFoundError, ValueError) as exc:
            print(f"drmas probe: {exc}", file=sys.stderr)
            return 2
    unresolved = sorted(m for m, mc in cfg.models.items() if mc.path.startswith("builtin:"))
    if unresolved and args.config is None and args.command in ("broker", "actor", "learner"):
        print(
            f"drmas {args.command}: models {unresolved} are builtin: models, which `drmas "
            "train` or `drmas prepare` builds once per run; start this role with --config "
            "RUN_DIR/config.yaml (written by `drmas prepare`), or set models.<name>.path to "
            "a checkpoint folder",
            file=sys.stderr,
        )
        return 2
    from drmas.transports.security import SecurityError

    try:
        return _run_role(args, cfg)
    except SecurityError as exc:  # missing keys or an insecure bind: nothing to retry
        print(f"drmas {args.command}: {exc}", file=sys.stderr)
        return 2


def _run_role(args: argparse.Namespace, cfg: DrmasConfig) -> int:
    if args.command == "broker":
        from drmas.launch.roles import run_broker

        return run_broker(cfg)
    if args.command == "actor":
        from drmas.actors.main import run_actor

        run_actor(cfg, args.id)
        return 0
    if args.command == "learner":
        from drmas.learners.main import run_learner

        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from drmas.transports.ports import free_port

            os.environ["MASTER_PORT"] = str(cfg.learner.master_port or free_port())
        run_learner(cfg, args.model, rank, world)
        # Everything is saved and the process groups are destroyed. Leave without the
        # interpreter's teardown of torch's C++ objects: a gloo thread still joinable
        # there aborts the process ("terminate called without an active exception",
        # exit -6; seen once on a rank > 0 in a loaded CI run), and the supervisor would
        # stop a finished run as failed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.command == "retriever":
        from drmas.retrieval.server import run_retriever

        return run_retriever(cfg)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
