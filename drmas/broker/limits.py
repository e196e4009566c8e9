"""What the broker accepts from this run's clients, built once from its config: the
protocol Limits its gate checks every step against (drmas/protocol/validate.py), with
each model's vocabulary and context length read from the model's config.json, and the
largest group frame its ROUTER buffers (drmas/broker/server.py uses both)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from drmas.config import DrmasConfig
from drmas.protocol import Limits
from drmas.protocol.validate import context_from_config
from drmas.protocol.wire_limits import MAX_NAME_CHARS, MAX_WIRE_EPISODE_METRICS

if TYPE_CHECKING:
    from drmas.teams.base import Team


def run_limits(cfg: DrmasConfig, agent_models: dict[str, str], team: type[Team]) -> Limits:
    """The gate's limits for this run."""
    sizes, contexts = model_facts(cfg)
    return Limits(
        agent_models=agent_models,
        vocab_sizes=sizes,
        # a prompt no model of the run takes is refused (and bounds the frame size)
        max_prompt_tokens=max(contexts.values(), default=32_768),
        contexts=contexts,
        max_response_tokens=cfg.sampling.max_new_tokens,
        # a bound on the team's calls per episode: a runaway team is refused rather than
        # trained on
        max_steps_per_episode=team.max_steps_per_episode(cfg.workflow),
    )


def model_facts(cfg: DrmasConfig) -> tuple[dict[str, int], dict[str, int]]:
    """Each model's vocabulary size and context length (where its config names one), read
    from its checkpoint's config.json."""
    sizes, contexts = {}, {}
    for name, model in cfg.models.items():
        path = Path(model.path) / "config.json"
        if not path.exists():
            raise FileNotFoundError(
                f"models.{name}.path={model.path!r} has no config.json; the broker needs resolved "
                "checkpoint folders (drmas train resolves builtin: models before starting it)"
            )
        data = json.loads(path.read_text())
        sizes[name] = int(data.get("vocab_size") or data["text_config"]["vocab_size"])
        if (context := context_from_config(data)) is not None:
            contexts[name] = context
    return sizes, contexts


def group_bytes(cfg: DrmasConfig, limits: Limits) -> int:
    """The largest GroupResult this run can send (its tokens at the gate's limits, names at
    their wire ceilings, with margin), at most broker.max_message_bytes: the ROUTER's
    frame ceiling, so no frame larger than the run can use is even buffered."""
    per_step = 4 * (limits.max_prompt_tokens + 2 * limits.max_response_tokens) + 4 * MAX_NAME_CHARS
    metrics = MAX_WIRE_EPISODE_METRICS * (MAX_NAME_CHARS + 16)
    per_episode = limits.max_steps_per_episode * per_step + metrics + 256
    episodes = max(cfg.group_size, cfg.val.n)
    return min(cfg.broker.max_message_bytes, episodes * per_episode + 64 * 1024)
