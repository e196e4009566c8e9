"""Actor settings: engine, sampling, workflow. Plain dataclasses (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from drmas.config.types import (
    Device,
    Dtype,
    EngineName,
    Fraction,
    NonNegative,
    NonNegativeFloat,
    OnInvalid,
    OpenFraction,
    PauseMode,
    Port,
    Positive,
    PositiveFloat,
    RewardKind,
    Seconds,
    StopStrings,
)


@dataclass
class EngineConfig:
    """One inference engine per model pool on the actor."""

    name: EngineName = "hf"
    """Which engine serves the pool."""
    max_batch: Positive = 64
    """Sequences decoded together."""
    device: Device = "auto"
    """auto: CUDA when available."""
    dtype: Dtype = "float32"
    """Inference dtype."""
    seed: int = 0
    """Sampling seed; each actor adds a hash of its id, so actors sample independently."""
    sim_token_latency_s: NonNegativeFloat = 0.005
    """sim engine: seconds one decode step takes, for the whole running batch at once."""
    sim_prompt_latency_s_per_token: NonNegativeFloat = 0.00002
    """sim engine: prefill seconds per prompt token admitted (summed over the admitted batch)."""
    sim_stop_prob: Fraction = 0.02
    """sim engine: chance that a sampled token is EOS (finish_reason "stop")."""
    sim_vocab_size: NonNegative = 0
    """sim engine: sample token ids below this; 0 (or more than the model has) = the model's
    whole vocabulary."""
    tensor_parallel_size: Positive = 1
    """vllm/sglang: GPUs one engine shards the model over."""
    gpu_memory_utilization: OpenFraction = 0.9
    """vllm/sglang: fraction of GPU memory the engine may take (weights + KV cache)."""
    max_model_len: NonNegative = 0
    """vllm/sglang: longest prompt + response in tokens; 0 = the model's own limit."""
    enable_prefix_caching: bool = True
    """vllm/sglang: reuse the KV cache of shared prefixes (group samples, multi-turn)."""
    pause_mode: PauseMode = "keep"
    """Around a weight update: keep (in-flight requests wait and continue with the new
    weights) or abort (they are dropped and restarted from their prompt after the update)."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """vllm/sglang: further engine arguments passed as given (e.g. enforce_eager: true)."""
    sglang_url: str = ""
    """sglang: URL of a running server; "" = start and stop one (python -m sglang.launch_server)."""
    sglang_host: str = "127.0.0.1"
    """sglang: address a managed server binds."""
    sglang_port: Port = 0
    """sglang: port of a managed server; 0 = a free one."""
    sglang_bridge_host: str = "127.0.0.1"
    """sglang: address the server reaches this actor's weight bridge at."""
    sglang_start_timeout_s: Seconds = 600.0
    """sglang: seconds a managed server has to answer /health."""
    sglang_request_timeout_s: Seconds = 600.0
    """sglang: seconds one /generate may take."""
    sglang_weight_timeout_s: Seconds = 300.0
    """sglang: seconds for the bridge rendezvous and each bucket."""


@dataclass
class SamplingConfig:
    """Training-time sampling (validation has its own in ValConfig)."""

    temperature: NonNegativeFloat = 1.0
    """Softmax temperature."""
    top_p: OpenFraction = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: Positive = 256
    """Response length cap per agent call."""
    stop: StopStrings = field(default_factory=list)
    """Stop strings: a call ends once its decoded response contains one (kept in the
    response, so the tokens trained are those sampled)."""


@dataclass
class AgentSamplingConfig:
    """One agent's own training sampling (`agents.<name>.sampling`); a field left unset
    takes `sampling`'s."""

    temperature: NonNegativeFloat | None = None
    top_p: OpenFraction | None = None
    max_new_tokens: Positive | None = None
    stop: StopStrings | None = None


@dataclass
class AgentValConfig:
    """One agent's own validation sampling (`agents.<name>.val`); unset fields take `val`'s
    (and max_new_tokens and stop its training ones, as for the run)."""

    temperature: NonNegativeFloat | None = None
    top_p: OpenFraction | None = None


@dataclass
class WorkflowConfig:
    """The team an episode runs (drmas/teams): which one, its prompts, tools and reward."""

    name: str = "math"
    """A registered team: math (Solver <-> Verifier), search (Verifier -> Search Agent |
    Answer Agent), or one an installed package declares (entry points `drmas.teams`)."""
    target: str = ""
    """Your own team instead of `name`: a Team class (package.module:Class or
    path/to/file.py:Class), or a program `async def episode(client, task)` written against
    the OpenAI client, whose agents are the config's `agents` (docs/own-team.md). A
    relative file resolves against the --config file's folder, else the working directory."""
    episode_timeout_s: Seconds = 600.0
    """A program team's episode: how long it may run before its group fails."""
    endpoint: Literal["in_process", "http"] = "in_process"
    """A program team's client: in_process (its transport calls the actor directly) or
    http (the actor serves the endpoint; the client's base_url and api_key can be handed
    to another process)."""
    endpoint_host: str = "127.0.0.1"
    """endpoint=http: the address it listens on (loopback unless you say otherwise)."""
    endpoint_port: Port = 0
    """endpoint=http: its port (0: a free one, logged)."""
    reward: str = ""
    """Replace the team's reward: a function (task, answer or None) -> float, given as
    package.module:fn or path/to/file.py:fn."""
    tools: dict[str, str] = field(default_factory=dict)
    """Extra tools: name -> async function (argument text -> result text), as a target.
    The search team's `search` tool (the retriever) may be replaced this way."""
    options: dict[str, Any] = field(default_factory=dict)
    """Free settings of your own team (read as self.cfg.options)."""
    rewards: RewardKind = "team"
    """team: every step of an episode is scored with the team's reward (as the paper);
    role: the built-in teams pay each agent for its own job (math: the Solver for a right
    answer, the Verifier for a right verdict; search: the Search Agent for retrieving the
    answer, the Answer Agent for exact match, the Verifier for a right verdict)."""
    max_loops: Positive = 2
    """math: Solver/Verifier rounds; the Verifier is skipped on the last one."""
    max_turns: Positive = 4
    """search: turns of at most Verifier + Search Agent each; the last turn is the Answer
    Agent's (so at most max_turns - 1 searches)."""
    on_invalid: OnInvalid = "continue"
    """search: after an action that does not parse (a Verifier reply without a verdict, a
    Search Agent reply without a query): continue (the reply stays in the context and the
    next turn starts) or end (the episode stops unanswered). The step is penalised either
    way (algorithm.invalid_action_penalty)."""
    reward_scale: dict[str, PositiveFloat] = field(default_factory=dict)
    """Agent name -> factor its step scores are multiplied by (its reward and its
    invalid-action penalty: an agent paid in other units); unnamed agents 1. Dr. MAS
    (mode agent) is invariant to it; global, step_global and agent_mean are not."""
    prompt_style: str = "plain"
    """plain text prompts (tiny models) or the tokenizer's chat template."""
    instructions: dict[str, str] | None = None
    """Per-agent role instruction; None = the workflow's own."""


@dataclass
class ActorConfig:
    """One actor process: engines for the models it serves, running leased groups."""

    id: str = ""
    """Unique name; empty = host-pid."""
    num_actors: NonNegative = 1
    """drmas train: actor processes to start."""
    models: list[str] | None = None
    """Models this actor serves; None = all of the run's models."""
    max_groups: Positive = 8
    """Leased groups held at once (their episodes are batched together)."""
    max_failed_groups: NonNegative = 20
    """Groups whose team code (run_episode, a tool, the reward) raised, in a row with no
    success between, after which the actor stops with the team's error (and `drmas train`
    stops the run); each failed group's lease is handed back. 0 = never stop."""
    min_failing_s: NonNegativeFloat = 10.0
    """...and only once the failures in a row have gone on this long: a tool that is down
    for a moment (a retriever restarting) fails many groups at once in less time."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine of every pool on this actor unless `pools` names the pool's model."""
    pools: dict[str, EngineConfig] = field(default_factory=dict)
    """Per-model engine (model name -> its whole engine config); a model not listed uses
    `engine`. A pool serves one model for all agents bound to it."""

    def engine_of(self, model: str) -> EngineConfig:
        """The engine config of the pool that serves `model`."""
        return self.pools.get(model, self.engine)
