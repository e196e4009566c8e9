"""How a rank's shard becomes the batch's optimizer updates (drmas/learners/updates.py), in
a one-rank gloo group: samples dealt i mod M, each update's loss normaliser counting real
samples and tokens only (never padding copies), an update with no real sample left out,
and every agent's micro-batches planned in agent order."""

from __future__ import annotations

import torch

from drmas.config.learner import LearnerConfig
from drmas.learners.updates import deal
from drmas.protocol.arrays import pack_ids, pack_logprobs, unpack_ids
from drmas.protocol.messages import BatchShard, Sample

PAD = 0
AGENTS = ["solver", "verifier"]


def _sample(agent: str, first: int, response_len: int) -> Sample:
    """A sample whose prompt's first token (`first`) names it."""
    response = list(range(50, 50 + response_len))
    return Sample(
        agent,
        pack_ids([first, 1]),
        pack_ids(response),
        pack_logprobs([-0.5] * response_len),
        1.0,
        0,
    )


def _shard(samples: list[Sample], weights: list[float]) -> BatchShard:
    tokens = sum(len(unpack_ids(s.response_ids)) for s, w in zip(samples, weights) if w)
    return BatchShard("m", 0, 0, 1, samples, weights, sum(1 for w in weights if w), tokens)


def _firsts(mini_plan: dict, agent: str) -> list[int]:
    """The prompts' first tokens of `agent`'s real rows, micro-batch by micro-batch."""
    return [
        int(row[0])
        for mb in mini_plan[agent]
        for row, real in zip(mb.input_ids, mb.mask.sum(dim=1))
        if real > 0
    ]


def test_one_update_keeps_the_batch_totals_and_plans_each_agent(group: None) -> None:
    samples = [_sample("solver", 10, 3), _sample("verifier", 11, 2), _sample("solver", 12, 1)]
    shard = _shard(samples, [1.0, 1.0, 1.0])
    (mini,) = deal(shard, AGENTS, LearnerConfig(micro_batch_size=1), PAD, torch.device("cpu"))
    assert (mini.tokens, mini.samples) == (6, 3)
    assert [len(mini.plan[a]) for a in AGENTS] == [2, 1]
    assert _firsts(mini.plan, "solver") == [10, 12]
    assert _firsts(mini.plan, "verifier") == [11]
    assert mini.old_logprobs == {}


def test_samples_are_dealt_i_mod_m_and_each_update_counts_its_own_real_work(
    group: None,
) -> None:
    # five samples into two updates: rows 0, 2, 4 and rows 1, 3; row 3 is a padding copy
    samples = [_sample(a, 10 + i, n) for i, (a, n) in enumerate(
        [("solver", 4), ("verifier", 3), ("solver", 2), ("solver", 5), ("verifier", 1)]
    )]  # fmt: skip
    shard = _shard(samples, [1.0, 1.0, 1.0, 0.0, 1.0])
    cfg = LearnerConfig(ppo_minibatches=2, micro_batch_size=4)
    first, second = deal(shard, AGENTS, cfg, PAD, torch.device("cpu"))
    assert (first.tokens, first.samples) == (4 + 2 + 1, 3)
    assert (second.tokens, second.samples) == (3, 1)  # the padding copy counts nothing
    assert _firsts(first.plan, "solver") == [10, 12]
    assert _firsts(first.plan, "verifier") == [14]
    assert _firsts(second.plan, "verifier") == [11]
    # the padding copy keeps its row (so every rank runs the same calls) with no mask
    assert _firsts(second.plan, "solver") == []
    assert [int(r[0]) for mb in second.plan["solver"] for r in mb.input_ids] == [13]


def test_an_update_with_only_padding_copies_is_left_out(group: None) -> None:
    samples = [_sample("solver", 10, 2), _sample("solver", 11, 2)]
    shard = _shard(samples, [1.0, 0.0])
    cfg = LearnerConfig(ppo_minibatches=2)
    (only,) = deal(shard, AGENTS, cfg, PAD, torch.device("cpu"))
    assert (only.tokens, only.samples) == (2, 1)
    assert _firsts(only.plan, "solver") == [10]


def test_more_updates_than_samples_makes_one_per_sample(group: None) -> None:
    samples = [_sample("verifier", 10, 2), _sample("solver", 11, 3)]
    cfg = LearnerConfig(ppo_minibatches=8)
    minis = deal(_shard(samples, [1.0, 1.0]), AGENTS, cfg, PAD, torch.device("cpu"))
    assert [(m.tokens, m.samples) for m in minis] == [(2, 1), (3, 1)]
    # an agent with no sample in an update gets no micro-batch there (one rank: no padding)
    assert [len(minis[0].plan[a]) for a in AGENTS] == [0, 1]
