"""The learner's data prep (drmas/learners/batching.py) on hand-built samples: every
per-token tensor shifted by one (position j predicts token j + 1), the loss mask on
response tokens only (also in a later turn whose prompt holds earlier responses), right
padding, the packed layout with position ids restarting per sequence, and the cuts into
micro-batches by row count and by token budget. Every expected tensor is written out."""

from __future__ import annotations

import pytest
import torch

from drmas.learners.batching import chunks, collate, empty_micro_batch, pack, split_by_agent
from drmas.protocol.arrays import pack_ids, pack_logprobs
from drmas.protocol.messages import BatchShard, Sample

PAD = 9


def _sample(
    prompt: list[int], response: list[int], logprobs: list[float], agent: str = "solver"
) -> Sample:
    return Sample(agent, pack_ids(prompt), pack_ids(response), pack_logprobs(logprobs), 0.5, 3)


def _ints(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def _floats(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# --- collate: the shifted frame, the mask, padding


def test_one_sample_is_shifted_by_one_token_and_masked_on_its_response() -> None:
    # prompt 11 12 13, response 21 22. Position 2 (token 13) predicts 21, position 3
    # predicts 22: those two of the L-1 = 4 shifted positions carry mask and log-probs.
    mb = collate("solver", [_sample([11, 12, 13], [21, 22], [-0.5, -0.25])], [1.0], PAD)
    assert mb.agent == "solver"
    assert torch.equal(mb.input_ids, _ints([[11, 12, 13, 21, 22]]))
    assert torch.equal(mb.attention_mask, _ints([[1, 1, 1, 1, 1]]))
    assert torch.equal(mb.targets, _ints([[12, 13, 21, 22]]))
    assert torch.equal(mb.mask, _floats([[0, 0, 1, 1]]))
    assert torch.equal(mb.behaviour_logprobs, _floats([[0, 0, -0.5, -0.25]]))
    assert torch.equal(mb.advantages, torch.tensor([0.5]))
    assert mb.packed is None


def test_rows_are_right_padded_and_a_padding_copy_gets_an_all_zero_mask() -> None:
    # A: prompt 1 2, response 3 (length 3). B: prompt 4, response 5 6 7 (length 4), weight
    # 0 (the broker's padding copy): B keeps its tokens and log-probs but trains nothing.
    a = _sample([1, 2], [3], [-1.0])
    b = _sample([4], [5, 6, 7], [-0.5, -0.25, -0.125])
    mb = collate("solver", [a, b], [1.0, 0.0], PAD)
    assert torch.equal(mb.input_ids, _ints([[1, 2, 3, PAD], [4, 5, 6, 7]]))
    assert torch.equal(mb.attention_mask, _ints([[1, 1, 1, 0], [1, 1, 1, 1]]))
    assert torch.equal(mb.targets, _ints([[2, 3, PAD], [5, 6, 7]]))
    assert torch.equal(mb.mask, _floats([[0, 1, 0], [0, 0, 0]]))
    assert torch.equal(mb.behaviour_logprobs, _floats([[0, -1.0, 0], [-0.5, -0.25, -0.125]]))


def test_a_later_turn_trains_only_its_own_response() -> None:
    # Turn 1: prompt 1 2, response 3 4. Turn 2's prompt is the history 1 2 3 4 plus an
    # observation 5; its response is 6. Tokens 3 4 are trained in turn 1 only.
    turn1 = _sample([1, 2], [3, 4], [-0.5, -0.25])
    turn2 = _sample([1, 2, 3, 4, 5], [6], [-0.125])
    mb = collate("solver", [turn1, turn2], [1.0, 1.0], PAD)
    assert torch.equal(mb.input_ids, _ints([[1, 2, 3, 4, PAD, PAD], [1, 2, 3, 4, 5, 6]]))
    assert torch.equal(mb.targets, _ints([[2, 3, 4, PAD, PAD], [2, 3, 4, 5, 6]]))
    assert torch.equal(mb.mask, _floats([[0, 1, 1, 0, 0], [0, 0, 0, 0, 1]]))
    assert torch.equal(
        mb.behaviour_logprobs, _floats([[0, -0.5, -0.25, 0, 0], [0, 0, 0, 0, -0.125]])
    )


def test_a_sample_without_response_still_has_one_shifted_position() -> None:
    mb = collate("solver", [_sample([7], [], [])], [1.0], PAD)
    assert torch.equal(mb.input_ids, _ints([[7, PAD]]))
    assert torch.equal(mb.attention_mask, _ints([[1, 0]]))
    assert torch.equal(mb.mask, _floats([[0]]))


def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="'verifier' has an empty prompt"):
        collate("verifier", [_sample([], [1], [-1.0], agent="verifier")], [1.0], PAD)


def test_the_empty_micro_batch_is_one_fully_masked_row() -> None:
    mb = empty_micro_batch("verifier", PAD)
    assert torch.equal(mb.input_ids, _ints([[PAD, PAD]]))
    assert torch.equal(mb.attention_mask, _ints([[1, 1]]))
    assert torch.equal(mb.targets, _ints([[PAD]]))
    assert torch.equal(mb.mask, _floats([[0]]))
    assert torch.equal(mb.advantages, torch.zeros(1))


# --- pack: one row without padding


def test_packing_concatenates_real_tokens_and_restarts_positions() -> None:
    a = _sample([1, 2], [3], [-1.0])  # length 3
    b = _sample([4], [5, 6, 7], [-0.5, -0.25, -0.125])  # length 4
    packed = pack(collate("solver", [a, b], [1.0, 1.0], PAD))
    assert torch.equal(packed.input_ids, _ints([[1, 2, 3, 4, 5, 6, 7]]))
    assert torch.equal(packed.position_ids, _ints([[0, 1, 2, 0, 1, 2, 3]]))
    # Packed shifted position k predicts packed token k + 1. Row A's positions 0, 1 are
    # packed 0, 1; row B's 0, 1, 2 are packed 3, 4, 5. Packed 2 (token 3 -> token 4)
    # crosses from A into B and belongs to no row; A's padded position 2 is not valid.
    assert torch.equal(packed.index, _ints([[0, 1, 0], [3, 4, 5]]))
    assert torch.equal(packed.valid, torch.tensor([[True, True, False], [True, True, True]]))


def test_unpack_gathers_packed_values_into_the_padded_frame() -> None:
    a = _sample([1, 2], [3], [-1.0])
    b = _sample([4], [5, 6, 7], [-0.5, -0.25, -0.125])
    mb = collate("solver", [a, b], [1.0, 1.0], PAD)
    packed = pack(mb)
    per_token = torch.tensor([[10.0, 11.0, 12.0, 13.0, 14.0, 15.0]])  # [1, N-1], N = 7
    assert torch.equal(packed.unpack(per_token), _floats([[10, 11, 0], [13, 14, 15]]))
    # The packed row's own next tokens land where the padded targets are.
    next_tokens = packed.input_ids[:, 1:]  # 2 3 4 5 6 7
    assert torch.equal(packed.unpack(next_tokens), _ints([[2, 3, 0], [5, 6, 7]]))
    assert torch.equal(mb.targets[packed.valid], torch.tensor([2, 3, 5, 6, 7]))


# --- chunks: micro-batch cuts


def test_chunks_by_row_count() -> None:
    assert chunks([5, 5, 5, 5, 5], 2, 0, False) == [range(0, 2), range(2, 4), range(4, 5)]
    assert chunks([5, 5, 5], 1, 0, True) == [range(0, 1), range(1, 2), range(2, 3)]
    assert chunks([], 4, 0, False) == []


def test_chunks_by_padded_token_budget() -> None:
    # Padded cost = rows x longest. [3, 5]: 2 x 5 = 10 fits 10; adding 2 costs 3 x 5 = 15.
    # [2, 4]: 2 x 4 = 8 fits.
    assert chunks([3, 5, 2, 4], 10, 10, False) == [range(0, 2), range(2, 4)]


def test_chunks_by_packed_token_budget() -> None:
    # Packed cost = sum: 3 + 5 + 2 = 10 fits 10; adding 4 makes 14.
    assert chunks([3, 5, 2, 4], 10, 10, True) == [range(0, 3), range(3, 4)]


@pytest.mark.parametrize("packed", [False, True])
def test_a_sample_over_the_budget_gets_a_micro_batch_of_its_own(packed: bool) -> None:
    assert chunks([2, 12, 3], 10, 10, packed) == [range(0, 1), range(1, 2), range(2, 3)]


def test_row_limit_applies_within_the_token_budget() -> None:
    assert chunks([1, 1, 1, 1], 3, 100, True) == [range(0, 3), range(3, 4)]


# --- split_by_agent: the shard -> micro-batches per agent


def _shard(samples: list[Sample], weights: list[float]) -> BatchShard:
    return BatchShard(
        model="policy",
        version=3,
        rank=0,
        world_size=1,
        samples=samples,
        weights=weights,
        total_samples=len(samples),
        total_tokens=0,
    )


def test_split_groups_by_agent_in_the_given_order_and_cuts_by_size() -> None:
    s0 = _sample([1], [2], [-1.0])
    v0 = _sample([3, 4], [5], [-0.5], agent="verifier")
    s1 = _sample([6], [7, 8], [-0.25, -0.125])
    s2 = _sample([9, 10], [11], [-2.0])
    out = split_by_agent(
        _shard([s0, v0, s1, s2], [1.0, 1.0, 0.0, 1.0]), ["verifier", "solver"], 2, 0
    )
    assert list(out) == ["verifier", "solver"]
    (verifier,) = out["verifier"]
    assert torch.equal(verifier.input_ids, _ints([[3, 4, 5]]))
    first, second = out["solver"]
    assert torch.equal(first.input_ids, _ints([[1, 2, 0], [6, 7, 8]]))
    assert torch.equal(first.mask, _floats([[1, 0], [0, 0]]))  # s1 is a padding copy
    assert torch.equal(second.input_ids, _ints([[9, 10, 11]]))
    assert torch.equal(second.mask, _floats([[0, 1]]))
    assert all(mb.packed is None for mbs in out.values() for mb in mbs)


@pytest.mark.parametrize(
    ("packed", "rows"),
    [
        (False, [1, 1, 1]),  # 3 fits 7; 2 x 4 = 8 does not; 2 x 4 = 8 again
        (True, [2, 1]),  # 3 + 4 = 7 fits 7; + 2 = 9 does not
    ],
)
def test_split_cuts_by_token_budget(packed: bool, rows: list[int]) -> None:
    lengths_3_4_2 = [([1, 2], [3]), ([4], [5, 6, 7]), ([8], [9])]
    samples = [_sample(p, r, [-1.0] * len(r)) for p, r in lengths_3_4_2]
    out = split_by_agent(_shard(samples, [1.0] * 3), ["solver"], 8, PAD, 7, packed)
    assert [mb.input_ids.shape[0] for mb in out["solver"]] == rows
    assert all((mb.packed is not None) == packed for mb in out["solver"])


def test_split_refuses_samples_of_an_agent_not_bound_to_the_model() -> None:
    shard = _shard([_sample([1], [2], [-1.0], agent="searcher")], [1.0])
    with pytest.raises(ValueError, match=r"agents \['searcher'\], which are not bound"):
        split_by_agent(shard, ["solver"], 4, PAD)
