"""Splitting a group by model never changes an advantage: every model's batch carries the
numbers that `compute_advantages` gives over the WHOLE group (all agents, all models), in
every mode, for shared, non-shared and mixed model assignments, and with agents that are
called only in some episodes (the search team's Search Agent)."""

from __future__ import annotations

import itertools
import math
import random
import zlib

import numpy as np
import pytest

from drmas.broker.advantages import compute_advantages
from drmas.broker.buffers import ModelBuffer, batch_samples, split_group
from drmas.config.broker import AdvantageConfig
from drmas.protocol import pack_ids, pack_logprobs
from drmas.protocol.messages import Episode, Step, pack_group

MODES = ["global", "agent", "agent_mean", "agent_std", "step_global"]


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


def _random_group(rng: random.Random, group_id: int, size: int, tag0: int):
    """A search-like group: a router, then conditionally a searcher, then an answerer. The
    first episode searches at least once, so every model has a slice of every group (and
    scope=batch pools the same groups for every model)."""
    episodes = []
    for e in range(size):
        calls = [("router", rng.random() > 0.1)]
        for _ in range(
            rng.randint(1 if e == 0 else 0, 2)
        ):  # 0-2 searches, each followed by the router again
            calls += [("searcher", rng.random() > 0.2), ("router", True)]
        calls.append(("answerer", rng.random() > 0.1))
        episodes.append((calls, float(rng.random() < 0.4)))
    return _group(group_id, episodes, tag0)


ASSIGNMENTS = {
    "shared": {"router": "m", "searcher": "m", "answerer": "m"},
    "non-shared": {"router": "r", "searcher": "s", "answerer": "a"},
    "mixed": {"router": "r", "searcher": "m", "answerer": "m"},
}


@pytest.mark.parametrize("assignment", sorted(ASSIGNMENTS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scope", ["group", "batch"])
@pytest.mark.parametrize("std", ["unbiased", "population"])
@pytest.mark.parametrize("seed", range(3))
def test_every_models_batch_equals_whole_group_advantages(assignment, mode, scope, std, seed):
    rng = random.Random(zlib.crc32(f"{assignment} {mode} {scope} {std} {seed}".encode()))
    agent_models = ASSIGNMENTS[assignment]
    adv = AdvantageConfig(mode=mode, scope=scope, std=std)
    penalty = 0.1
    groups = [_random_group(rng, g, 5, 1000 * g) for g in range(4)]

    # Expected: one call over every step of the 4 whole groups, then read off by prompt tag.
    headers = [
        (g, e, h) for g, r in enumerate(groups) for e, ep in enumerate(r.episodes) for h in ep.steps
    ]
    scores = [groups[g].episodes[e].reward - (0.0 if h.valid else penalty) for g, e, h in headers]
    expected = compute_advantages(
        scores,
        [g for g, _, _ in headers],
        [e for _, e, _ in headers],
        [h.agent for _, _, h in headers],
        mode=mode,
        scope=scope,
        std=std,
    )
    tags = [
        int(np.frombuffer(bytes(r.prompt_ids[p0 : p0 + 4]), "<i4")[0])
        for r in groups
        for p0 in np.cumsum([0] + [4 * h.prompt_len for ep in r.episodes for h in ep.steps])[:-1]
    ]
    by_tag = dict(zip(tags, expected))

    buffers = {m: ModelBuffer(m, len(groups), 0, adv) for m in set(agent_models.values())}
    for g, result in enumerate(groups):
        for model, part in split_group(g, None, result, agent_models, penalty).items():
            buffers[model].add(part)
    seen = 0
    for model, buf in buffers.items():
        batch = buf.batch_for(0, 1)
        assert batch is not None
        for sample in batch.samples:
            tag = int(np.frombuffer(sample.prompt_ids[:4], "<i4")[0])
            assert sample.advantage == pytest.approx(by_tag[tag], rel=1e-9, abs=1e-12), (
                f"{model}: step {tag} of agent {sample.agent}"
            )
            seen += 1
    assert seen == len(headers)  # every step trained once, by its agent's model
