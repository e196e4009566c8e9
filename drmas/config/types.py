"""Constrained field types of the config schema, declared once and checked by msgspec
while a config is converted (drmas/config/load.py): a value outside its range or choices
is refused with the key, the value and what is allowed. No hand-written check repeats
them; drmas/config/rules.py holds only the rules that span fields."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

MAX_GROUP_EPISODES = 4096
"""Episodes of one group: what one group message may carry on the wire
(drmas/protocol/wire_limits.py holds the same number; a test keeps them equal)."""
MAX_SECONDS = 30 * 24 * 3600.0
"""The longest timeout or interval a config may set (30 days): a timeout is explicit and
ends; an infinite one (or a typo of many zeros) would let a stuck peer hold a run forever."""

Positive = Annotated[int, Meta(ge=1)]
"""A count of at least one."""
NonNegative = Annotated[int, Meta(ge=0)]
"""A count where 0 means none / off."""
Port = Annotated[int, Meta(ge=0, le=65535)]
"""A TCP port; 0 = a free one."""
Seconds = Annotated[float, Meta(gt=0, le=MAX_SECONDS)]
"""A timeout or interval: above zero and at most 30 days (so never infinite)."""
GroupSize = Annotated[int, Meta(ge=1, le=MAX_GROUP_EPISODES)]
"""Episodes of one group (group_size, val.n): at most what one group message can carry."""
NonNegativeFloat = Annotated[float, Meta(ge=0)]
"""A rate, latency or coefficient that may be zero."""
PositiveFloat = Annotated[float, Meta(gt=0)]
"""A scale that must be above zero."""
Fraction = Annotated[float, Meta(ge=0, le=1)]
"""A probability or share in [0, 1]."""
OpenFraction = Annotated[float, Meta(gt=0, le=1)]
"""A share in (0, 1]: nucleus mass, memory fraction."""

StopStrings = Annotated[
    list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=16)
]
"""Stop strings of a call: at most 16, each 1 to 256 characters."""

Device = Literal["auto", "cpu", "cuda"]
"""auto: CUDA when available, else CPU."""
Dtype = Literal["float32", "bfloat16", "float16"]
"""An inference engine's compute dtype."""
EngineName = Literal["hf", "vllm", "sglang", "sim"]
"""Which engine serves a pool."""
PauseMode = Literal["keep", "abort"]
"""What in-flight requests do around a weight update."""
Precision = Literal["fp32", "bf16-mixed", "bf16-pure"]
"""How a learner holds and computes a model's weights."""
AdvantageMode = Literal[
    "global", "agent", "agent_mean", "agent_std", "step_global", "agent_turn",
    "agent_centred", "agent_shifted",
]  # fmt: skip
"""global = GRPO; agent = Dr. MAS; agent_turn = per agent and turn (AT-GRPO); the others
are ablations (docs/algorithm.md)."""
StdKind = Literal["unbiased", "population"]
"""n-1 (the reference code) or n (the paper)."""
Scope = Literal["group", "batch"]
"""Where advantage statistics are pooled."""
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""How token losses are averaged into one number."""
ISCorrection = Literal["tis", "mask", "none"]
"""Off-policy correction of the PPO loss."""
WeightsBackend = Literal["auto", "gloo", "nccl"]
"""torch.distributed backend of the weight group."""
RetrieverName = Literal["bm25", "dense", "http"]
"""Where `<search>` queries are answered."""
ShareMode = Literal["auto", "exclusive", "shared"]
"""Whether actors may share the learners' GPUs."""
TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]
"""Where metrics lines go (the broker writes them)."""
ProbeBaseline = Literal[
    "global", "step_global", "agent_mean", "agent_std", "agent_turn", "agent_centred",
    "agent_shifted",
]  # fmt: skip
"""Advantage modes `drmas probe` compares with agent-wise advantages (`agent`)."""
OnInvalid = Literal["continue", "end"]
RewardKind = Literal["team", "role"]
"""team: every step scored with the episode's team reward; role: each agent paid for its
own job (the built-in teams' role rewards, docs/own-team.md)."""
ZeroVarianceBy = Literal["group", "model"]
"""algorithm.zero_variance_by: who leaves out a group without signal (the whole team, or
each model its own slice)."""
StdPool = Literal["group", "batch"]
"""Where an agent's standard deviation comes from: its steps in the group, or its
group-centred scores pooled over the batch (the group mean kept)."""
"""search team: what follows an action that does not parse."""
