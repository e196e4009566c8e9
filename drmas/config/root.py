"""The run's root config: one typed schema composed from each component's own.

Hydra composes `configs/config.yaml` (experiment, model, engine, deploy groups) over this
schema; `load_config` converts it once to plain dataclasses and checks cross-field rules.
Each process then reads only its own slice. No torch import here (`drmas --help` is fast).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from drmas.config.actor import ActorConfig, EngineName, SamplingConfig, WorkflowConfig
from drmas.config.broker import AdvantageConfig, AdvantageMode, BrokerConfig
from drmas.config.checkpoint import CheckpointConfig
from drmas.config.errors import ConfigError
from drmas.config.learner import ISCorrection, LearnerConfig, LossAgg, LossConfig, ProbeConfig
from drmas.config.model import PRECISIONS, ModelConfig
from drmas.config.placement import SHARE_MODES, PlacementConfig
from drmas.config.retrieval import RETRIEVERS, RetrieverConfig
from drmas.config.task import TaskConfig
from drmas.config.transport import SecurityConfig, WeightSyncConfig
from drmas.plugins import TargetError, absolute_target, load_object


@dataclass
class AgentConfig:
    """One agent of the team: a role in the workflow bound to a trainable model."""

    model: str = ""
    """Name of the model in `models` this agent's calls use (agents may share one)."""
    lr: float | None = None
    """Learning rate for this agent's model (only when no other agent shares it)."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantages (broker), loss (learner), staleness."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    max_staleness: int = 1
    """η: a step generated at version v_b may train version v_l only if v_l - v_b <= η."""
    invalid_action_penalty: float = 0.1
    """Subtracted from the team reward for a step whose action did not parse."""


@dataclass
class ValConfig:
    """Held-out evaluation run by the actors on leases marked is_eval."""

    every: int = 10
    """Evaluate every this many steps (0 = never); also at the end."""
    at_start: bool = True
    """Also evaluate before the first step (false: the first round is at step `every`)."""
    num_tasks: int = 32
    """Held-out tasks per evaluation."""
    n: int = 4
    """Samples per task."""
    k: int = 4
    """k of avg@k and pass@k (pass@k uses the unbiased estimator over n >= k samples)."""
    temperature: float = 0.6
    """Validation sampling temperature."""
    top_p: float = 0.95
    """Validation nucleus mass."""


@dataclass
class TrainLoopConfig:
    """How long to train."""

    steps: int = 30
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
    samples_every: int = 10
    """Every this many steps, whole episodes of one training group go to
    RUN_DIR/samples.jsonl as text (`drmas show RUN_DIR`); 0 = never."""
    samples_episodes: int = 2
    """Episodes of that group written (each with every agent's turns)."""
    project: str = "drmas"
    """Project (W&B) or experiment (MLflow) name of the run in the trackers of `logger`."""


@dataclass
class DrmasConfig:
    """Everything one deployment needs; every role reads its slice of it."""

    run: RunConfig = field(default_factory=RunConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    group_size: int = 8
    """G: episodes per task (one group)."""
    batch_groups: int = 8
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
    logger: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where metrics go: jsonl (RUN_DIR/metrics.jsonl, always), tensorboard, wandb
    (offline unless WANDB_MODE says otherwise), mlflow; e.g. logger=[jsonl,tensorboard]."""

    def __post_init__(self) -> None:
        check(self)

    def model_of(self, agent: str) -> str:
        return self.agents[agent].model

    def agents_of(self, model: str) -> list[str]:
        return [name for name, a in self.agents.items() if a.model == model]

    def world_size_of(self, model: str) -> int:
        return self.models[model].world_size or self.learner.world_size

    def lr_of(self, model: str) -> float:
        lrs = {a.lr for a in self.agents.values() if a.model == model and a.lr is not None}
        return lrs.pop() if lrs else self.models[model].lr


def check(cfg: DrmasConfig) -> None:
    """Cross-field rules; drops models no agent uses. Raises ConfigError saying what to fix."""
    if not cfg.agents:
        raise ConfigError("no agents configured: pick an experiment, e.g. experiment=tiny_math")
    from drmas.plugins import team_class

    team = team_class(cfg.workflow)
    if cfg.workflow.target:
        cfg.workflow.name = team.name  # what logs and the run's config call it
    expected = set(team.agents)
    if set(cfg.agents) != expected:
        missing, extra = sorted(expected - set(cfg.agents)), sorted(set(cfg.agents) - expected)
        raise ConfigError(
            f"the {team.name} team has agents {sorted(expected)}, the config's `agents` names "
            f"{sorted(cfg.agents)} (missing {missing}, not in the team {extra}): bind each "
            "of the team's agents to a model in your config file (agents: {NAME: {model: "
            "MODEL}}), or replace them on the command line: '~agents' "
            "'+agents={NAME: {model: MODEL}, ...}'"
        )
    for name, agent in cfg.agents.items():
        if agent.model not in cfg.models:
            raise ConfigError(
                f"agents.{name}.model={agent.model!r} is not in models {sorted(cfg.models)}"
            )
    declared_models = list(cfg.models)
    for model in list(cfg.models):
        users = cfg.agents_of(model)
        if not users:
            del cfg.models[model]  # declared but unused (e.g. agents.verifier.model=solver)
            continue
        lrs = {lr for a in users if (lr := cfg.agents[a].lr) is not None}
        if len(lrs) > 1:
            raise ConfigError(
                f"agents {users} share model {model!r} but set different lr {sorted(lrs)}; "
                f"set models.{model}.lr instead"
            )
    device = ("auto", "cpu", "cuda")
    choices = {
        "algorithm.advantage.mode": (cfg.algorithm.advantage.mode, get_args(AdvantageMode)),
        "algorithm.advantage.std": (cfg.algorithm.advantage.std, ("unbiased", "population")),
        "algorithm.advantage.scope": (cfg.algorithm.advantage.scope, ("group", "batch")),
        "algorithm.loss.agg": (cfg.algorithm.loss.agg, get_args(LossAgg)),
        "algorithm.loss.is_correction": (cfg.algorithm.loss.is_correction, get_args(ISCorrection)),
        "actor.engine.name": (cfg.actor.engine.name, get_args(EngineName)),
        "actor.engine.device": (cfg.actor.engine.device, device),
        "actor.engine.dtype": (cfg.actor.engine.dtype, ("float32", "bfloat16", "float16")),
        "learner.device": (cfg.learner.device, device),
        "workflow.prompt_style": (cfg.workflow.prompt_style, tuple(team.default_instructions)),
        "retriever.name": (cfg.retriever.name, RETRIEVERS),
        "weights.backend": (cfg.weights.backend, ("auto", "gloo", "nccl")),
        "placement.share": (cfg.placement.share, SHARE_MODES),
    }
    for pool_name, pool in cfg.actor.pools.items():  # every pool, not only the default one
        prefix = f"actor.pools.{pool_name}"
        choices[f"{prefix}.name"] = (pool.name, get_args(EngineName))
        choices[f"{prefix}.device"] = (pool.device, device)
        choices[f"{prefix}.dtype"] = (pool.dtype, ("float32", "bfloat16", "float16"))
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    from drmas.broker.trackers import TRACKERS, missing_packages
    from drmas.config.schema import literal_problems

    unknown_trackers = sorted(set(cfg.logger) - set(TRACKERS))
    if unknown_trackers:
        raise ConfigError(f"logger names {unknown_trackers}; choose from {list(TRACKERS)}")
    absent = missing_packages(list(cfg.logger))
    if absent:
        raise ConfigError(
            f"logger={list(cfg.logger)}: {absent} not installed here; pip install "
            "'drmas[trackers]' (tensorboardX, wandb, mlflow-skinny)"
        )

    literals = literal_problems(cfg)  # every Literal-typed field, wherever it is
    if literals:
        raise ConfigError("; ".join(literals))
    for model_name, model_cfg in cfg.models.items():
        if model_cfg.dtype:
            raise ConfigError(
                f"models.{model_name}.dtype={model_cfg.dtype!r} was replaced by "
                f"models.{model_name}.precision: bf16-mixed (fp32 master weights, bf16 "
                "compute; what bfloat16 should have meant), bf16-pure (bf16 weights, what "
                "dtype=bfloat16 did) or fp32"
            )
        if model_cfg.precision not in PRECISIONS:
            raise ConfigError(
                f"models.{model_name}.precision={model_cfg.precision!r} is not one of "
                f"{list(PRECISIONS)}"
            )
    positive = {
        "group_size": cfg.group_size,
        "batch_groups": cfg.batch_groups,
        "train.steps": cfg.train.steps,
        "learner.world_size": cfg.learner.world_size,
        "learner.micro_batch_size": cfg.learner.micro_batch_size,
        "learner.ppo_minibatches": cfg.learner.ppo_minibatches,
        "learner.ppo_epochs": cfg.learner.ppo_epochs,
        "actor.max_groups": cfg.actor.max_groups,
        "sampling.max_new_tokens": cfg.sampling.max_new_tokens,
        "workflow.max_loops": cfg.workflow.max_loops,
        "workflow.max_turns": cfg.workflow.max_turns,
        "retriever.top_k": cfg.retriever.top_k,
        "retriever.max_batch": cfg.retriever.max_batch,
    }
    for key, count in positive.items():
        if count < 1:
            raise ConfigError(f"{key} must be >= 1, got {count}")
    if cfg.algorithm.max_staleness < 0:
        raise ConfigError(
            f"algorithm.max_staleness must be >= 0, got {cfg.algorithm.max_staleness}"
        )
    if cfg.val.every and cfg.val.n < cfg.val.k:
        raise ConfigError(f"val.n ({cfg.val.n}) must be >= val.k ({cfg.val.k})")
    if not (0.0 < cfg.sampling.top_p <= 1.0):
        raise ConfigError(f"sampling.top_p must be in (0, 1], got {cfg.sampling.top_p}")
    unknown_pools = sorted(set(cfg.actor.pools) - set(declared_models))
    if unknown_pools:
        raise ConfigError(
            f"actor.pools names {unknown_pools}, which are not in models {sorted(declared_models)}"
        )
    pools = {f"actor.pools.{m}": e for m, e in cfg.actor.pools.items()}
    for key, engine_cfg in {"actor.engine": cfg.actor.engine, **pools}.items():
        if problems := engine_cfg.problems(key):
            raise ConfigError("; ".join(problems))
    engine = cfg.actor.engine
    if engine.sim_token_latency_s < 0 or engine.sim_prompt_latency_s_per_token < 0:
        raise ConfigError("actor.engine.sim_*latency* must be >= 0 seconds")
    if not (0.0 <= engine.sim_stop_prob <= 1.0):
        raise ConfigError(
            f"actor.engine.sim_stop_prob must be in [0, 1], got {engine.sim_stop_prob}"
        )
    if engine.sim_vocab_size < 0:
        raise ConfigError(f"actor.engine.sim_vocab_size must be >= 0, got {engine.sim_vocab_size}")
    if cfg.task.name in ("jsonl", "parquet") and not cfg.task.train_path:
        raise ConfigError(
            f"task.name={cfg.task.name} needs task.train_path=FILE (and optionally "
            "task.val_path=FILE for validation)"
        )
    _check_task(cfg)
    _check_plugins(cfg)
    team.check_config(cfg)
    _check_probe(cfg)
    if cfg.group_size < 2 and cfg.algorithm.advantage.scope == "group":
        raise ConfigError("group_size must be >= 2 for group-relative advantages")


def _check_probe(cfg: DrmasConfig) -> None:
    p = cfg.probe
    unknown = sorted(set(p.rewards) - set(cfg.agents))
    if unknown:
        raise ConfigError(
            f"probe.rewards names {unknown}, which are not agents {sorted(cfg.agents)}"
        )
    if p.rewards and set(p.rewards) != set(cfg.agents):
        raise ConfigError(
            f"probe.rewards must give [mean, std] for every agent {sorted(cfg.agents)}, "
            f"got {sorted(p.rewards)}"
        )
    for agent, dist in p.rewards.items():
        numbers = all(isinstance(x, (int, float)) and math.isfinite(x) for x in dist)
        if len(dist) != 2 or not numbers or not dist[1] >= 0:
            raise ConfigError(f"probe.rewards.{agent} must be [mean, std >= 0], got {list(dist)}")
        p.rewards[agent] = [float(x) for x in dist]
    bad = sorted(set(p.baselines) - {"global", "step_global", "agent_mean", "agent_std"})
    if bad or not p.baselines:
        raise ConfigError(
            f"probe.baselines={list(p.baselines)}: use global, step_global (and the ablations "
            "agent_mean, agent_std)"
        )
    if p.groups < 2 or p.group_size == 1 or p.group_size < 0 or p.bootstrap < 1:
        raise ConfigError(
            "probe.groups must be >= 2, probe.group_size 0 (the run's) or >= 2, "
            "probe.bootstrap >= 1"
        )


def _check_plugins(cfg: DrmasConfig) -> None:
    """`workflow.reward` and `workflow.tools` name loadable functions (tools: async ones)."""
    import inspect

    named = {f"workflow.tools.{n}": t for n, t in cfg.workflow.tools.items()}
    if cfg.workflow.reward:
        named["workflow.reward"] = cfg.workflow.reward
    for key, target in named.items():
        try:
            fn = load_object(target, key)
        except (TargetError, ImportError, SyntaxError) as exc:
            raise ConfigError(str(exc)) from exc
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an instance may be the tool
        )
        if not callable(fn) or (key != "workflow.reward" and not is_async):
            kind = (
                "a function (task, answer) -> float"
                if key == "workflow.reward"
                else ("an async function (argument: str) -> str")
            )
            raise ConfigError(f"{key}={target!r} must be {kind}")


def _check_task(cfg: DrmasConfig) -> None:
    """A built-in task source, a file kind, or a loadable function target."""
    from drmas.tasks.source import BUILTIN_SOURCES, FILE_KINDS

    name = cfg.task.name
    if name in BUILTIN_SOURCES or name in FILE_KINDS:
        return
    if ":" not in name:
        raise ConfigError(
            f"task.name={name!r}: choose {', '.join([*BUILTIN_SOURCES, *FILE_KINDS])}, or give "
            "your own task source as package.module:fn or path/to/file.py:fn"
        )
    try:
        fn = load_object(name, "task.name")
    except (TargetError, ImportError, SyntaxError) as exc:
        raise ConfigError(str(exc)) from exc
    if not callable(fn):
        raise ConfigError(f"task.name={name!r} is not a function (TaskConfig) -> (train, val)")


def config_dir() -> Path:
    """configs/ at the repo root, or $DRMAS_CONFIG_DIR."""
    env = os.environ.get("DRMAS_CONFIG_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "configs"


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="drmas_schema", node=DrmasConfig)


# Free-form mappings that start empty: hydra refuses `key={...}` on them ("use +key"), so
# their plain overrides are taken as `++key=...` (set or replace).
_FREE_MAPPINGS = ("probe.rewards", "workflow.tools", "workflow.options", "task.options")

TARGET_KEYS = ("workflow.target", "workflow.reward", "task.name")
"""Options that may name a file (path/to/file.py:Name); `workflow.tools.*` too."""


def _absolute_targets(merged: Any, overrides: list[str], config_file: Path | None) -> None:
    """Make `file.py:Name` targets absolute, so every process of the run (started anywhere,
    reading the run's config.yaml) loads the same file: a target written in a --config
    file is relative to that file's folder, one given on the command line to the working
    directory."""
    from omegaconf import OmegaConf

    given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    tools = OmegaConf.select(merged, "workflow.tools") or {}
    for key in (*TARGET_KEYS, *(f"workflow.tools.{name}" for name in tools)):
        value = OmegaConf.select(merged, key)
        if isinstance(value, str) and value:
            base = config_file.parent if config_file and key not in given else Path.cwd()
            OmegaConf.update(merged, key, absolute_target(value, base))


def _free_mapping_override(override: str) -> str:
    key = override.split("=", 1)[0]
    if any(key == m or key.startswith(m + ".") for m in _FREE_MAPPINGS):
        return "++" + override
    return override


def load_config(overrides: list[str], config_file: str | None = None) -> DrmasConfig:
    """Compose configs/config.yaml (or a resolved config.yaml of a run) with overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from drmas.config.schema import check_overrides

    problem = check_overrides(overrides, DrmasConfig, _FREE_MAPPINGS)
    if problem:  # before hydra: its own advice for a typo is to add it with `+`
        raise ConfigError(problem)
    register()
    GlobalHydra.instance().clear()
    try:
        if config_file:
            path = Path(config_file).resolve()
            schema = OmegaConf.structured(DrmasConfig)
            merged = OmegaConf.merge(schema, OmegaConf.load(path))
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(overrides))
        else:
            path = None
            with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
                merged = compose(
                    config_name="config", overrides=[_free_mapping_override(o) for o in overrides]
                )
        _absolute_targets(merged, overrides, path)
        obj = OmegaConf.to_object(merged)
    except (HydraException, OmegaConfBaseException) as exc:
        hint = ""
        if "Environment variable" in str(exc):  # ${oc.env:...} of a deploy config
            hint = "\nexport that variable, or pass the key as an override instead"
        raise ConfigError(f"bad config or override: {exc}{hint}") from None
    assert isinstance(obj, DrmasConfig)
    return obj


def config_dict(cfg: DrmasConfig) -> dict:
    """The resolved config as plain dicts and lists (for trackers' run configs)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(OmegaConf.structured(cfg))
    assert isinstance(plain, dict)
    return plain


def to_yaml(cfg: DrmasConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
