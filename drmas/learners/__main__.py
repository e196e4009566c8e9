"""`python -m drmas.learners --config RUN_DIR/config.yaml --model NAME [key=value ...]`: one
rank of one model's learner group, as torchrun starts it (`torchrun --nproc-per-node N -m
drmas.learners ...`; docs/deploy.md). Parses the arguments and the config, then hands over
to drmas/learners/entry.py, the start of every learner rank."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m drmas.learners", description="One rank of one model's learner group."
    )
    parser.add_argument("--config", required=True, help="resolved config.yaml of the run")
    parser.add_argument("--model", required=True, help="name of the model this group trains")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args(argv)

    from drmas.config import ConfigError, load_config
    from drmas.learners.entry import start
    from drmas.transports.security import SecurityError

    try:
        cfg = load_config(list(args.overrides), args.config)
        start(cfg, args.model)
    except (ConfigError, SecurityError) as exc:  # a wrong invocation or missing keys: say so
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
