"""Per-step (role) rewards through the broker: a step is scored with its own Step.reward
(None: the episode's team reward) minus the invalid-action penalty; every advantage mode
normalises those scores over the whole group, whichever model serves which agent, and
equals an independent reference (tests/fixtures/advantage_reference.py); team-reward
groups give exactly the numbers of the code before per-step rewards; batch metrics,
transcripts and `drmas eval` report each agent's own rewards."""

from __future__ import annotations

import io
import math
import random
import typing
import zlib
from pathlib import Path

import numpy as np
import pytest

from drmas.broker.advantages import compute_advantages
from drmas.broker.buffers import (
    GroupSlice,
    ModelBuffer,
    batch_samples,
    batch_stats,
    split_group,
)
from drmas.broker.samples import SampleWriter, _print_record
from drmas.broker.scores import step_scores
from drmas.config.broker import AdvantageConfig
from drmas.config.types import AdvantageMode
from drmas.launch.eval_rewards import TaskResult, episode_rewards
from drmas.launch.evaluate import EvalSettings, format_table, score
from drmas.protocol import pack_ids, pack_logprobs
from drmas.protocol.messages import Episode, GroupResult, Step, Task, pack_group
from tests.fixtures.advantage_reference import reference_advantages

MODES = list(typing.get_args(AdvantageMode))  # every mode the config accepts
PENALTY = 0.1
ASSIGNMENTS = {
    "shared": {"verifier": "m", "searcher": "m", "answerer": "m"},
    "separate": {"verifier": "v", "searcher": "s", "answerer": "a"},
    "mixed": {"verifier": "m", "searcher": "s", "answerer": "m"},
}

# (agent, own reward or None, valid)
Call = tuple[str, float | None, bool]


def _step(agent: str, tag: int, reward: float | None, valid: bool) -> Step:
    """A step whose prompt carries a unique tag, to trace a sample back to its step."""
    return Step(agent, agent, pack_ids([tag]), pack_ids([3, 4]), pack_logprobs([-0.5, -0.5]),
                0, valid, "stop", reward)  # fmt: skip


def _group(group_id: int, episodes: list[tuple[list[Call], float]]) -> GroupResult:
    tag = iter(range(1000 * group_id, 1000 * group_id + 1000))
    return pack_group("actor", 1, group_id, [
        Episode([_step(a, next(tag), r, v) for a, r, v in calls], team) for calls, team in episodes
    ])  # fmt: skip


def _random_group(rng: random.Random, group_id: int, role: bool) -> GroupResult:
    """A search-like group of 5: the verifier, 0-2 searches (each followed by the verifier
    again: so the searcher is absent from some groups), the answerer. With `role`, most
    steps carry their own reward, on scales that differ by agent; some are left None."""
    scale = {"verifier": 1.0, "searcher": 0.3, "answerer": 2.0}

    def own(agent: str) -> float | None:
        if not role or rng.random() < 0.2:
            return None
        return scale[agent] * rng.choice([0.0, 0.5, 1.0]) + rng.choice([0.0, 0.25])

    episodes = []
    for _ in range(5):
        calls: list[Call] = [("verifier", own("verifier"), rng.random() > 0.1)]
        for _ in range(rng.randint(0, 2)):
            calls += [("searcher", own("searcher"), rng.random() > 0.2),
                      ("verifier", own("verifier"), True)]  # fmt: skip
        calls.append(("answerer", own("answerer"), rng.random() > 0.1))
        episodes.append((calls, float(rng.random() < 0.4)))
    return _group(group_id, episodes)


def _scores_by_hand(result: GroupResult) -> list[list[tuple[str, float]]]:
    """(agent, score) per step, per episode: own reward else team, minus the penalty."""
    return [
        [
            (h.agent, (e.reward if h.reward is None else h.reward) - (0.0 if h.valid else PENALTY))
            for h in e.steps
        ]
        for e in result.episodes
    ]


def _tag(prompt_ids: bytes | memoryview) -> int:
    return int(np.frombuffer(bytes(prompt_ids[:4]), "<i4")[0])


def _cut_every_model(
    groups: list[GroupResult], agent_models: dict[str, str], adv: AdvantageConfig
) -> dict[int, float]:
    """Every model's batch cut from all the groups (a model absent from a group has no
    slice of it): prompt tag -> the advantage the step trains with."""
    parts: dict[str, list[GroupSlice]] = {m: [] for m in set(agent_models.values())}
    for g, result in enumerate(groups):
        for model, part in split_group(g, None, result, agent_models, PENALTY).items():
            parts[model].append(part)
    out = {}
    for model, slices in parts.items():
        buffer = ModelBuffer(model, len(slices), 0, adv)
        for part in slices:
            buffer.add(part)
        batch = buffer.batch_for(0, 1)
        assert batch is not None
        for sample in batch.samples:
            out[_tag(sample.prompt_ids)] = sample.advantage
    return out


def _hand_group() -> GroupResult:
    """G = 3, a solver and a verifier, each once per episode:
    episode 0, R = 1: solver paid 1, verifier paid 1
    episode 1, R = 0: solver paid 0, verifier paid 1
    episode 2, R = 0: solver unpaid (team reward 0), verifier paid 0 but invalid (-0.1)"""
    return _group(0, [
        ([("solver", 1.0, True), ("verifier", 1.0, True)], 1.0),
        ([("solver", 0.0, True), ("verifier", 1.0, True)], 0.0),
        ([("solver", None, True), ("verifier", 0.0, False)], 0.0),
    ])  # fmt: skip


def test_a_step_is_scored_with_its_own_reward_else_the_team_reward() -> None:
    rewards, scores = step_scores(_hand_group().episodes, PENALTY)
    assert rewards == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert scores == [1.0, 1.0, 0.0, 1.0, 0.0, -0.1]


def test_dr_mas_by_hand_on_role_rewards() -> None:
    # Solver scores (1, 0, 0): μ = 1/3, unbiased σ = 1/√3, so A = (2, −1, −1)/√3.
    # Verifier scores (1, 1, −0.1): deviations (11, 11, −22)/30, σ = (11/30)·√3, A = (1, 1, −2)/√3.
    # GRPO (global): episode means (1, 0.5, −0.05) = (60, 30, −3)/60, μ = 29/60,
    # deviations (31, 1, −32)/60, σ = √993/60, so A = (31, 1, −32)/√993 for both steps.
    slices = split_group(0, None, _hand_group(), {"solver": "s", "verifier": "v"}, PENALTY)
    r3 = math.sqrt(3)
    agent = {m: [x.advantage for x in batch_samples([sl], AdvantageConfig())]
             for m, sl in slices.items()}  # fmt: skip
    np.testing.assert_allclose(agent["s"], [2 / r3, -1 / r3, -1 / r3], rtol=1e-5)
    np.testing.assert_allclose(agent["v"], [1 / r3, 1 / r3, -2 / r3], rtol=1e-5)
    grpo = [x.advantage for x in batch_samples([slices["v"]], AdvantageConfig(mode="global"))]
    np.testing.assert_allclose(grpo, np.array([31, 1, -32]) / math.sqrt(993), rtol=1e-5)
    # reward/<agent>/mean from the agent's own rewards: solver (1, 0, 0), verifier (1, 1, 0)
    samples = batch_samples([slices["v"]], AdvantageConfig())
    stats = batch_stats([slices["v"]], samples, 0)
    assert stats["reward/verifier/mean"] == pytest.approx(2 / 3)
    assert stats["score/verifier/mean"] == pytest.approx(1.9 / 3)
    samples = batch_samples([slices["s"]], AdvantageConfig())
    assert batch_stats([slices["s"]], samples, 0)["reward/solver/mean"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("assignment", sorted(ASSIGNMENTS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("std", ["unbiased", "population"])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_every_mode_equals_the_reference_over_whole_groups(
    assignment: str, mode: str, std: str, norm_by_std: bool
) -> None:
    rng = random.Random(zlib.crc32(f"{assignment} {mode} {std} {norm_by_std}".encode()))
    groups = [_random_group(rng, g, role=True) for g in range(6)]
    adv = AdvantageConfig(mode=mode, std=std, norm_by_std=norm_by_std)
    got = _cut_every_model(groups, ASSIGNMENTS[assignment], adv)
    expected = reference_advantages(
        [_scores_by_hand(r) for r in groups], mode, std=std, norm_by_std=norm_by_std
    )
    tags = [_tag(s.prompt_ids) for r in groups for e in r.unpack() for s in e.steps]
    want = [a for group in expected for episode in group for a in episode]
    assert sorted(got) == sorted(tags)  # every step trained once, by its agent's model
    np.testing.assert_allclose([got[t] for t in tags], want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_scope_batch_equals_the_reference_pooled_over_the_batch(mode: str) -> None:
    rng = random.Random(zlib.crc32(f"batch {mode}".encode()))
    groups = [_random_group(rng, g, role=True) for g in range(4)]
    got = _cut_every_model(groups, ASSIGNMENTS["shared"], AdvantageConfig(mode=mode, scope="batch"))
    expected = reference_advantages([_scores_by_hand(r) for r in groups], mode, scope="batch")
    tags = [_tag(s.prompt_ids) for r in groups for e in r.unpack() for s in e.steps]
    want = [a for group in expected for episode in group for a in episode]
    np.testing.assert_allclose([got[t] for t in tags], want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("std", ["unbiased", "population"])
def test_team_reward_groups_give_the_old_numbers_bit_for_bit(mode: str, std: str) -> None:
    rng = random.Random(zlib.crc32(f"team {mode} {std}".encode()))
    groups = [_random_group(rng, g, role=False) for g in range(5)]
    adv = AdvantageConfig(mode=mode, std=std)
    agent_models = ASSIGNMENTS["mixed"]
    # the code before per-step rewards: every step's reward is its episode's, score r or r − p
    old_rewards = [[e.reward for e in r.episodes for _ in e.steps] for r in groups]
    old_scores = [
        [e.reward if h.valid else e.reward - PENALTY for e in r.episodes for h in e.steps]
        for r in groups
    ]
    for r, rewards, scores in zip(groups, old_rewards, old_scores):
        columns = next(iter(split_group(0, None, r, agent_models, PENALTY).values())).group.columns
        assert columns.rewards == rewards and columns.scores == scores  # exact floats
    headers = [(g, e, h) for g, r in enumerate(groups) for e, ep in enumerate(r.episodes)
               for h in ep.steps]  # fmt: skip
    old = compute_advantages(
        [s for scores in old_scores for s in scores], [g for g, _, _ in headers],
        [e for _, e, _ in headers], [h.agent for _, _, h in headers], mode=mode, std=std,
    )  # fmt: skip
    tags = [_tag(s.prompt_ids) for r in groups for e in r.unpack() for s in e.steps]
    got = _cut_every_model(groups, agent_models, adv)
    assert [got[t] for t in tags] == old.tolist()  # bit for bit
    # the batch metrics: reward/<agent>/mean is the mean team reward of its steps, as before
    slices = [split_group(g, None, r, {a: "m" for a in agent_models}, PENALTY)["m"]
              for g, r in enumerate(groups)]  # fmt: skip
    stats = batch_stats(slices, batch_samples(slices, adv), 0)
    for agent in ("verifier", "answerer"):
        team = [e.reward for r in groups for e in r.episodes for h in e.steps if h.agent == agent]
        assert stats[f"reward/{agent}/mean"] == pytest.approx(np.mean(team), rel=1e-12)


def test_transcripts_show_each_steps_own_reward(tmp_path: Path) -> None:
    writer = SampleWriter(tmp_path / "samples.jsonl", {}, 1, 3, AdvantageConfig(), PENALTY)
    record = writer.record(1, Task("t", "1+1", "2"), _hand_group())
    steps = [st for ep in record["episodes"] for st in ep["steps"]]
    assert [ep["reward"] for ep in record["episodes"]] == [1.0, 0.0, 0.0]  # the team's
    assert [st["reward"] for st in steps] == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert [st["score"] for st in steps] == [1.0, 1.0, 0.0, 1.0, 0.0, -0.1]
    r3 = math.sqrt(3)
    np.testing.assert_allclose(
        [st["advantage"] for st in steps],
        [2 / r3, 1 / r3, -1 / r3, 1 / r3, -1 / r3, -2 / r3], rtol=1e-5,
    )  # fmt: skip
    out = io.StringIO()
    _print_record(record, out)
    text = out.getvalue()
    assert "episode 1 · team reward 0.00" in text
    assert "[verifier · verifier v0 · reward 1.00 · score 1.00 · advantage +0.58]" in text
    assert (
        "[verifier · verifier v0 · reward 0.00 · score -0.10 · advantage -1.15 · INVALID]" in text
    )


def _episode(team: float, calls: list[tuple[str, float | None]]) -> Episode:
    return Episode([_step(a, 0, r, True) for a, r in calls], team)


def test_eval_reports_each_agents_mean_step_reward_beside_the_team() -> None:
    t0, t1 = Task("t0", "q", "a", "s"), Task("t1", "q", "a", "s")
    by_task = [
        (t0, [_episode(1.0, [("solver", 1.0), ("verifier", 0.5)]),
              _episode(0.0, [("solver", 0.0), ("verifier", None)])]),  # verifier: team's 0
        (t1, [_episode(1.0, [("solver", 1.0), ("verifier", 1.0), ("verifier", 1.0)]),
              _episode(1.0, [("solver", 1.0), ("verifier", 0.5)])]),
    ]  # fmt: skip
    rows = [
        TaskResult(t, [e.reward for e in eps], [{} for _ in eps], [episode_rewards(e) for e in eps])
        for t, eps in by_task
    ]
    overall = score(rows, EvalSettings(k=1, n=2))["overall"]
    # solver: tasks (1 of 2, 2 of 2) -> 3/4; equal counts: se of the task means (0.5, 1) = 0.25
    assert overall["reward/solver"] == pytest.approx(0.75)
    assert overall["reward/solver/se"] == pytest.approx(0.25)
    # verifier: sums (0.5, 2.5) over counts (2, 3) -> 3/5; N̄ = 2.5,
    # d = ((0.5 − 1.2)/2.5, (2.5 − 1.8)/2.5) = (−0.28, 0.28), se = √(2·0.0784/2) = 0.28
    assert overall["reward/verifier"] == pytest.approx(0.6)
    assert overall["reward/verifier/se"] == pytest.approx(0.28)
    # success stays the team's: avg@1 = 3 of 4 team rewards >= 1
    assert overall["avg@1"] == pytest.approx(0.75) and overall["team_reward"] == pytest.approx(0.75)
    table = format_table({"settings": {"k": 1}, **score(rows, EvalSettings(k=1, n=2))})
    assert (
        "mean step reward per agent: solver 0.750 ± 0.250, verifier 0.600 ± 0.280; "
        "team reward 0.750 ± 0.250" in table
    )


# ------------------------------------------------------ workflow.reward_scale


def _advantages(mode: str, scale: dict[str, float] | None) -> dict[str, list[float]]:
    """Each model's advantages on the hand group, the verifier's scores scaled by `scale`."""
    slices = split_group(0, None, _hand_group(), {"solver": "s", "verifier": "v"}, PENALTY, scale)
    adv = AdvantageConfig(mode=mode)  # type: ignore[arg-type]
    return {m: [x.advantage for x in batch_samples([sl], adv)] for m, sl in slices.items()}


def test_reward_scale_multiplies_the_agents_scores_before_normalisation() -> None:
    """An agent paid in other units: its scores (reward and penalty) are scaled, its
    rewards stay the team's pay; the other agents' scores are untouched."""
    _, plain = step_scores(_hand_group().episodes, PENALTY)
    rewards, scaled = step_scores(_hand_group().episodes, PENALTY, {"verifier": 0.1})
    assert rewards == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    agents = ["solver", "verifier"] * 3
    expected = [x * (0.1 if a == "verifier" else 1.0) for x, a in zip(plain, agents)]
    assert scaled == pytest.approx(expected, abs=1e-15)
    assert scaled[5] == pytest.approx(-0.01)  # the verifier's penalty is in its units too
    slices = split_group(0, None, _hand_group(), {"solver": "s", "verifier": "v"}, PENALTY,
                         {"verifier": 0.1})  # fmt: skip
    assert slices["v"].columns.scores == pytest.approx([0.1, 0.1, -0.01])


def test_dr_mas_is_invariant_to_an_agents_reward_scale() -> None:
    """Mode agent divides the scaled scores by the agent's own (scaled) std: the
    verifier's advantages stay within 1e-4 (the ε in σ + ε is all that changes). Applied
    after normalisation instead, the scale would shrink them tenfold."""
    base, scaled = _advantages("agent", None), _advantages("agent", {"verifier": 0.1})
    np.testing.assert_allclose(scaled["v"], base["v"], atol=1e-4)
    np.testing.assert_allclose(scaled["s"], base["s"], atol=1e-12)
    assert max(abs(a) for a in base["v"]) > 0.5  # not a trivially zero case


@pytest.mark.parametrize("mode", ["global", "step_global", "agent_mean"])
def test_a_shared_baseline_is_not_invariant_to_a_reward_scale(mode: str) -> None:
    """A team baseline (global, step_global) or a team std (agent_mean) mixes the agents'
    units: scaling the verifier's pay changes the advantages."""
    base, scaled = _advantages(mode, None), _advantages(mode, {"verifier": 0.1})
    changed = max(abs(a - b) for m in base for a, b in zip(base[m], scaled[m]))
    assert changed > 0.05, (mode, base, scaled)


def test_reward_scale_names_agents_of_the_team() -> None:
    from drmas.config import ConfigError, load_config

    cfg = load_config(["workflow.reward_scale={verifier: 0.1}"])
    assert cfg.workflow.reward_scale == {"verifier": 0.1}
    with pytest.raises(ConfigError, match=r"workflow.reward_scale names \['critic'\]"):
        load_config(["workflow.reward_scale={critic: 0.1}"])
    with pytest.raises(ConfigError, match="reward_scale"):
        load_config(["workflow.reward_scale={verifier: 0}"])  # a factor must be > 0
