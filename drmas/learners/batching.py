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
    packed: Packed | None = None  # the same sequences without padding (learner.pack)

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            self.agent,
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.targets.to(device),
            self.mask.to(device),
            self.behaviour_logprobs.to(device),
            self.advantages.to(device),
            None if self.packed is None else self.packed.to(device),
        )


@dataclass
class Packed:
    """A micro-batch's sequences concatenated into one row, no padding. position_ids
    restart at 0 for each sequence, which is how transformers recognises packed sequences
    and keeps attention within each one. The model runs on this row; per-token results are
    gathered back into the padded [B, L-1] frame with `index` (where `valid`), so the loss
    code is the same for both."""

    input_ids: torch.Tensor  # [1, N] int64, N = total real tokens
    position_ids: torch.Tensor  # [1, N] int64
    index: torch.Tensor  # [B, L-1] int64: position in the packed shifted frame [N-1]
    valid: torch.Tensor  # [B, L-1] bool: the padded position holds a real prediction

    def to(self, device: torch.device) -> Packed:
        return Packed(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.index.to(device),
            self.valid.to(device),
        )

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, N-1] per-token values -> [B, L-1], 0 where `valid` is False."""
        return packed[0][self.index].masked_fill(~self.valid, 0.0)


def pack(mb: MicroBatch) -> Packed:
    lengths = mb.attention_mask.sum(-1).tolist()
    rows, width = mb.input_ids.shape
    ids = torch.cat([mb.input_ids[r, :n] for r, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    index = torch.zeros((rows, width - 1), dtype=torch.int64)
    valid = torch.zeros((rows, width - 1), dtype=torch.bool)
    start = 0
    for r, n in enumerate(lengths):
        # padded position j < n - 1 of row r predicts token j + 1 of the same sequence;
        # in the packed row that prediction sits at start + j
        index[r, : n - 1] = torch.arange(start, start + n - 1)
        valid[r, : n - 1] = True
        start += n
    return Packed(ids, positions, index, valid)


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
    # a sample's loss weight scales its advantage: the clipped PPO surrogate (dual clip
    # and importance weight included) is positively homogeneous in it, so this is the
    # weighted policy-gradient loss, and entropy and KL stay unweighted
    advantages = torch.tensor([s.advantage * s.loss_weight for s in samples], dtype=torch.float32)
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


def chunks(lengths: Sequence[int], max_rows: int, max_tokens: int, packed: bool) -> list[range]:
    """Consecutive runs of samples: at most `max_rows` each and, with max_tokens > 0, at
    most that many tokens (padded: rows x longest; packed: the sum). A sample longer than
    the budget gets a micro-batch of its own."""
    out: list[range] = []
    start, longest, total = 0, 0, 0  # of the open run
    for i, n in enumerate(lengths):
        rows = i - start + 1
        cost = total + n if packed else rows * max(longest, n)
        if i > start and (rows > max_rows or (max_tokens > 0 and cost > max_tokens)):
            out.append(range(start, i))
            start, longest, total = i, 0, 0
        longest, total = max(longest, n), total + n
    if lengths:
        out.append(range(start, len(lengths)))
    return out


def split_by_agent(
    shard: BatchShard,
    agents: Sequence[str],
    micro_batch_size: int,
    pad_id: int,
    max_tokens: int = 0,
    packed: bool = False,
) -> dict[str, list[MicroBatch]]:
    """Micro-batches per agent, agents in `agents` order, samples in shard order; at most
    `micro_batch_size` sequences and (max_tokens > 0) `max_tokens` tokens each; `packed`
    adds the padding-free layout the model then runs on."""
    unknown = {s.agent for s in shard.samples} - set(agents)
    if unknown:
        raise ValueError(
            f"batch for model {shard.model!r} has samples of agents {sorted(unknown)}, "
            f"which are not bound to it (bound: {list(agents)})"
        )
    out: dict[str, list[MicroBatch]] = {}
    for agent in agents:
        rows = [i for i, s in enumerate(shard.samples) if s.agent == agent]
        lengths = [
            (len(shard.samples[i].prompt_ids) + len(shard.samples[i].response_ids)) // 4
            for i in rows
        ]
        out[agent] = []
        for run in chunks(lengths, micro_batch_size, max_tokens, packed):
            mb = collate(
                agent,
                [shard.samples[rows[k]] for k in run],
                [shard.weights[rows[k]] for k in run],
                pad_id,
            )
            if packed:
                mb.packed = pack(mb)
            out[agent].append(mb)
    return out
