"""`drmas probe`: the Dr. MAS Lemma 4.2 measured with the team's own actors and learner.

    drmas probe [overrides] [--config RUN/config.yaml]
        probe.rewards='{solver: [0, 3], verifier: [1, 0.3]}'   synthetic scores (optional)
        probe.groups=64 probe.group_size=8 probe.seed=0

One process, no broker: the actor's workflow and engines (actor.engine, frozen weights)
sample `probe.groups` groups of training tasks; every step is scored (synthetic: a normal
draw per step from its agent's [mean, std], independent of the actions, where the lemma is
exact; sampled: the step's score as the broker computes it, drmas/broker/scores.py: its own
Step.reward where the team sets one, else the episode's team reward, minus the
invalid-action penalty); advantages are computed over each whole group under `agent` and
each baseline; and a world-1 learner (the FSDP2 Trainer of each model, gloo on CPU) takes,
per agent and group, every step's gradient norm and the gradient under each mode
(drmas/learners/probe.py: predicted factor, measured ratio and their agreement). Writes
RUN_DIR/probe.json and RUN_DIR/probe.png.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from drmas.broker.advantages import compute_advantages
from drmas.broker.sampling import lease_sampling
from drmas.broker.scores import step_scores as broker_step_scores
from drmas.config import DrmasConfig
from drmas.launch.train import prepare_run
from drmas.protocol.messages import Episode, Sample, Step, Task
from drmas.threads import env_threads
from drmas.transports.ports import free_port

if TYPE_CHECKING:
    from drmas.config.types import AdvantageMode
    from drmas.learners.probe import AgentRows
    from drmas.learners.trainer import Trainer

log = logging.getLogger("drmas.probe")

PerMode = dict[str, dict[str, dict[str, float]]]
"""agent -> advantage mode -> named numbers."""


def run_probe(cfg: DrmasConfig) -> int:
    """The command: resolve the run (models built, config.yaml written), measure, then
    write RUN_DIR/probe.json and probe.png and print the table."""
    import torch

    torch.set_num_threads(env_threads() or 1)
    cfg, run_dir, _ = prepare_run(cfg)
    result = measure(cfg)
    (run_dir / "probe.json").write_text(json.dumps(result, indent=2))
    plot(result, run_dir / "probe.png")
    print(format_table(result))
    print(f"drmas probe: wrote {run_dir / 'probe.json'} and {run_dir / 'probe.png'}")
    return 0


def measure(cfg: DrmasConfig) -> dict[str, Any]:
    """Sample `probe.groups` groups with the actor's workflow, score them and measure each
    agent's gradient second moment under `agent` and each baseline: probe.json's content."""
    from drmas.learners.probe import summarise

    p = cfg.probe
    size = p.group_size or cfg.group_size
    start = time.monotonic()
    groups = asyncio.run(sample_groups(cfg, p.groups, size, p.seed))
    sampled_s = time.monotonic() - start
    log.info("sampled %d groups of %d episodes in %.1fs", len(groups), size, sampled_s)
    rows, scores_by_agent, credit, offsets = measure_gradients(cfg, groups)
    return {
        "mode": "synthetic" if p.rewards else "sampled",
        "agents": summarise(rows, p.baselines, p.bootstrap, p.seed),
        "credit": credit,
        "offsets": offsets,
        "scores": {
            a: {"mean": float(np.mean(v)), "std": float(np.std(v)), "steps": len(v)}
            for a, v in scores_by_agent.items()
            if v
        },
        "rewards": {a: list(v) for a, v in p.rewards.items()},
        # Steps scored with their own Step.reward (a team's role rewards; 0 = team rewards).
        "own_reward_steps": sum(s.reward is not None for g in groups for e in g for s in e.steps),
        "groups": len(groups),
        "group_size": size,
        "seed": p.seed,
        "advantage": dataclasses.asdict(cfg.algorithm.advantage),
        "models": {a: cfg.model_of(a) for a in cfg.agents},
        "sampled_s": sampled_s,
        "wall_s": time.monotonic() - start,
    }


def measure_gradients(
    cfg: DrmasConfig, groups: list[list[Episode]]
) -> tuple[dict[str, AgentRows], dict[str, list[float]], PerMode, PerMode]:
    """A world-1 learner (one Trainer per model) measures every agent's gradient moments in
    every group under each advantage mode. Returns the rows of the agents that acted, every
    agent's step scores, each agent's own r^2 under each mode (credit_shares) and its
    advantages' mean and spread (advantage_offsets)."""
    import torch.distributed as dist

    from drmas.learners.main import learner_device
    from drmas.learners.probe import AgentRows
    from drmas.learners.trainer import Trainer

    rng = np.random.default_rng(cfg.probe.seed)
    scores = [step_scores(cfg, episodes, rng) for episodes in groups]
    advantages = probe_advantages(cfg, groups, scores)
    step_agents = [[s.agent for ep in episodes for s in ep.steps] for episodes in groups]
    credit = credit_shares(step_agents, scores, advantages)
    offsets = advantage_offsets(step_agents, advantages)
    device = learner_device(cfg.learner.device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    try:
        trainers = {m: Trainer(cfg, m, 0, 1, device) for m in sorted(cfg.models)}
        rows: dict[str, AgentRows] = {a: AgentRows() for a in cfg.agents}
        scores_by_agent: dict[str, list[float]] = {a: [] for a in cfg.agents}
        for episodes, group_scores, adv in zip(groups, scores, advantages):
            _measure_group(cfg, trainers, episodes, group_scores, adv, rows, scores_by_agent)
    finally:
        dist.destroy_process_group()
    return {a: r for a, r in rows.items() if r.steps}, scores_by_agent, credit, offsets


def advantage_offsets(
    step_agents: list[list[str]], advantages: list[dict[str, np.ndarray]]
) -> PerMode:
    """agent -> mode -> the mean of its advantages over all its steps (`mean`: the offset a
    shared baseline gives an agent whose scores sit above or below the team's, about
    (mu_k - mu)/sigma; 0 under `agent` by construction), their standard deviation (`sd`: the
    rescaling), their second moment `sq` = mean^2 + sd^2 (the predicted factor is a ratio of
    these) and `offset_share` = mean^2 / sq, the part of the second moment that is offset.
    Adam does not divide out an offset that is the same at every step as it does a scale."""
    names = np.concatenate([np.asarray(a) for a in step_agents]) if step_agents else np.zeros(0)
    out: PerMode = {}
    for mode in advantages[0] if advantages else ():
        flat = np.concatenate([by_mode[mode] for by_mode in advantages]).astype(np.float64)
        for agent in dict.fromkeys(names.tolist()):
            a = flat[names == agent]
            mean, sd = float(a.mean()), float(a.std())
            sq = mean * mean + sd * sd
            out.setdefault(agent, {})[mode] = {
                "mean": mean, "sd": sd, "sq": sq,
                "offset_share": mean * mean / sq if sq > 0 else 0.0, "steps": int(a.size),
            }  # fmt: skip
    return out


def credit_shares(
    step_agents: list[list[str]], scores: list[np.ndarray], advantages: list[dict[str, np.ndarray]]
) -> PerMode:
    """agent -> mode -> `own_r2`: the squared correlation, within a group, between the
    agent's advantages and its own scores, averaged over the groups where it has at least
    2 steps whose scores vary (`groups` counts them). 1: in every group its advantages are
    one affine function of its own scores, so a mode differs from `agent` only by a
    rescaling and a shift (Lemma 4.2's F_k). Below 1: they are not, whatever the cause:
    other agents' scores (`global` gives every step of an episode the episode's mean
    score) or a split of the agent's own steps (`agent_turn` normalises each turn apart).
    It is not the share of the advantage that comes from the agent's own scores. An
    advantage that does not vary where the agent's scores do counts 0."""
    sums: dict[str, dict[str, list[float]]] = {}
    for agents, group_scores, by_mode in zip(step_agents, scores, advantages):
        names = np.asarray(agents)
        for agent in dict.fromkeys(agents):
            own = group_scores[names == agent]
            if own.size < 2 or np.ptp(own) == 0:
                continue
            for mode, adv in by_mode.items():
                a = adv[names == agent]
                cov = float(np.mean((a - a.mean()) * (own - own.mean())))
                var = float(np.var(a)) * float(np.var(own))
                r2 = cov * cov / var if var > 0 else 0.0
                sums.setdefault(agent, {}).setdefault(mode, []).append(min(r2, 1.0))
    return {
        agent: {m: {"own_r2": float(np.mean(v)), "groups": len(v)} for m, v in by_mode.items()}
        for agent, by_mode in sums.items()
    }


def probe_advantages(
    cfg: DrmasConfig, groups: list[list[Episode]], scores: list[np.ndarray]
) -> list[dict[str, np.ndarray]]:
    """Per group, mode -> the advantage of each of its steps (episode by episode), under
    `agent` and each baseline, computed as the broker's batch cut computes them for a batch
    made of these groups: whole groups, with the run's std, eps, norm_by_std, scope,
    agent_std_pool and std_floor (algorithm.advantage)."""
    a = cfg.algorithm.advantage
    modes: list[AdvantageMode] = ["agent", *cfg.probe.baselines]
    sizes = [len(s) for s in scores]
    group_ids = np.repeat(np.arange(len(groups)), sizes)
    episode_ids = [e for episodes in groups for e, ep in enumerate(episodes) for _ in ep.steps]
    agents = [s.agent for episodes in groups for ep in episodes for s in ep.steps]
    flat = np.concatenate(scores) if scores else np.zeros(0)
    by_mode = {
        m: compute_advantages(
            flat,
            group_ids,
            episode_ids,
            agents,
            mode=m,
            norm_by_std=a.norm_by_std,
            eps=a.eps,
            std=a.std,
            scope=a.scope,
            agent_std_pool=a.agent_std_pool,
            std_floor=a.std_floor,
        )
        for m in modes
    }
    bounds = np.cumsum([0, *sizes])
    return [{m: v[lo:hi] for m, v in by_mode.items()} for lo, hi in itertools.pairwise(bounds)]


def _measure_group(
    cfg: DrmasConfig,
    trainers: dict[str, Trainer],
    episodes: list[Episode],
    scores: np.ndarray,
    adv: dict[str, np.ndarray],
    rows: dict[str, AgentRows],
    scores_by_agent: dict[str, list[float]],
) -> None:
    """One group: each agent's gradient moments on its own steps under each mode's
    advantages (added to `rows`), and its scores."""
    from drmas.learners.probe import TrainerGradients, group_moments

    steps = [s for ep in episodes for s in ep.steps]
    for agent in cfg.agents:
        idx = [i for i, s in enumerate(steps) if s.agent == agent]
        if not idx:
            continue  # an agent this group never called (the Search Agent)
        grads = TrainerGradients(trainers[cfg.model_of(agent)], [_sample(steps[i]) for i in idx])
        rows[agent].add(group_moments(grads, {m: v[idx] for m, v in adv.items()}), len(idx))
        scores_by_agent[agent] += [float(scores[i]) for i in idx]


async def sample_groups(cfg: DrmasConfig, count: int, size: int, seed: int) -> list[list[Episode]]:
    """`count` groups of `size` episodes on training tasks drawn with `seed`, by the actor's
    workflow over engines holding the models' current (frozen) weights."""
    from drmas.actors.engines import make_engine
    from drmas.actors.main import engine_adapters, make_workflow
    from drmas.tasks.source import TaskSource

    engines = {}
    for model in sorted(cfg.models):
        pool = cfg.actor.engine_of(model)
        engine = make_engine(
            model,
            cfg.models[model].path,
            dataclasses.replace(pool, seed=pool.seed + seed),
            **engine_adapters(cfg, model),  # a LoRA base: its adapters as they start
        )
        await engine.start()
        engines[model] = engine
    workflow = make_workflow(
        cfg,
        {a: cfg.model_of(a) for a in cfg.agents},
        dict(engines),
        {m: e.tokenizer for m, e in engines.items()},
    )
    source = TaskSource(cfg.task)
    pick = random.Random(f"drmas.probe:{seed}")
    tasks: list[Task] = [pick.choice(source.train) for _ in range(count)]
    sampling = lease_sampling(cfg, validation=False)
    limit = asyncio.Semaphore(max(1, cfg.actor.max_groups))

    async def one(task: Task) -> list[Episode]:
        async with limit:
            return await workflow.run_group(task, sampling, size)

    try:
        return list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        await workflow.close()
        for engine in engines.values():
            await engine.close()


def step_scores(cfg: DrmasConfig, episodes: list[Episode], rng: np.random.Generator) -> np.ndarray:
    """One score per step (episode by episode): synthetic draws from the agent's [mean, std],
    or the step's score as the broker computes it (its own Step.reward where the team set
    one, else the episode's team reward; minus the penalty of an invalid action)."""
    rewards = cfg.probe.rewards
    if not rewards:
        _, scores = broker_step_scores(
            episodes, cfg.algorithm.invalid_action_penalty, cfg.workflow.reward_scale
        )
        return np.asarray(scores, dtype=np.float64)
    params = [rewards[s.agent] for e in episodes for s in e.steps]  # [mean, std] per step
    return np.asarray([rng.normal(mean, std) for mean, std in params], dtype=np.float64)


def _sample(step: Step) -> Sample:
    return Sample(step.agent, step.prompt_ids, step.response_ids, step.logprobs, 0.0, step.version)


def format_table(result: dict[str, Any]) -> str:
    """The printed summary: per agent and baseline, the factor from the scores, the measured
    per-step ratio, their agreement and the batch ratio (each with its 95 % interval)."""
    lines = [
        f"Lemma 4.2 probe ({result['mode']}, {result['groups']} groups of "
        f"{result['group_size']}): E[A^2 |grad log pi|^2] under a baseline / under agent-wise",
        f"{'agent':<12}{'baseline':<13}{'predicted':>10}  {'measured [95% CI]':<22}"
        f"{'measured/predicted':<22}{'batch ratio':<22}eff. steps",
    ]

    def cell(r: dict[str, Any], key: str, ci: str) -> str:
        return f"{r[key]:.3f} [{r[ci][0]:.3f}, {r[ci][1]:.3f}]".ljust(22)

    for agent, by_base in result["agents"].items():
        for base, r in by_base.items():
            lines.append(
                f"{agent:<12}{base:<13}{r['predicted_factor']:>10.3f}  "
                + cell(r, "measured_ratio", "ci95")
                + cell(r, "agreement", "agreement_ci95")
                + cell(r, "batch_ratio", "batch_ci95")
                + f"{r['effective_steps']:.0f}/{r['n_steps']}"
            )
    credit = result.get("credit", {})
    if credit:
        modes = list(next(iter(credit.values())))
        lines += [
            "own r^2: are an agent's advantages one affine function of its own scores? (r^2 "
            "within a group, mean over groups; 1 = yes, a rescaling and shift of `agent`; < 1 = "
            "no: others' scores mixed in, or its turns normalised apart)",
            f"{'agent':<12}" + "".join(f"{m:>13}" for m in modes) + "   groups",
        ]
        for agent, by_mode in credit.items():
            cells = "".join(f"{by_mode[m]['own_r2']:>13.3f}" for m in modes if m in by_mode)
            lines.append(f"{agent:<12}{cells}   {next(iter(by_mode.values()))['groups']}")
    offsets = result.get("offsets", {})
    if offsets:
        modes = list(next(iter(offsets.values())))
        lines += [
            "advantage mean (sd) over an agent's steps: a shared baseline's offset and scale",
            f"{'agent':<12}" + "".join(f"{m:>16}" for m in modes),
        ]
        for agent, by_mode in offsets.items():
            cells = "".join(
                f"{by_mode[m]['mean']:>+8.3f} ({by_mode[m]['sd']:.2f})"
                for m in modes
                if m in by_mode
            )
            lines.append(f"{agent:<12}{cells}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """One panel per baseline: predicted factor and measured ratio (with its 95 % CI) per
    agent, on a log axis with the agent-wise level 1 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agents = list(result["agents"])
    baselines = list(next(iter(result["agents"].values()))) if agents else []
    fig, axes = plt.subplots(
        1, max(1, len(baselines)), figsize=(4.5 * max(1, len(baselines)), 3.8), squeeze=False
    )
    x = np.arange(len(agents))
    for ax, base in zip(axes[0], baselines):
        rows = [result["agents"][a][base] for a in agents]
        predicted = [r["predicted_factor"] for r in rows]
        measured = [r["measured_ratio"] for r in rows]
        err = np.array(
            [[m - r["ci95"][0], r["ci95"][1] - m] for m, r in zip(measured, rows)]
        ).T.reshape(2, -1)
        ax.bar(x - 0.2, predicted, 0.4, label="predicted F_k")
        ax.bar(x + 0.2, measured, 0.4, yerr=err, capsize=4, label="measured per step (95% CI)")
        ax.plot(x + 0.2, [r["batch_ratio"] for r in rows], "kx", label="batch gradient ratio")
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_yscale("log")
        ax.set_xticks(x, agents)
        ax.set_xlabel("agent")
        ax.set_ylabel("E[A^2 |h|^2] ratio to agent-wise")
        ax.set_title(f"{base} baseline ({result['mode']})")
        ax.legend(fontsize=8)
    fig.suptitle(f"Lemma 4.2 probe: {result['groups']} groups of {result['group_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
