"""Splitting a group by model never changes an advantage: every model's batch carries the
numbers that `compute_advantages` gives over the WHOLE group (all agents, all models), in
every mode, for shared, non-shared and mixed model assignments, with agents that are
called only in some episodes (the search team's Search Agent) and with an agent absent from
whole groups (so its model's batches hold other groups than the rest's). scope=batch pools
whole groups where one model serves every agent; with more models it would depend on which
model serves which agent, and the config refuses it."""

from __future__ import annotations

import itertools
import math
import random
import typing
import zlib

import numpy as np
import pytest

from drmas.broker.advantages import compute_advantages
from drmas.broker.buffers import ModelBuffer, batch_samples, split_group
from drmas.config import ConfigError, load_config
from drmas.config.broker import AdvantageConfig
from drmas.config.types import AdvantageMode
from drmas.protocol import pack_ids, pack_logprobs
from drmas.protocol.messages import Episode, Step, pack_group

MODES = list(typing.get_args(AdvantageMode))  # every mode the config accepts


def _step(agent: str, tag: int, valid: bool = True) -> Step:
    # The prompt carries a unique tag, so a sample can be traced back to its step.
    return Step(
        agent=agent,
        model=agent,
        prompt_ids=pack_ids([tag, tag + 1]),
        response_ids=pack_ids([3, 4]),
        logprobs=pack_logprobs([-0.5, -0.5]),
        version=0,
        valid=valid,
        finish_reason="stop",
    )


def _group(group_id: int, episodes: list[tuple[list[tuple[str, bool]], float]], tag0: int):
    tag = itertools.count(tag0, 2)
    eps = [Episode([_step(a, next(tag), v) for a, v in calls], r) for calls, r in episodes]
    return pack_group("actor", 1, group_id, eps)


def test_search_agent_gets_the_whole_groups_grpo_baseline():
    # Non-shared search team, G = 5; the Search Agent (S) is called in episodes 2, 3 (twice), 5:
    #   [V A] R=1, [V S V A] R=1, [V S V S A] R=0, [V A] R=0, [V S V A] R=0 (all valid).
    # GRPO over the whole group: episode means (1, 1, 0, 0, 0), μ = 0.4,
    #   unbiased σ = sqrt((2·0.36 + 3·0.16)/4) = sqrt(0.3);
    #   R = 1 -> 0.6/sqrt(0.3) = 1.0954, R = 0 -> −0.4/sqrt(0.3) = −0.7303.
    # S's steps sit in episodes 2, 3, 3, 5: [1.0954, −0.7303, −0.7303, −0.7303]. Over S's own
    # slice (episode means of S's steps only: 1, 0, 0) it would be [1.155, −0.577, −0.577, −0.577].
    V, S, A = ("verifier", True), ("search", True), ("answer", True)
    result = _group(
        0,
        [
            ([V, A], 1.0),
            ([V, S, V, A], 1.0),
            ([V, S, V, S, A], 0.0),
            ([V, A], 0.0),
            ([V, S, V, A], 0.0),
        ],
        0,
    )
    models = {"verifier": "verifier", "search": "search", "answer": "answer"}
    slices = split_group(0, None, result, models, penalty=0.01)
    sigma = math.sqrt(0.3) + 1e-6
    expected = [0.6 / sigma, -0.4 / sigma, -0.4 / sigma, -0.4 / sigma]
    got = [s.advantage for s in batch_samples([slices["search"]], AdvantageConfig(mode="global"))]
    np.testing.assert_allclose(got, expected, rtol=1e-9)

    # step_global pools all 17 steps (score 1 for the 6 steps of episodes 1-2, 0 for 11):
    # μ_all = 6/17, unbiased σ_all² = (6·(11/17)² + 11·(6/17)²)/16 = 1122/4624, so an S step
    # gets (11/17)/σ_all = 1.3136 or −(6/17)/σ_all = −0.7165; agent-wise, S's own scores
    # (1, 0, 0, 0) give μ_S = 0.25, σ_S = 0.5 and 1.5 or −0.5.
    sigma_all = math.sqrt(1122 / 4624) + 1e-6
    step_global = AdvantageConfig(mode="step_global")
    got = [s.advantage for s in batch_samples([slices["search"]], step_global)]
    np.testing.assert_allclose(got, [11 / 17 / sigma_all] + [-6 / 17 / sigma_all] * 3, rtol=1e-9)
    agent = [s.advantage for s in batch_samples([slices["search"]], AdvantageConfig())]
    np.testing.assert_allclose(agent, [1.5, -0.5, -0.5, -0.5], rtol=1e-5)


def _random_group(rng: random.Random, group_id: int, size: int, tag0: int, searches: bool):
    """A search-like group: a router, then 0-2 searches (each followed by the router again),
    then an answerer. `searches`: the first episode searches at least once; else no episode
    does (the router answers every task directly), so a model that serves only the searcher
    has no slice of this group."""
    episodes = []
    for e in range(size):
        calls = [("router", rng.random() > 0.1)]
        for _ in range(rng.randint(1 if e == 0 else 0, 2) if searches else 0):
            calls += [("searcher", rng.random() > 0.2), ("router", True)]
        calls.append(("answerer", rng.random() > 0.1))
        episodes.append((calls, float(rng.random() < 0.4)))
    return _group(group_id, episodes, tag0)


ASSIGNMENTS = {
    "shared": {"router": "m", "searcher": "m", "answerer": "m"},
    "non-shared": {"router": "r", "searcher": "s", "answerer": "a"},
    "mixed": {"router": "r", "searcher": "m", "answerer": "m"},
}
SEARCHES = [False, True, True, False, True, True]  # the searcher is absent from groups 0, 3
B = 2  # groups per batch: models r, a, m cut groups (0, 1) (2, 3) (4, 5); model s (1, 2) (4, 5)
# scope=batch only where one model serves every agent: with more, the models' batches hold
# different groups and the config refuses it (test_batch_scope_would_depend_on_the_models).
CASES = [(a, "group") for a in sorted(ASSIGNMENTS)] + [("shared", "batch")]


def _tags(result) -> list[int]:
    """The prompt tag of every step of a group, episode by episode."""
    lengths = [4 * h.prompt_len for ep in result.episodes for h in ep.steps]
    return [
        int(np.frombuffer(bytes(result.prompt_ids[p0 : p0 + 4]), "<i4")[0])
        for p0 in np.cumsum([0, *lengths])[:-1]
    ]


def _trained(buffers: dict[str, ModelBuffer]) -> dict[int, tuple[str, float]]:
    """Prompt tag -> (model, advantage) of every sample of every batch the buffers can cut."""
    out: dict[int, tuple[str, float]] = {}
    for model, buf in buffers.items():
        version = 0
        while (batch := buf.batch_for(version, 1)) is not None:
            for sample in batch.samples:
                tag = int(np.frombuffer(sample.prompt_ids[:4], "<i4")[0])
                assert tag not in out, f"step {tag} trained twice"
                out[tag] = (model, sample.advantage)
            version += 1
        assert not buf.slices, f"{model}: {len(buf.slices)} slices left over"
    return out


@pytest.mark.parametrize(("assignment", "scope"), CASES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("std", ["unbiased", "population"])
@pytest.mark.parametrize("seed", range(3))
def test_every_models_batch_equals_whole_group_advantages(assignment, mode, scope, std, seed):
    rng = random.Random(zlib.crc32(f"{assignment} {mode} {scope} {std} {seed}".encode()))
    agent_models = ASSIGNMENTS[assignment]
    adv = AdvantageConfig(mode=mode, scope=scope, std=std)
    penalty = 0.1
    groups = [_random_group(rng, g, 5, 1000 * g, s) for g, s in enumerate(SEARCHES)]

    # Expected: compute_advantages over every step of whole groups (one call for scope=group;
    # for scope=batch one per batch of B consecutive groups), read off by prompt tag.
    by_tag: dict[int, float] = {}
    chunks = [range(len(groups))] if scope == "group" else [range(b, b + B) for b in (0, 2, 4)]
    for chunk in chunks:
        headers = [
            (g, e, h) for g in chunk for e, ep in enumerate(groups[g].episodes) for h in ep.steps
        ]
        scores = [groups[g].episodes[e].reward - (0 if h.valid else penalty) for g, e, h in headers]
        expected = compute_advantages(
            scores,
            [g for g, _, _ in headers],
            [e for _, e, _ in headers],
            [h.agent for _, _, h in headers],
            mode=mode,
            scope=scope,
            std=std,
        )
        by_tag.update(zip([t for g in chunk for t in _tags(groups[g])], expected.tolist()))

    buffers = {m: ModelBuffer(m, B, 0, adv) for m in set(agent_models.values())}
    for g, result in enumerate(groups):
        for model, part in split_group(g, None, result, agent_models, penalty).items():
            buffers[model].add(part)
    trained = _trained(buffers)
    assert trained.keys() == by_tag.keys()  # every step trained once, by its agent's model
    for tag, (model, advantage) in trained.items():
        assert advantage == pytest.approx(by_tag[tag], rel=1e-9, abs=1e-12), f"{model}: {tag}"
    searcher_groups = {t // 1000 for t, (m, _) in trained.items() if m == agent_models["searcher"]}
    if assignment == "non-shared":  # the searcher's model never saw groups 0 and 3
        assert searcher_groups == {1, 2, 4, 5}


def _by_agent(buffers: dict[str, ModelBuffer], tags: dict[int, str]) -> dict[str, float]:
    return {tags[t]: a for t, (_, a) in _trained(buffers).items() if t in tags}


def test_batch_scope_would_depend_on_the_models():
    """scope=batch on a team where the Search Agent is absent from group 0 (G = 2, B = 2,
    mode global, every step valid, so an episode's mean score is its reward R):
      group 0: [V A] R=1, [V A] R=0
      group 1: [V S V A] R=1, [V A] R=0
      group 2: [V S V A] R=1, [V S V A] R=1
    One model for all three: its first batch is groups 0, 1 whole; episode means (1, 0, 1, 0)
    give μ = 0.5, unbiased σ = sqrt(1/3), so every step of group 1's first episode gets
    0.5/sqrt(1/3) = 0.8660 -- S's step like V's. One model per agent: V's and A's first
    batch is groups 0, 1 (0.8660 again), but S has no slice of group 0, so its first batch is
    groups 1, 2: means (1, 0, 1, 1), μ = 0.75, σ = sqrt((3·0.0625 + 0.5625)/3) = 0.5, and S's
    step gets (1 − 0.75)/0.5 = 0.5. GRPO gives every step of an episode one advantage, so
    the split changed the algorithm: the config refuses scope=batch with more than one
    model. scope=group gives 0.5/sqrt(0.5) = 0.7071 to all three either way."""
    V, S, A = ("verifier", True), ("search", True), ("answer", True)
    episodes = [
        [([V, A], 1.0), ([V, A], 0.0)],
        [([V, S, V, A], 1.0), ([V, A], 0.0)],
        [([V, S, V, A], 1.0), ([V, S, V, A], 1.0)],
    ]
    groups = [_group(g, eps, 1000 * g) for g, eps in enumerate(episodes)]
    # group 1, first episode [V S V A]: its four steps' tags, in order
    first = dict(zip(_tags(groups[1])[:4], ["V1", "S", "V2", "A"]))
    names = ("verifier", "search", "answer")
    teams = {"one model": dict.fromkeys(names, "m"), "per agent": {a: a for a in names}}

    def advantages(team: str, scope: str) -> dict[str, float]:
        adv = AdvantageConfig(mode="global", scope=scope)
        buffers = {m: ModelBuffer(m, B, 0, adv) for m in set(teams[team].values())}
        for g, result in enumerate(groups):
            for model, part in split_group(g, None, result, teams[team], 0.0).items():
                buffers[model].add(part)
        for buf in buffers.values():  # each model's first batch only: its first B slices
            while len(buf.slices) > B:
                buf.slices.pop()
        return _by_agent(buffers, first)

    team_value = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert advantages("one model", "batch") == pytest.approx(
        dict.fromkeys(first.values(), team_value)
    )
    split = advantages("per agent", "batch")
    assert split == pytest.approx(
        {"V1": team_value, "V2": team_value, "A": team_value, "S": 0.25 / (0.5 + 1e-6)}
    )
    for team in teams:
        group_value = 0.5 / (math.sqrt(0.5) + 1e-6)
        assert advantages(team, "group") == pytest.approx(
            dict.fromkeys(first.values(), group_value)
        )

    scope = "algorithm.advantage.scope=batch"
    with pytest.raises(
        ConfigError, match=r"scope=batch pools .* 2 models \['solver', 'verifier'\]"
    ):
        load_config([scope])  # tiny_math: one model per agent
    assert load_config(["experiment=tiny_math_shared", scope]).algorithm.advantage.scope == "batch"
    lora = ["experiment=tiny_math_shared", "models.policy.lora.rank=8", scope]
    assert load_config(lora).algorithm.advantage.scope == "batch"  # adapters on one base
