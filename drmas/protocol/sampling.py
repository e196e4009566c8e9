"""How actors sample, as the broker hands it out in every Lease (drmas/protocol/messages.py):
the run's settings and, per agent, its own (config `agents.<name>.sampling` for training,
`agents.<name>.val` for validation, resolved by the broker so every actor samples alike).

A team asks `for_agent(name)` before each call; the engine gets its temperature, top_p,
max_new_tokens and stop strings (drmas/teams/base.py). The learner scores an agent's
samples at that agent's training temperature (drmas/learners/trainer.py). This module
imports nothing of the project but the wire limits.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from drmas.protocol.wire_limits import MAX_MODELS, Name, Text

MAX_STOP = 16
"""Stop strings of one agent (OpenAI's API takes 4; engines slow down with many)."""

Stop = Annotated[list[Text], msgspec.Meta(max_length=MAX_STOP)]


class AgentSampling(msgspec.Struct, forbid_unknown_fields=True):
    """One agent's sampling, every field resolved (nothing inherited on the wire)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    stop: Stop = []


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    temperature: float
    top_p: float
    max_new_tokens: int
    stop: Stop = []
    # agent -> its own sampling where it differs from the fields above
    agents: Annotated[dict[Name, AgentSampling], msgspec.Meta(max_length=MAX_MODELS)] = {}

    def for_agent(self, agent: str) -> AgentSampling:
        """What `agent`'s calls sample with: its own settings, else the run's."""
        own = self.agents.get(agent)
        if own is not None:
            return own
        return AgentSampling(self.temperature, self.top_p, self.max_new_tokens, list(self.stop))
