"""`python -m drmas.learners --config RUN_DIR/config.yaml --model NAME` (one rank; torchrun
sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT). Parses arguments and the config before
importing torch, so a bad invocation answers at once."""

from __future__ import annotations

import argparse
import logging
import os


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m drmas.learners", description="One rank of one model's learner group."
    )
    parser.add_argument("--config", required=True, help="resolved config.yaml of the run")
    parser.add_argument("--model", required=True, help="name of the model this group trains")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args(argv)

    from drmas.config import ConfigError, load_config

    cfg = load_config(list(args.overrides), args.config)
    if args.model not in cfg.models:
        raise ConfigError(
            f"--model {args.model!r} is not one of the run's models {list(cfg.models)}"
        )
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != cfg.world_size_of(args.model):
        raise ConfigError(
            f"WORLD_SIZE={world_size} but the config gives model {args.model!r} "
            f"{cfg.world_size_of(args.model)} learner ranks; start torchrun with that many"
        )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world_size > 1:
            raise SystemExit("MASTER_PORT is not set: start the learner ranks with torchrun")
        os.environ["MASTER_PORT"] = str(_free_port())
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(name)s[{args.model}:{rank}] %(levelname)s %(message)s",
    )

    from drmas.learners.main import run_learner

    run_learner(cfg, args.model, rank, world_size)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
