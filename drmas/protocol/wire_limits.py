"""Wire ceilings of the protocol types (drmas/protocol/messages.py): the longest list, map
or string each field may hold.

msgspec refuses a longer one while decoding, before it builds the rest, so no frame can
make a receiver allocate more than these allow. Each is the run's real limit with margin;
the run's own, tighter limits are checked after decoding (drmas/protocol/validate.py, and
the broker's gate). Imports nothing of the project.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_ID_CHARS = 256
"""A client id, task id or host name (validate.Limits.max_id_chars is 256)."""
MAX_NAME_CHARS = 128
"""A model, agent, adapter, metric or state name (the gate allows metric names of 128)."""
MAX_TEXT_CHARS = 4096
"""A free-text field: a reason, an error, a digest, an address (the gate's MAX_TEXT)."""
MAX_MODELS = 64
"""Models one message may name (a run trains a handful)."""
MAX_ADAPTERS = 1024
"""LoRA adapters of one base a message may name (one per agent)."""
MAX_LEASE_IDS = 4096
"""Lease ids one LeaseReturn or Goodbye may name (the gate's limit)."""
MAX_METRICS = 1024
"""Metrics one StepReport may carry (the gate's limit)."""
MAX_GROUP_EPISODES = 4096
"""Episodes of one group (group_size; 8 by default)."""
MAX_EPISODE_STEPS = 4096
"""Steps of one episode (the team's max_steps_per_episode, 4 * max(loops, turns) + 4)."""
MAX_WIRE_EPISODE_METRICS = 64
"""Workflow metrics of one episode (validate.MAX_EPISODE_METRICS is 32)."""
MAX_LIST = 1 << 20
"""Any other list a broker sends (leases, samples, actors, members)."""

Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
Models = Annotated[list[Name], msgspec.Meta(max_length=MAX_MODELS)]
Versions = Annotated[dict[Name, int], msgspec.Meta(max_length=MAX_MODELS)]
AdapterVersions = Annotated[dict[Name, int], msgspec.Meta(max_length=MAX_ADAPTERS)]
LeaseIds = Annotated[list[int], msgspec.Meta(max_length=MAX_LEASE_IDS)]
Names = Annotated[list[Name], msgspec.Meta(max_length=MAX_ADAPTERS)]
LongText = Annotated[str, msgspec.Meta(max_length=MAX_LIST)]
