"""Lemma 4.2 measured on the real learner: how much larger (or smaller) agent k's policy
gradient is under a global baseline than under its own agent-wise (Dr. MAS) statistics.

The lemma speaks of one step's gradient A·h, with h = ∇ log π(response) the step's score
function: with advantages (s − μ)/σ from the team's statistics its second moment
E[A² ‖h‖²] is F_k = (σ_k² + (μ_k − μ)²)/σ² times the one under agent k's own μ_k, σ_k,
because E[A² ‖h‖²] = E[A²]·E‖h‖² when the scores do not depend on the sampled actions.
For one agent, over its steps i of all probed groups g (h_i from the learner's own loss and
backward: `policy_loss` at ratio 1 and advantage 1, no entropy, KL or IS weight, and a
normaliser of one token and one sample for every step, as the batch loss divides every
step by the same batch totals):

- predicted factor = Σ_i (A_i^b)² / Σ_i (A_i^agent)²: F_k from the scores alone. Per group
  it is (σ_k² + (μ_k − μ)²)/σ² divided by agent k's own normalised second moment (exactly 1
  with population std, (n_k − 1)/n_k with the unbiased one).
- measured ratio = Σ_i (A_i^b)² ‖h_i‖² / Σ_i (A_i^agent)² ‖h_i‖²: the per-step second
  moments the lemma compares, measured. Where the scores do not depend on the actions it
  estimates the same quantity as the prediction; `agreement` = measured / predicted is then
  1 within its interval; away from 1, the advantages and the gradient sizes move
  together (real rewards, or a team whose composition follows the actions).
- batch ratio = Σ_g ‖Σ_i A_i^b h_i‖² / Σ_g ‖Σ_i A_i^agent h_i‖²: the gradient of a batch
  of these groups, whose cross terms h_i·h_j (i ≠ j) have mean 0 under the lemma but not
  where rewards depend on the actions. It is the noisiest of the three.
- effective steps = (Σ‖h_i‖²)² / Σ‖h_i‖⁴: a confident model's rare responses have score
  functions far larger than its usual ones, and a few steps can carry the measurement.

Why not what the probe did before issue #24 (the ratio of mean ‖g_g‖² over groups, each
group's gradient divided by its own token count, against the scores-only factor): on
tiny_math with synthetic scores solver N(0, 1), verifier N(1, 0.3) (64 groups) the narrow
Verifier's `step_global` factor was 0.64 and that ratio 1.05 [0.75, 1.41]. The per-group
normaliser was not the cause (the Verifier's tokens per group vary 156–177, weighting by
it moves the factor by < 1 %). The batch gradient was: 1 % of the Verifier's steps hold
23 % of Σ‖h_i‖² (70 effective steps of 512), one group holds a fifth of both sums, and
there the cross term of two rare responses with agent-wise advantages of opposite sign
(+1.58, −1.54) cut the agent-wise norm by 43 %. Those cross terms have mean 0, so with
probe.seed 1 and 2 the old ratio agreed (0.69 and 0.65 against 0.62 and 0.61): it was
noise that its interval did not cover. Per-step second moments measure 0.68 [0.59, 0.77]
on the seed-0 groups, in agreement with the factor. The price is one backward per step
besides the one per mode.

Used by `drmas probe` (drmas/launch/probe.py), which samples the groups. A `Gradients`
object turns (steps, weights) into a squared gradient norm: `TrainerGradients` on the
learner's model; tests supply their own (a log-linear policy whose answer is known).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from drmas.config.learner import LossConfig
from drmas.learners.batching import collate
from drmas.learners.loss import policy_loss
from drmas.learners.trainer import Trainer
from drmas.protocol.messages import Sample


class Gradients(Protocol):
    """One agent's steps of one group, as a policy whose gradient norms can be taken."""

    @property
    def steps(self) -> int: ...

    def sq_norm(self, rows: Sequence[int], weights: np.ndarray) -> float:
        """‖∇ Σ_j weights[j] · ℓ_{rows[j]}‖², ℓ_i = step i's policy loss at advantage 1."""
        ...


def weighted_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: np.ndarray,
    cfg: LossConfig,
) -> torch.Tensor:
    """Σ_i weights[i] · ℓ_i with the learner's policy loss at ratio 1 (π_old = π_θ), the
    weights as advantages, and a normaliser of one token and one sample for every step (the
    batch's common normaliser, up to a constant). logprobs, behaviour_logprobs, mask: [B, L]."""
    cfg = dataclasses.replace(cfg, entropy_coef=0.0, kl_coef=0.0, is_correction="none")
    loss, _ = policy_loss(
        logprobs,
        logprobs.detach(),
        behaviour_logprobs,
        torch.as_tensor(weights, dtype=torch.float32, device=logprobs.device),
        mask,
        cfg,
        total_tokens=1,
        total_samples=1,
    )
    return loss


class TrainerGradients:
    """`Gradients` of one agent's samples on the learner's model (a one-rank Trainer): one
    forward and one backward per call; the weights stay, the gradient is cleared."""

    def __init__(self, trainer: Trainer, samples: Sequence[Sample]) -> None:
        if not samples:
            raise ValueError("TrainerGradients needs at least one sample")
        self.trainer = trainer
        self.samples = list(samples)
        self.agent = samples[0].agent
        trainer.use_agent(self.agent)  # on a LoRA base: the agent's own adapter

    @property
    def steps(self) -> int:
        return len(self.samples)

    def sq_norm(self, rows: Sequence[int], weights: np.ndarray) -> float:
        if len(rows) != len(weights):
            raise ValueError(f"{len(weights)} weights for {len(rows)} steps")
        t = self.trainer
        chosen = [self.samples[i] for i in rows]
        batch = collate(self.agent, chosen, [1.0] * len(chosen), t.pad_id).to(t.device)
        t.optimizer.zero_grad(set_to_none=True)
        logprobs, _ = t.token_stats(t.model, batch, False)  # [B, L-1]
        weighted_loss(
            logprobs, batch.behaviour_logprobs, batch.mask, weights, t.loss_cfg
        ).backward()
        out = t._delta_sq([None] * len(list(t.model.parameters())))
        t.optimizer.zero_grad(set_to_none=True)
        return out


@dataclasses.dataclass
class GroupMoments:
    """One agent's steps of one group, per advantage mode: ‖Σ_i A_i h_i‖² (full),
    Σ_i A_i² ‖h_i‖² (diag) and Σ_i A_i² (adv_sq); and each step's ‖h_i‖² (step_sq)."""

    full: dict[str, float]
    diag: dict[str, float]
    adv_sq: dict[str, float]
    step_sq: list[float] = dataclasses.field(default_factory=list)


def group_moments(grads: Gradients, advantages: Mapping[str, np.ndarray]) -> GroupMoments:
    """One backward per step (its ‖h_i‖², the same for every mode) and one per mode (the
    gradient of the agent's steps under that mode's advantages)."""
    n = grads.steps
    for mode, adv in advantages.items():
        if len(adv) != n:
            raise ValueError(f"{mode}: {len(adv)} advantages for {n} steps")
    one = np.ones(1)
    per_step = np.array([grads.sq_norm([i], one) for i in range(n)])  # [n] ‖h_i‖²
    every = list(range(n))
    full, diag, adv_sq = {}, {}, {}
    for mode, adv in advantages.items():
        a = np.asarray(adv, dtype=np.float64)
        diag[mode] = float(np.square(a) @ per_step)
        # One step: no cross term, the full norm is the diagonal (saves a backward).
        full[mode] = diag[mode] if n == 1 else grads.sq_norm(every, a)
        adv_sq[mode] = float(np.square(a).sum())
    return GroupMoments(full, diag, adv_sq, [float(v) for v in per_step])


@dataclasses.dataclass
class AgentRows:
    """Per group, for one agent: its GroupMoments, mode by mode, its step count, and the sum
    of its steps' ‖h_i‖² and of their squares (for the effective number of steps)."""

    full: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    diag: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    adv_sq: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    steps: list[int] = dataclasses.field(default_factory=list)
    step_sq: list[float] = dataclasses.field(default_factory=list)
    step_sq_sq: list[float] = dataclasses.field(default_factory=list)

    def add(self, moments: GroupMoments, steps: int) -> None:
        for name in ("full", "diag", "adv_sq"):
            for mode, value in getattr(moments, name).items():
                getattr(self, name).setdefault(mode, []).append(float(value))
        self.steps.append(steps)
        self.step_sq.append(float(np.sum(moments.step_sq)))
        self.step_sq_sq.append(float(np.sum(np.square(moments.step_sq))))


def summarise(
    rows: Mapping[str, AgentRows],
    baselines: Sequence[str],
    bootstrap: int,
    seed: int,
    level: float = 0.95,
) -> dict[str, dict[str, dict[str, object]]]:
    """agent -> baseline -> predicted_factor, measured_ratio, agreement (measured /
    predicted) and batch_ratio, each with an interval (predicted_ci95, ci95, agreement_ci95,
    batch_ci95), effective_steps, n_groups, n_steps. Intervals: percentile bootstrap over
    groups, every quantity of one resample from the same groups (pairs kept); `level` is
    their coverage (the keys keep the name ci95)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    tails = [50 * (1 - level), 50 * (1 + level)]
    out: dict[str, dict[str, dict[str, object]]] = {}
    for agent, r in rows.items():
        n = len(r.steps)
        picks = rng.integers(0, n, size=(bootstrap, n))  # [bootstrap, n] group indices
        out[agent] = {}
        for b in baselines:
            est = {
                name: _RatioOfSums(
                    np.asarray(getattr(r, name)[b]), np.asarray(getattr(r, name)["agent"]), picks
                )
                for name in ("adv_sq", "diag", "full")
            }
            predicted, measured, batch = est["adv_sq"], est["diag"], est["full"]
            agreement = _ratio(measured.point, predicted.point)
            out[agent][b] = {
                "predicted_factor": predicted.point,
                "predicted_ci95": _interval(predicted.boot, predicted.point, n, tails),
                "measured_ratio": measured.point,
                "ci95": _interval(measured.boot, measured.point, n, tails),
                "agreement": agreement,
                "agreement_ci95": _interval(
                    _ratios(measured.boot, predicted.boot), agreement, n, tails
                ),
                "batch_ratio": batch.point,
                "batch_ci95": _interval(batch.boot, batch.point, n, tails),
                # (Σ‖h_i‖²)² / Σ‖h_i‖⁴: how many steps' weight the measurement really rests on.
                "effective_steps": _ratio(sum(r.step_sq) ** 2, sum(r.step_sq_sq)),
                "n_groups": n,
                "n_steps": int(sum(r.steps)),
                # E[A² ‖h‖²] per step under the baseline and under agent
                "mean_grad_sq": _ratio(sum(r.diag[b]), sum(r.steps)),
                "mean_grad_sq_agent": _ratio(sum(r.diag["agent"]), sum(r.steps)),
            }
    return out


class _RatioOfSums:
    """Σ_g top_g / Σ_g bottom_g over the groups, and the same over each bootstrap resample."""

    def __init__(self, top: np.ndarray, bottom: np.ndarray, picks: np.ndarray) -> None:
        self.point = _ratio(float(top.sum()), float(bottom.sum()))
        self.boot = _ratios(top[picks].sum(1), bottom[picks].sum(1))  # [bootstrap]


def _interval(boot: np.ndarray, point: float, n: int, tails: list[float]) -> list[float]:
    if n < 2 or np.all(np.isnan(boot)):
        return [point, point]
    lo, hi = np.nanpercentile(boot, tails)
    return [float(lo), float(hi)]


def _ratios(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b > 0 and np.isfinite(b) else float("nan")
