"""A rank's shard of a batch -> the optimizer updates the learner makes on it.

drmas/learners/trainer.py calls `deal` once per batch: the shard is dealt into
`learner.ppo_minibatches` mini-batches (one optimizer update each), and each mini-batch is
planned into micro-batches per agent (drmas/learners/batching.py builds them). Both steps
are collectives of the model's learner group: every rank must run the same number of
forward/backward calls per agent (FSDP2's gathers must line up) and must normalise the
update's loss by the same totals, so the counts are agreed with all-reduces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist

from drmas.learners.batching import MicroBatch, empty_micro_batch, split_by_agent
from drmas.protocol.messages import BatchShard

if TYPE_CHECKING:
    from drmas.config.learner import LearnerConfig


@dataclass
class MiniBatch:
    """One optimizer update's share of this rank's shard."""

    plan: dict[str, list[MicroBatch]]  # micro-batches per agent (same counts on every rank)
    tokens: int  # real response tokens of the update over all ranks
    samples: int  # real sequences of the update over all ranks
    # π_old per micro-batch of each agent; empty with one update per batch
    old_logprobs: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def deal(
    shard: BatchShard,
    agents: Sequence[str],
    learner: LearnerConfig,
    pad_id: int,
    device: torch.device,
) -> list[MiniBatch]:
    """This rank's shard dealt into `ppo_minibatches` parts (sample i -> part i mod M;
    shards are sorted longest first, so parts get similar lengths), each planned into
    micro-batches, with the part's real token and sample counts over ALL ranks (its
    loss normaliser). Parts that are empty on every rank are left out."""
    count = min(learner.ppo_minibatches, max(1, len(shard.samples)))
    parts = []
    for m in range(count):
        rows = list(range(m, len(shard.samples), count))
        parts.append(
            BatchShard(
                shard.model,
                shard.version,
                shard.rank,
                shard.world_size,
                [shard.samples[i] for i in rows],
                [shard.weights[i] for i in rows],
                shard.total_samples,
                shard.total_tokens,
            )
        )
    if count == 1:  # the batch's own totals (they already cover every rank)
        totals = [(shard.total_tokens, shard.total_samples)]
    else:
        counts = torch.tensor(
            [
                [
                    sum(len(s.response_ids) // 4 for s, w in zip(p.samples, p.weights) if w),
                    sum(1 for w in p.weights if w),
                ]
                for p in parts
            ],
            dtype=torch.int64,
            device=device,
        )  # [M, 2] real tokens, real samples of each part on this rank
        dist.all_reduce(counts)
        totals = [(int(t), int(n)) for t, n in counts.cpu().tolist()]
    return [
        MiniBatch(plan(part, agents, learner, pad_id, device), max(tokens, 1), max(samples, 1))
        for part, (tokens, samples) in zip(parts, totals)
        if samples > 0
    ]


def plan(
    shard: BatchShard,
    agents: Sequence[str],
    learner: LearnerConfig,
    pad_id: int,
    device: torch.device,
) -> dict[str, list[MicroBatch]]:
    """Micro-batches by agent, padded with empty ones so that every rank runs the same
    number of forward/backward calls per agent (FSDP's collectives must line up)."""
    by_agent = split_by_agent(
        shard, agents, learner.micro_batch_size, pad_id, learner.micro_batch_tokens, learner.pack
    )
    counts = torch.tensor([len(by_agent[a]) for a in agents], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # (on the device: NCCL needs CUDA)
    for agent, count in zip(agents, counts.tolist()):
        by_agent[agent] += [empty_micro_batch(agent, pad_id)] * (count - len(by_agent[agent]))
    return by_agent


def drop_overlong(shard: BatchShard, context: int, device: torch.device) -> tuple[BatchShard, int]:
    """`shard` with every sample longer than the model's `context` (prompt + response
    tokens) made a zero-weight stub of its first prompt and response token, and how many
    such samples the whole batch had (a collective: an all-reduce over the learner group).

    The broker refuses such steps at its gate; this keeps a learner alive if one gets
    through anyway (32,768-token prompts on a 512-token model made it allocate 68.7 GB).
    The stub keeps the shard's shape, so every rank runs the same micro-batches; the
    batch's loss normalisers (from the broker) still count the dropped tokens."""
    samples, weights, dropped, changed = list(shard.samples), list(shard.weights), 0, False
    for i, s in enumerate(samples):
        if (len(s.prompt_ids) + len(s.response_ids)) // 4 > context:
            changed = True
            samples[i] = msgspec.structs.replace(
                s, prompt_ids=s.prompt_ids[:4], response_ids=s.response_ids[:4],
                logprobs=s.logprobs[:4],
            )  # fmt: skip
            dropped += weights[i] > 0
            weights[i] = 0.0
    count = torch.tensor([dropped], dtype=torch.int64, device=device)
    dist.all_reduce(count)
    if not changed:
        return shard, int(count.item())
    return msgspec.structs.replace(shard, samples=samples, weights=weights), int(count.item())
