"""The config rules that span fields. A single field's type, range and choices are
declared on the field (drmas/config/types.py) and checked while converting; what is left
here relates one field to another. Pure: no plug-in is imported (drmas/plugins.py checks
teams, tools, rewards and task sources, for the roles that load them)."""

from __future__ import annotations

import dataclasses
import math

from drmas.config.errors import ConfigError
from drmas.config.root import DrmasConfig

WARMSTART_WORKFLOWS = ("math", "search", "search_queries")
"""Built-in warm-start transcript sources (else a package.module:SOURCE target)."""


def check(cfg: DrmasConfig) -> DrmasConfig:
    """`cfg` with the models no agent uses dropped; raises ConfigError saying what to fix."""
    _check_agents(cfg)
    used = {name: m for name, m in cfg.models.items() if cfg.agents_of(name)}
    _check_models(cfg)
    _check_counts(cfg)
    _check_probe(cfg)
    _check_one_distribution(cfg)
    _check_batch_scope(cfg)
    _check_sigma_options(cfg)
    _check_weights_host(cfg.weights.host)
    return dataclasses.replace(cfg, models=used)


WILDCARDS = ("", "*", "0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0")


def _check_weights_host(host: str) -> None:
    """weights.host is bound by learner rank 0's store and advertised to the actors: a
    wildcard would expose the store on every interface and give actors nothing to dial."""
    if host.strip() in WILDCARDS:
        raise ConfigError(
            f"weights.host={host!r} is a wildcard: the weight store would listen on every "
            "interface and actors would be told an address they cannot dial. Set the address "
            "of this learner that only the run's actors reach (127.0.0.1 on one machine), or "
            "auto (this node's address on the route to the broker)"
        )


def _check_agents(cfg: DrmasConfig) -> None:
    if not cfg.agents:
        raise ConfigError("no agents configured: pick an experiment, e.g. experiment=tiny_math")
    for name, agent in cfg.agents.items():
        if agent.model not in cfg.models:
            raise ConfigError(
                f"agents.{name}.model={agent.model!r} is not in models {sorted(cfg.models)}"
            )
    for model in cfg.models:
        _check_shared_lr(cfg, model)
    unknown_scales = sorted(set(cfg.workflow.reward_scale) - set(cfg.agents))
    if unknown_scales:
        raise ConfigError(
            f"workflow.reward_scale names {unknown_scales}, which are not agents of the team "
            f"{sorted(cfg.agents)}: scale an agent by its name"
        )
    unknown_pools = sorted(set(cfg.actor.pools) - set(cfg.models))
    if unknown_pools:
        raise ConfigError(
            f"actor.pools names {unknown_pools}, which are not in models {sorted(cfg.models)}"
        )


def _check_shared_lr(cfg: DrmasConfig, model: str) -> None:
    """Agents that train the same weights (a model without adapters, or one adapter) must
    agree on their learning rate; an adapter needs a model with lora.rank > 0."""
    users = cfg.agents_of(model)
    for agent in users:
        if cfg.agents[agent].adapter and not cfg.has_adapters(model):
            raise ConfigError(
                f"agents.{agent}.adapter={cfg.agents[agent].adapter!r} but model {model!r} "
                f"has no adapters: set models.{model}.lora.rank (e.g. 8) to train adapters "
                "on it as a frozen base"
            )
    by_weights: dict[str, list[str]] = {}
    for agent in users:
        by_weights.setdefault(cfg.adapter_of(agent), []).append(agent)
    for adapter, sharing in by_weights.items():
        lrs = {lr for a in sharing if (lr := cfg.agents[a].lr) is not None}
        if len(lrs) > 1:
            what = f"adapter {adapter!r} of model {model!r}" if adapter else f"model {model!r}"
            raise ConfigError(
                f"agents {sharing} share {what} but set different lr {sorted(lrs)}; "
                f"set models.{model}.lr instead"
            )


def _check_models(cfg: DrmasConfig) -> None:
    for name, model in cfg.models.items():
        if model.dtype:
            raise ConfigError(
                f"models.{name}.dtype={model.dtype!r} was replaced by models.{name}.precision: "
                "bf16-mixed (fp32 master weights, bf16 compute; what bfloat16 should have "
                "meant), bf16-pure (bf16 weights, what dtype=bfloat16 did) or fp32"
            )
        workflow = model.warmstart.workflow
        if workflow not in WARMSTART_WORKFLOWS and ":" not in workflow:
            raise ConfigError(
                f"models.{name}.warmstart.workflow={workflow!r}: expected one of "
                f"{list(WARMSTART_WORKFLOWS)} or a target package.module:SOURCE naming a "
                "TranscriptSource"
            )


def _check_counts(cfg: DrmasConfig) -> None:
    if cfg.val.every and cfg.val.n < cfg.val.k:
        raise ConfigError(f"val.n ({cfg.val.n}) must be >= val.k ({cfg.val.k})")
    if cfg.weights.join_timeout_s > cfg.weights.timeout_s:
        raise ConfigError(
            f"weights.join_timeout_s ({cfg.weights.join_timeout_s:g}) must be <= "
            f"weights.timeout_s ({cfg.weights.timeout_s:g}): members wait for the roll call "
            "within the group's timeout"
        )
    if cfg.group_size < 2 and cfg.algorithm.advantage.scope == "group":
        raise ConfigError("group_size must be >= 2 for group-relative advantages")
    if cfg.task.name in ("jsonl", "parquet") and not cfg.task.train_path:
        raise ConfigError(
            f"task.name={cfg.task.name} needs task.train_path=FILE (and optionally "
            "task.val_path=FILE for validation)"
        )


def _check_probe(cfg: DrmasConfig) -> None:
    p = cfg.probe
    scaled = {a: c for a, c in cfg.workflow.reward_scale.items() if c != 1.0}
    if p.rewards and scaled:
        raise ConfigError(
            f"probe.rewards draws synthetic scores and does not apply workflow.reward_scale "
            f"({scaled}): give each agent's [mean, std] on the scale you mean (multiplied by "
            "its c) and drop workflow.reward_scale, or drop probe.rewards to probe the "
            "team's real, scaled scores"
        )
    if p.rewards and set(p.rewards) != set(cfg.agents):
        raise ConfigError(
            f"probe.rewards must give [mean, std] for every agent {sorted(cfg.agents)}, "
            f"got {sorted(p.rewards)}"
        )
    for agent, (mean, std) in p.rewards.items():
        if not (math.isfinite(mean) and math.isfinite(std) and std >= 0):
            raise ConfigError(f"probe.rewards.{agent} must be [mean, std >= 0], got {[mean, std]}")
    if p.group_size == 1:
        raise ConfigError("probe.group_size must be 0 (the run's group_size) or >= 2")


def _check_one_distribution(cfg: DrmasConfig) -> None:
    """Training samples must come from the distribution the learner scores them under."""
    narrow = [("sampling", cfg.sampling.top_p)] + [
        (f"agents.{a}.sampling", cfg.sampling_of(a).top_p)
        for a, agent in cfg.agents.items()
        if agent.sampling.top_p is not None
    ]
    for a in cfg.agents:
        if cfg.sampling_of(a).temperature <= 0:
            key = (
                "sampling" if cfg.agents[a].sampling.temperature is None else f"agents.{a}.sampling"
            )
            raise ConfigError(
                f"{key}.temperature=0 (greedy) is refused for training: agent {a!r}'s samples "
                "would have no distribution for the learner to score them under (it divides "
                "the logits by the temperature). Set it above 0; validation keeps val.temperature"
            )
    for key, top_p in narrow:
        if top_p >= 1:
            continue
        raise ConfigError(
            f"{key}.top_p={top_p} < 1 is refused for training: the learner scores every "
            "token under the full tempered distribution softmax(logits / T), while a nucleus "
            "changes what the actors sample from and the engines disagree on the log-prob "
            "they report (vLLM renormalises over the nucleus, hf and SGLang give the one "
            "before the cut), so the behaviour log-probs, the importance weights and the "
            f"policy gradient would not match the policy sampled. Set {key}.top_p=1 "
            f"(lower {key}.temperature to sample more narrowly); validation keeps its own "
            "val.top_p"
        )


def _check_batch_scope(cfg: DrmasConfig) -> None:
    """scope=batch pools over one model's batch, so it needs one model (docs/algorithm.md,
    "Advantages")."""
    models = sorted({a.model for a in cfg.agents.values()})
    if cfg.algorithm.advantage.scope == "batch" and len(models) > 1:
        raise ConfigError(
            "algorithm.advantage.scope=batch pools the statistics over the groups of one "
            f"model's training batch, and the agents here train {len(models)} models "
            f"{models}: each model's batches hold different groups (a group in which none of "
            "a model's agents acted has no slice for it; staleness drops differ per model), "
            "so the pooled statistics would depend on which model serves which agent. Use "
            "scope=group (the default, exact for any assignment), or serve every agent from "
            "one model (agents.<name>.model the same; models.<m>.lora.rank > 0 for "
            "separate adapters on one base)"
        )


def _check_sigma_options(cfg: DrmasConfig) -> None:
    """agent_std_pool and std_floor change only what a mode divides by: set where they would
    do nothing, they are refused rather than silently ignored."""
    adv = cfg.algorithm.advantage
    pools = adv.agent_std_pool == "batch"
    if pools and (adv.mode not in ("agent", "agent_std") or not adv.norm_by_std):
        raise ConfigError(
            "algorithm.advantage.agent_std_pool=batch changes the per-agent standard "
            "deviation, which only modes agent and agent_std divide by (with norm_by_std="
            f"true); here mode={adv.mode}, norm_by_std={adv.norm_by_std}: drop it or use "
            "mode=agent"
        )
    if cfg.algorithm.zero_variance_by == "model" and not cfg.algorithm.skip_zero_variance:
        raise ConfigError(
            "algorithm.zero_variance_by=model says whose signal algorithm.skip_zero_variance "
            "looks at, and skip_zero_variance is off: set algorithm.skip_zero_variance=true "
            "too, or drop zero_variance_by"
        )
    if cfg.algorithm.zero_variance_by == "model" and (
        adv.mode in ("global", "step_global", "agent_std", "agent_shifted") or adv.scope == "batch"
    ):
        raise ConfigError(
            f"algorithm.zero_variance_by=model leaves out a model's slice when its own "
            "agents' scores tie in the group, which is safe only where such a slice's "
            "advantages are all zero: modes agent, agent_turn, agent_mean and agent_centred, "
            "centred by "
            f"each agent's own group mean. Under mode={adv.mode} (scope={adv.scope}) the "
            "centre is pooled with other agents' scores or over the batch, so the slice "
            "carries a signal and would be dropped: use zero_variance_by=group, or one of "
            "those modes"
        )
    if adv.std_floor > 0 and not adv.norm_by_std:
        raise ConfigError(
            f"algorithm.advantage.std_floor={adv.std_floor} floors the standard deviation "
            "that advantages are divided by, and norm_by_std=false divides by none: drop "
            "std_floor or set norm_by_std=true"
        )
