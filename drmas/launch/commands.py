"""The `drmas` commands that work on runs, files and brokers rather than being one of a
run's processes (eval, show, config, status, keys, data, report), and `Command`, the row
of the command table that drmas/launch/cli.py parses and dispatches from.

Each command is a function that adds its arguments to its subparser and a function that
runs it (parsed arguments -> exit code: 0 done, 2 a bad input whose message says what to
fix, 1 for `status`: the broker did not answer). What a command needs is imported inside it, once chosen, so `drmas --help` and the
cheap commands never import torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

Run = Callable[[argparse.Namespace], int]
"""A command: parsed arguments -> exit code."""


@dataclass(frozen=True)
class Command:
    """One `drmas NAME`: how it is parsed and what it runs."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Run
    description: str | None = None
    config_docs: bool = False
    """--help ends with every config key and its one-line doc (commands taking overrides)."""


def setup_logging(role: str) -> None:
    """Log lines on stderr, each naming the process's role (DRMAS_LOG_LEVEL, default INFO)."""
    logging.basicConfig(
        level=os.environ.get("DRMAS_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# --- eval


EVAL_DESCRIPTION = (
    "Runs the team (one process, the actor's engines) n times on every task "
    "and reports avg@k, pass@k (unbiased) and pass@1 per data source and overall, with "
    "standard errors over tasks. Weights: RUN_DIR/models/<model> (the run's final ones), "
    "--step N (its learner checkpoints, exported to step-N/hf), or --model per model or "
    "agent. Tasks: --data files (jsonl/parquet, task.question_key/answer_key), else the "
    "task source's validation split. Defaults are the paper's: T 0.6, top-p 0.95, k 16."
)


def _eval_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("run_dir", nargs="?", default="", help="a run folder (optional)")
    sp.add_argument("overrides", nargs="*", help="hydra overrides, e.g. val.num_tasks=64")
    sp.add_argument("--config", help="a config file (default: RUN_DIR/config.yaml)")
    sp.add_argument("--step", type=int, default=None, help="learner checkpoint version")
    sp.add_argument(
        "--model", action="append", default=[], metavar="NAME=DIR",
        help="a Hugging Face folder for a model or agent (repeat per model)",
    )  # fmt: skip
    sp.add_argument("--data", action="append", default=[], help="task file (repeatable)")
    sp.add_argument("--tasks", type=int, default=0, help="first N tasks of each (0: all)")
    sp.add_argument("--k", type=int, default=16, help="k of avg@k and pass@k")
    sp.add_argument("--n", type=int, default=0, help="samples per task (>= k; 0: k)")
    sp.add_argument("--temperature", type=float, default=0.6)
    sp.add_argument("--top-p", type=float, default=0.95)
    sp.add_argument("--seed", type=int, default=0, help="added to the engines' seed")
    sp.add_argument("--out", default="", help="JSON to write (default RUN_DIR/eval.json)")


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
    setup_logging("eval")
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


# --- show, config, status


def _show_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("run_dir", help="a run folder")
    sp.add_argument("--last", type=int, default=1, help="how many sampled groups")


def _show(args: argparse.Namespace) -> int:
    from pathlib import Path

    from drmas.broker.samples import show

    return show(Path(args.run_dir), args.last)


def _config_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("group", nargs="?", default="", help="a dotted key, e.g. algorithm.loss")
    sp.add_argument("overrides", nargs="*", help="hydra overrides, e.g. experiment=search_tiny")
    sp.add_argument("--config", help="a resolved RUN_DIR/config.yaml instead of configs/")
    sp.add_argument("--docs", action="store_true", help="each key with its one-line doc")


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


def _status_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "address",
        help="a run folder (its config.yaml names the broker and its keys) or a broker "
        "address, e.g. tcp://127.0.0.1:5555",
    )
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    sp.add_argument(
        "--keys", default="", help="keys folder of a CURVE broker (security.curve=true)"
    )
    sp.add_argument(
        "--client",
        default="",
        help="client key pair in KEYS/clients (default: default, else the first one there)",
    )


def _status(args: argparse.Namespace) -> int:
    from drmas.launch.status import print_status

    return print_status(
        args.address,
        as_json=args.json,
        timeout_s=args.timeout,
        keys_dir=args.keys,
        client_name=args.client,
    )


# --- keys, data, report


KEYS_DESCRIPTION = (
    "Writes DIR/broker.key(_secret), DIR/clients/NAME.key(_secret), "
    "DIR/authorized/NAME.key (the public keys the broker admits) and "
    "DIR/authorized/roles.json (what each key may do). Secret files are "
    "mode 600. Copy broker.key_secret + authorized/ to the broker's node, broker.key + "
    "clients/NAME.key_secret to each client's node."
)


def _keys_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("dir", help="folder to write (security.keys_dir; the default is ./keys)")
    sp.add_argument(
        "--clients",
        default="default",
        help="comma-separated client names, one key pair each (security.client_name). Every "
        "key is bound (authorized/roles.json) to what it may do: NAME:actor, NAME:observer "
        "(drmas status), NAME:learner (any model), NAME:learner:M1+M2 (those models' "
        "learners only) or NAME:any; a name without one is bound to the role it names "
        "(actors, learners, observer, status, ops), any other to any",
    )
    sp.add_argument(
        "--force", action="store_true", help="replace existing keys (all old keys stop working)"
    )


def _keys(args: argparse.Namespace) -> int:
    from pathlib import Path

    from drmas.transports.security import ANY, SecurityError, bindings, write_keys

    root = Path(args.dir).expanduser().resolve()
    pairs = [c.strip().partition(":") for c in args.clients.split(",") if c.strip()]
    names = [name for name, _, _ in pairs]
    roles = {name: role for name, _, role in pairs if role}
    try:
        written = write_keys(root, names, force=args.force, roles=roles)
    except SecurityError as exc:
        print(exc, file=sys.stderr)
        return 2
    for path in written:
        print(path)
    bound = bindings(names, roles)
    print(
        f"drmas keys: broker and client key pairs in {root}, each bound to what it may do: "
        f"{', '.join(f'{n}={b}' for n, b in bound.items())}. Run with security.curve=true "
        f"security.keys_dir={root} (clients: security.client_name=NAME, default 'default'); "
        "the broker admits the public keys in authorized/ as authorized/roles.json binds them."
        + ("" if ANY not in bound.values() else " Keys bound to any may take every role."),
        file=sys.stderr,
    )
    return 0


DATA_DESCRIPTION = (
    "Reads the public datasets' shapes (DAPO-Math, MATH500, AIME, verl's "
    "prompt/reward_model parquet; NQ/HotpotQA in Search-R1's shape) and writes JSONL "
    "for task.train_path / task.val_path: math {question, answer, data_source}, search "
    "{question, golden_answers, data_source}. Validation reports each data_source."
)


def _data_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("kind", choices=["math", "search"])
    sp.add_argument("inputs", nargs="+", help="downloaded .parquet / .jsonl / .json files")
    sp.add_argument("--out", required=True, help="JSONL file to write")
    sp.add_argument(
        "--source", default="", help="data_source of rows without one (default: file stem)"
    )
    sp.add_argument(
        "--skip-bad", action="store_true", help="skip rows without question/answer (counted)"
    )


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


REPORT_DESCRIPTION = (
    "Writes DIR/*.png (several runs overlaid, labelled from their configs), "
    "DIR/summary.json and DIR/summary.md (per model and agent: max / median / p95 "
    "gradient norm, spikes, skipped non-finite steps; first, final and best "
    "validation with standard errors)."
)


def _report_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl)")
    sp.add_argument("--out", required=True, help="folder to write")


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


TOOLS: tuple[Command, ...] = (
    Command(
        "eval",
        "evaluate a run's final weights, a checkpoint or model folders on held-out "
        "tasks: avg@k / pass@k per data source with standard errors",
        _eval_arguments,
        _eval,
        description=EVAL_DESCRIPTION,
    ),
    Command(
        "show",
        "print the latest sampled episodes of a run (RUN_DIR/samples.jsonl)",
        _show_arguments,
        _show,
    ),
    Command(
        "config",
        "print the resolved config (all of it, or one group such as algorithm)",
        _config_arguments,
        _config,
        config_docs=True,
    ),
    Command(
        "status",
        "show actors, versions and counters of a running broker",
        _status_arguments,
        _status,
    ),
    Command(
        "keys",
        "write CURVE key pairs: the broker's and one per client (security.curve=true)",
        _keys_arguments,
        _keys,
        description=KEYS_DESCRIPTION,
    ),
    Command(
        "data",
        "convert downloaded datasets (parquet/jsonl/json) into drmas task files",
        _data_arguments,
        _data,
        description=DATA_DESCRIPTION,
    ),
    Command(
        "report",
        "plot runs (reward, validation, gradient norms, advantages, staleness, "
        "throughput) and write gradient-spike statistics",
        _report_arguments,
        _report,
        description=REPORT_DESCRIPTION,
    ),
)
"""In the order `drmas --help` lists them, after the run's processes."""
