"""A sample longer than its model's context never reaches the forward pass: the learner
turns it into a zero-weight stub (the shard keeps its shape, so every rank runs the same
micro-batches) and counts it in overlong_samples/<model>. The broker's gate refuses such
steps first (test_protocol.py); this is the learner's own guard. One gloo rank."""

from __future__ import annotations

import torch

from drmas.learners.updates import drop_overlong
from drmas.protocol import pack_ids, pack_logprobs
from drmas.protocol.messages import BatchShard, Sample


def sample(prompt: int, response: int) -> Sample:
    return Sample(
        "solver",
        pack_ids(list(range(1, prompt + 1))),
        pack_ids(list(range(1, response + 1))),
        pack_logprobs([-0.5] * response),
        1.0,
        3,
    )


def shard(*samples: Sample, weights: list[float] | None = None) -> BatchShard:
    return BatchShard("m", 3, 0, 1, list(samples), weights or [1.0] * len(samples), 9, 99)


def test_an_overlong_sample_becomes_a_counted_zero_weight_stub(group: None) -> None:
    given = shard(sample(4, 2), sample(30_000, 8), sample(5, 3))
    out, dropped = drop_overlong(given, context=512, device=torch.device("cpu"))
    assert dropped == 1
    assert out.weights == [1.0, 0.0, 1.0]
    stub = out.samples[1]
    assert len(stub.prompt_ids) == 4 and len(stub.response_ids) == 4 and len(stub.logprobs) == 4
    assert out.samples[0] is given.samples[0] and out.samples[2] is given.samples[2]
    assert (out.total_samples, out.total_tokens) == (9, 99)  # the broker's normalisers


def test_a_shard_that_fits_comes_back_as_it_was(group: None) -> None:
    given = shard(sample(4, 2), sample(500, 12))  # 512 exactly: fits
    out, dropped = drop_overlong(given, context=512, device=torch.device("cpu"))
    assert out is given and dropped == 0


def test_a_padding_copy_that_is_too_long_is_stubbed_but_not_counted(group: None) -> None:
    given = shard(sample(4, 2), sample(600, 2), weights=[1.0, 0.0])
    out, dropped = drop_overlong(given, context=512, device=torch.device("cpu"))
    assert dropped == 0 and len(out.samples[1].prompt_ids) == 4
