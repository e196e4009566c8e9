"""The run's root config: one typed schema composed from each component's own section.

Hydra composes `configs/config.yaml` (experiment, deploy groups) and the overrides;
drmas/config/load.py converts the result once into these dataclasses (msgspec checks each
field's type, range and choices) and drmas/config/rules.py checks the rules that span
fields. Each process then reads only its own slice. No torch import, no plug-in import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from drmas.config.actor import (
    ActorConfig,
    AgentSamplingConfig,
    AgentValConfig,
    SamplingConfig,
    WorkflowConfig,
)
from drmas.config.broker import AdvantageConfig, BrokerConfig
from drmas.config.checkpoint import CheckpointConfig
from drmas.config.learner import LearnerConfig, LossConfig, ProbeConfig
from drmas.config.model import ModelConfig
from drmas.config.placement import PlacementConfig
from drmas.config.retrieval import RetrieverConfig
from drmas.config.task import TaskConfig
from drmas.config.transport import SecurityConfig, WeightSyncConfig
from drmas.config.types import (
    GroupSize,
    NonNegative,
    NonNegativeFloat,
    OpenFraction,
    Positive,
    PositiveFloat,
    Seconds,
    TrackerName,
    ZeroVarianceBy,
)


@dataclass
class AgentConfig:
    """One agent of the team: a role in the workflow bound to a trainable model."""

    model: str = ""
    """Name of the model in `models` this agent's calls use (agents may share one)."""
    lr: PositiveFloat | None = None
    """Learning rate for this agent's model, or for its adapter on a LoRA base (agents
    that share a model without adapters, or share an adapter, must agree)."""
    adapter: str = ""
    """On a model with lora.rank > 0: the LoRA adapter this agent trains ("" = one named
    after the agent); agents naming the same adapter share it."""
    sampling: AgentSamplingConfig = field(default_factory=AgentSamplingConfig)
    """This agent's own training sampling (temperature, top_p, max_new_tokens, stop);
    unset fields take `sampling`'s. The learner scores its samples at its temperature."""
    val: AgentValConfig = field(default_factory=AgentValConfig)
    """This agent's own validation sampling (temperature, top_p); unset fields take `val`'s."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantages (broker), loss (learner), staleness."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    max_staleness: NonNegative = 1
    """η: a step generated at version v_b may train version v_l only if v_l - v_b <= η."""
    invalid_action_penalty: NonNegativeFloat = 0.1
    """Subtracted from a step's reward (its own Step.reward, else the team's) when its
    action did not parse."""
    skip_zero_variance: bool = False
    """Leave out of a batch every group without a learning signal (DAPO's dynamic sampling,
    per agent), count it, and fill the batch from later groups; zero_variance_by says
    whose signal."""
    zero_variance_by: ZeroVarianceBy = "group"
    """With skip_zero_variance: group = a group is left out by every model when no agent's
    scores vary in it; model = each model leaves out its own slice of a group when none of
    its own agents' scores vary (counted per model)."""


@dataclass
class ValConfig:
    """Held-out evaluation run by the actors on leases marked is_eval."""

    every: NonNegative = 10
    """Evaluate every this many steps (0 = never); also at the end."""
    at_start: bool = True
    """Also evaluate before the first step (false: the first round is at step `every`)."""
    num_tasks: Positive = 32
    """Held-out tasks per evaluation."""
    n: GroupSize = 4
    """Samples per task (one group of n episodes, at most 4096)."""
    k: Positive = 4
    """k of avg@k and pass@k (pass@k uses the unbiased estimator over n >= k samples)."""
    temperature: NonNegativeFloat = 0.6
    """Validation sampling temperature."""
    top_p: OpenFraction = 0.95
    """Validation nucleus mass."""
    final_timeout_s: Seconds = 3600.0
    """drmas train: once the learners have finished, how long to wait for the final
    validation round (num_tasks x n episodes; minutes on a CPU with a real model) before
    stopping the run without it, with a warning saying so."""


@dataclass
class TrainLoopConfig:
    """How long to train."""

    steps: Positive = 30
    """Training steps per model: batches, each making learner.ppo_minibatches x
    learner.ppo_epochs optimizer updates; a model's weight version counts them."""
    progress: bool = True
    """Live progress display (drmas train)."""


@dataclass
class RunConfig:
    """Where the run lives."""

    dir: str = ""
    """Run folder (config.yaml, metrics.jsonl, logs/, models/); empty = runs/<time>."""
    cache_dir: str = ""
    """Builtin model cache; empty = $DRMAS_CACHE or ~/.cache/drmas."""
    resume: str = ""
    """A run folder to continue from its last complete checkpoint (versions, optimizer,
    data cursor and metrics continue); empty = a fresh run."""
    samples_every: NonNegative = 10
    """Every this many steps, whole episodes of one training group go to
    RUN_DIR/samples.jsonl as text (`drmas show RUN_DIR`); 0 = never."""
    samples_episodes: Positive = 2
    """Episodes of that group written (each with every agent's turns)."""
    project: str = "drmas"
    """Project (W&B) or experiment (MLflow) name of the run in the trackers of `logger`."""


@dataclass
class DrmasConfig:
    """Everything one deployment needs; every role reads its slice of it."""

    run: RunConfig = field(default_factory=RunConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    group_size: GroupSize = 8
    """G: episodes per task (one group; at most 4096, what one group message carries)."""
    batch_groups: Positive = 8
    """B: groups per training batch of each model."""
    models: dict[str, ModelConfig] = field(default_factory=dict)
    """Trainable policies by name."""
    agents: dict[str, AgentConfig] = field(default_factory=dict)
    """The team: agent name -> binding. Names must match the workflow's agents."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    val: ValConfig = field(default_factory=ValConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """drmas train on a GPU node: which GPUs each process gets."""
    logger: list[TrackerName] = field(default_factory=lambda: ["jsonl"])
    """Where metrics go: jsonl (RUN_DIR/metrics.jsonl, always), tensorboard, wandb
    (offline unless WANDB_MODE says otherwise), mlflow; e.g. logger=[jsonl,tensorboard]."""

    def model_of(self, agent: str) -> str:
        return self.agents[agent].model

    def sampling_of(self, agent: str) -> SamplingConfig:
        """`agent`'s training sampling: its own settings over the run's `sampling`."""
        own, run = self.agents[agent].sampling, self.sampling
        return SamplingConfig(
            run.temperature if own.temperature is None else own.temperature,
            run.top_p if own.top_p is None else own.top_p,
            run.max_new_tokens if own.max_new_tokens is None else own.max_new_tokens,
            list(run.stop if own.stop is None else own.stop),
        )

    def val_sampling_of(self, agent: str) -> SamplingConfig:
        """`agent`'s validation sampling: its own `val` settings over the run's `val`; the
        length cap and stop strings are its training ones."""
        own, train = self.agents[agent].val, self.sampling_of(agent)
        return SamplingConfig(
            self.val.temperature if own.temperature is None else own.temperature,
            self.val.top_p if own.top_p is None else own.top_p,
            train.max_new_tokens,
            train.stop,
        )

    def agents_of(self, model: str) -> list[str]:
        return [name for name, a in self.agents.items() if a.model == model]

    def world_size_of(self, model: str) -> int:
        return self.models[model].world_size or self.learner.world_size

    def lr_of(self, model: str, adapter: str = "") -> float:
        """The learning rate of `model`, or of one adapter of a LoRA model."""
        names = self.agents_of(model)
        if adapter:
            names = [n for n in names if self.adapter_of(n) == adapter]
        lrs = {lr for n in names if (lr := self.agents[n].lr) is not None}
        return lrs.pop() if lrs else self.models[model].lr

    def has_adapters(self, model: str) -> bool:
        """Whether `model` is a frozen base whose agents train LoRA adapters."""
        return self.models[model].lora.rank > 0

    def adapter_of(self, agent: str) -> str:
        """The adapter `agent` trains ("" when its model has no adapters)."""
        binding = self.agents[agent]
        if not self.has_adapters(binding.model):
            return ""
        return binding.adapter or agent

    def adapters_of(self, model: str) -> list[str]:
        """The adapters of a LoRA base, in the order of the agents that name them."""
        return list(dict.fromkeys(self.adapter_of(a) for a in self.agents_of(model)))
