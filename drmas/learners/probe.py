"""Lemma 4.2 measured on the real learner: how much larger (or smaller) agent k's policy
gradient is under a global baseline than under its own agent-wise (Dr. MAS) statistics.

The lemma: with advantages (s − μ)/σ from the team's statistics, the second moment of agent
k's gradient scales with F_k = (σ_k² + (μ_k − μ)²)/σ², where μ_k, σ_k are agent k's own;
with (s − μ_k)/σ_k the factor is 1. Here, on the same sampled steps, we measure
E‖g_k‖² under each baseline and under `agent`, with the learner's own loss and backward
(`policy_loss` at ratio 1: the policy-gradient term only, no entropy, KL or IS weight, and
no optimizer step), and compare the ratio with the factor predicted from the advantages:

    predicted F_k = Σ (A_baseline)² / Σ (A_agent)² over agent k's steps of all groups,

which per group is (σ_k² + (μ_k − μ)²)/σ² divided by agent k's own normalised second
moment (exactly 1 with population std, (n_k − 1)/n_k with the unbiased one): the lemma's
factor, computed with the same statistics, ε and lone-sample rules as training.

Used by `drmas probe` (drmas/launch/probe.py), which samples the groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from drmas.learners.batching import collate
from drmas.learners.loss import policy_loss
from drmas.learners.trainer import Trainer
from drmas.protocol.messages import Sample


def grad_sq_norms(
    trainer: Trainer, samples: Sequence[Sample], advantages: Mapping[str, np.ndarray]
) -> dict[str, float]:
    """‖∇ loss‖² of the learner's loss on `samples` (one agent's steps of one group), for each
    named advantage vector: one forward and one backward per vector; the weights stay."""
    if not samples:
        raise ValueError("grad_sq_norms needs at least one sample")
    agent = samples[0].agent
    trainer.use_agent(agent)  # on a LoRA base: the gradient of the agent's own adapter
    loss_cfg = dataclasses.replace(
        trainer.loss_cfg, entropy_coef=0.0, kl_coef=0.0, is_correction="none"
    )
    batch = collate(agent, samples, [1.0] * len(samples), trainer.pad_id).to(trainer.device)
    tokens = max(1, int(batch.mask.sum()))
    out = {}
    for name, adv in advantages.items():
        if len(adv) != len(samples):
            raise ValueError(f"{name}: {len(adv)} advantages for {len(samples)} samples")
        trainer.optimizer.zero_grad(set_to_none=True)
        logprobs, _ = trainer.token_stats(trainer.model, batch, False)  # [B, L-1]
        loss, _ = policy_loss(
            logprobs,
            logprobs.detach(),  # π_old = π_θ: ratio 1, the plain policy gradient
            batch.behaviour_logprobs,
            torch.as_tensor(adv, dtype=torch.float32, device=trainer.device),
            batch.mask,
            loss_cfg,
            total_tokens=tokens,
            total_samples=len(samples),
        )
        loss.backward()
        out[name] = trainer._delta_sq([None] * len(list(trainer.model.parameters())))
    trainer.optimizer.zero_grad(set_to_none=True)
    return out


@dataclasses.dataclass
class AgentRows:
    """Per group, for one agent: ‖g‖² and Σ A² under each advantage mode."""

    grad_sq: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    adv_sq: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def add(self, grad_sq: Mapping[str, float], adv: Mapping[str, np.ndarray]) -> None:
        for mode, value in grad_sq.items():
            self.grad_sq.setdefault(mode, []).append(float(value))
            self.adv_sq.setdefault(mode, []).append(float(np.square(adv[mode]).sum()))


def summarise(
    rows: Mapping[str, AgentRows], baselines: Sequence[str], bootstrap: int, seed: int
) -> dict[str, dict[str, dict[str, object]]]:
    """agent -> baseline -> predicted_factor, measured_ratio (ratio of mean ‖g‖² over groups),
    ci95 (percentile bootstrap over groups, resampled in pairs), n_groups."""
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, dict[str, object]]] = {}
    for agent, r in rows.items():
        agent_g = np.asarray(r.grad_sq["agent"])
        n = len(agent_g)
        picks = rng.integers(0, n, size=(bootstrap, n))  # [bootstrap, n] group indices
        out[agent] = {}
        for b in baselines:
            base_g = np.asarray(r.grad_sq[b])
            ratio = _ratio(base_g.mean(), agent_g.mean())
            boot = [_ratio(base_g[p].mean(), agent_g[p].mean()) for p in picks]
            lo, hi = np.nanpercentile(boot, [2.5, 97.5]) if n > 1 else (ratio, ratio)
            out[agent][b] = {
                "predicted_factor": _ratio(sum(r.adv_sq[b]), sum(r.adv_sq["agent"])),
                "measured_ratio": ratio,
                "ci95": [float(lo), float(hi)],
                "n_groups": n,
                "mean_grad_sq": float(base_g.mean()),
                "mean_grad_sq_agent": float(agent_g.mean()),
            }
    return out


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b > 0 else float("nan")
