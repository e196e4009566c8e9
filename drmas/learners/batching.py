"""A BatchShard -> padded micro-batches, grouped by agent (the learner's only data prep).

Each sample is one sequence `prompt + response`; the model's logits at position j predict
token j + 1, so every per-token tensor lives in that shifted frame of length L - 1 and the
mask selects the positions that predict response tokens. Rows are right-padded to the
longest sequence of their micro-batch. A padding copy (shard weight 0) keeps its row but
gets an all-zero mask, so it costs compute and contributes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from drmas.protocol.arrays import unpack_ids, unpack_logprobs
from drmas.protocol.messages import BatchShard, Sample


@dataclass
class MicroBatch:
    """One forward/backward of one agent's samples on one rank."""

    agent: str
    input_ids: torch.Tensor  # [B, L] int64, right-padded
    attention_mask: torch.Tensor  # [B, L] int64, 1 = real token
    targets: torch.Tensor  # [B, L-1] int64 = input_ids[:, 1:]
    mask: torch.Tensor  # [B, L-1] float32, 1 where the target is a real response token
    behaviour_logprobs: torch.Tensor  # [B, L-1] float32, actor log-probs at those positions
    advantages: torch.Tensor  # [B] float32

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            self.agent,
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.targets.to(device),
            self.mask.to(device),
            self.behaviour_logprobs.to(device),
            self.advantages.to(device),
        )


def collate(
    agent: str, samples: Sequence[Sample], weights: Sequence[float], pad_id: int
) -> MicroBatch:
    """Right-pad `samples` into one micro-batch; weight 0 rows get an all-zero mask."""
    prompts = [unpack_ids(s.prompt_ids) for s in samples]
    responses = [unpack_ids(s.response_ids) for s in samples]
    length = max([2, *(len(p) + len(r) for p, r in zip(prompts, responses))])
    rows = len(samples)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.int64)
    attention = torch.zeros((rows, length), dtype=torch.int64)
    mask = torch.zeros((rows, length - 1), dtype=torch.float32)
    behaviour = torch.zeros((rows, length - 1), dtype=torch.float32)
    for row, (sample, prompt, response, weight) in enumerate(
        zip(samples, prompts, responses, weights)
    ):
        p, t = len(prompt), len(response)
        if p < 1:
            raise ValueError(f"sample of agent {agent!r} has an empty prompt")
        input_ids[row, :p] = torch.from_numpy(prompt.astype("int64"))
        input_ids[row, p : p + t] = torch.from_numpy(response.astype("int64"))
        attention[row, : p + t] = 1
        # Response token k sits at p + k and is predicted from position p + k - 1.
        mask[row, p - 1 : p - 1 + t] = float(weight)
        behaviour[row, p - 1 : p - 1 + t] = torch.from_numpy(
            unpack_logprobs(sample.logprobs).copy()
        )
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return MicroBatch(
        agent, input_ids, attention, input_ids[:, 1:].clone(), mask, behaviour, advantages
    )


def empty_micro_batch(agent: str, pad_id: int) -> MicroBatch:
    """A one-row, all-masked micro-batch: runs the same collectives, adds zero gradient.
    Lets a rank with fewer of an agent's samples keep step with the other ranks."""
    input_ids = torch.full((1, 2), pad_id, dtype=torch.int64)
    zeros = torch.zeros((1, 1), dtype=torch.float32)
    return MicroBatch(
        agent,
        input_ids,
        torch.ones_like(input_ids),
        input_ids[:, 1:].clone(),
        zeros,
        zeros.clone(),
        torch.zeros(1),
    )


def split_by_agent(
    shard: BatchShard, agents: Sequence[str], micro_batch_size: int, pad_id: int
) -> dict[str, list[MicroBatch]]:
    """Micro-batches per agent, agents in `agents` order, samples in shard order."""
    unknown = {s.agent for s in shard.samples} - set(agents)
    if unknown:
        raise ValueError(
            f"batch for model {shard.model!r} has samples of agents {sorted(unknown)}, "
            f"which are not bound to it (bound: {list(agents)})"
        )
    out: dict[str, list[MicroBatch]] = {}
    for agent in agents:
        rows = [i for i, s in enumerate(shard.samples) if s.agent == agent]
        out[agent] = [
            collate(
                agent,
                [shard.samples[i] for i in chunk],
                [shard.weights[i] for i in chunk],
                pad_id,
            )
            for chunk in (
                rows[k : k + micro_batch_size] for k in range(0, len(rows), micro_batch_size)
            )
        ]
    return out
