"""PPO loss of one micro-batch and the token log-probs it needs; called by
drmas/learners/trainer.py for every micro-batch (and by drmas/learners/probe.py).

The loss per response token: the PPO clipped surrogate against π_old (with dual clip),
times a detached importance weight π_old/π_behaviour that corrects for the lag of the
asynchronous actors, minus an entropy bonus, plus a k3 KL penalty to a frozen reference;
aggregated over the batch with its global token and sequence counts (cfg.agg).

Shapes: B sequences, T response positions (right-padded), V vocabulary.

METRICS: policy_loss also returns detached 0-d float32 tensors, each a SUM over this
micro-batch's real tokens (mask = 1); add them over micro-batches and ranks and divide by
total_tokens for a fraction or a mean:

- ``pg_clipped_tokens``: tokens whose surrogate took a clipped branch: the PPO clip
  (−A·clip(r) > −A·r) or, for A < 0 with dual clip on, the dual-clip bound −A·c.
- ``ppo_kl_sum``: Σ (old_logprobs − logprobs), the approximate KL(π_old‖π).
- ``is_weight_sum``: Σ of the importance weight applied to the surrogate
  (tis: min(π_old/π_behaviour, is_cap); mask: 1 or 0; none: 1).
- ``is_capped_tokens``: tokens with π_old/π_behaviour > is_cap (counted in every mode).
- ``entropy_sum``: Σ entropy (only when ``entropy`` is given).
- ``kl_sum``: Σ k3(ref, cur) = exp(ref − cur) − (ref − cur) − 1 (only when
  ``ref_logprobs`` is given).
Log-ratios are clamped to ±20 before exp(), so extreme stale tokens stay finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from drmas.config.learner import LossConfig

# exp() of a log-ratio beyond this overflows float32 and turns gradients into NaN (0 · inf);
# a ratio of e^20 is clipped by PPO long before, so the clamp changes no real loss value.
_MAX_LOG_RATIO = 20.0

# Rows of the [B·T, V] logits handled at once by the entropy kernel (bounds the transient
# softmax to ≈64 MB of float32 for V ≈ 150k).
_ENTROPY_CHUNK_ELEMENTS = 1 << 24


def _token_mean(
    loss: Tensor, mask: Tensor, cfg: LossConfig, total_tokens: int, total_samples: int
) -> Tensor:
    return (loss * mask).sum() / total_tokens  # [B,T] -> []


def _seq_mean_token_mean(
    loss: Tensor, mask: Tensor, cfg: LossConfig, total_tokens: int, total_samples: int
) -> Tensor:
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
    return per_seq.sum() / total_samples


def _seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, cfg: LossConfig, total_tokens: int, total_samples: int
) -> Tensor:
    per_seq = (loss * mask).sum(-1) / cfg.max_response_len  # [B]
    return per_seq.sum() / total_samples


# cfg.agg -> micro-batch share of the batch loss; every entry divides by global totals only,
# so the sum over micro-batches and ranks is the batch loss whatever the split.
_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, LossConfig, int, int], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
_IS_CORRECTIONS = ("tis", "mask", "none")


def _check(
    cfg: LossConfig,
    logprobs: Tensor,
    advantages: Tensor,
    total_tokens: int,
    total_samples: int,
    **others: Tensor | None,
) -> None:
    if cfg.agg not in _AGGREGATIONS:
        raise ValueError(f"unknown loss agg {cfg.agg!r}: use one of {sorted(_AGGREGATIONS)}")
    if cfg.is_correction not in _IS_CORRECTIONS:
        raise ValueError(
            f"unknown is_correction {cfg.is_correction!r}: use one of {list(_IS_CORRECTIONS)}"
        )
    if not cfg.is_cap > 0:
        raise ValueError(f"is_cap must be > 0, got {cfg.is_cap}")
    if cfg.agg == "seq-mean-token-sum-norm" and cfg.max_response_len < 1:
        raise ValueError(f"max_response_len must be >= 1, got {cfg.max_response_len}")
    if total_tokens < 1 or total_samples < 1:
        raise ValueError(
            f"total_tokens={total_tokens}, total_samples={total_samples}: pass the real token "
            "and sequence counts of the whole batch (all ranks, all micro-batches), both >= 1"
        )
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, logprobs {tuple(logprobs.shape)}: "
                "they must match"
            )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = {tuple(logprobs.shape[:1])} (one per sequence), "
            f"got {tuple(advantages.shape)}"
        )
    if cfg.entropy_coef != 0 and others["entropy"] is None:
        raise ValueError("cfg.entropy_coef != 0 needs the per-token entropy: pass entropy=")
    if cfg.kl_coef != 0 and others["ref_logprobs"] is None:
        raise ValueError("cfg.kl_coef != 0 needs the reference log-probs: pass ref_logprobs=")


def _dual_clipped_surrogate(
    log_ratio: Tensor, adv: Tensor, cfg: LossConfig
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate −A·r per token, with the dual clip bound −A·c for A < 0 when
    cfg.dual_clip > 1; and where a clipped branch was taken (bool). log_ratio [B, T] is
    log π/π_old, adv [B, 1]; both results [B, T]."""
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()  # [B, T]
    unclipped = -adv * ratio  # [B, T]
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)  # [B, T]
    surrogate = torch.maximum(unclipped, clipped)  # [B, T]
    clip_active = clipped > unclipped  # [B, T] bool
    if cfg.dual_clip > 1.0:
        bound = -adv * cfg.dual_clip  # [B, 1]
        dual_active = (adv < 0) & (surrogate > bound)  # [B, T] bool
        surrogate = torch.where(dual_active, bound, surrogate)
        clip_active = clip_active | dual_active
    return surrogate, clip_active


def _importance_weight(is_log_ratio: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """The detached weight π_old/π_behaviour puts on a token's surrogate (tis: capped at
    is_cap; mask: 0 above is_cap, else 1; none: 1), and which tokens exceed is_cap.
    is_log_ratio [B, T] is log π_old − log π_behaviour (log space: no overflow)."""
    capped = is_log_ratio > math.log(cfg.is_cap)  # [B, T] bool
    if cfg.is_correction == "tis":
        return is_log_ratio.clamp(max=math.log(cfg.is_cap)).exp(), capped
    if cfg.is_correction == "mask":
        return (~capped).float(), capped
    return torch.ones_like(is_log_ratio), capped


def policy_loss(
    logprobs: Tensor,  # [B, T] current-policy log-probs of response tokens (requires grad)
    old_logprobs: Tensor,  # [B, T] π_old, detached (recomputed by the learner)
    behaviour_logprobs: Tensor,  # [B, T] log-probs from the actor that sampled the tokens
    advantages: Tensor,  # [B] one per sequence, broadcast to its tokens
    mask: Tensor,  # [B, T] float 1.0 real response token, 0.0 padding (a padding sequence is all 0)
    cfg: LossConfig,
    *,
    total_tokens: int,  # real response tokens of the WHOLE batch over all ranks/micro-batches
    total_samples: int,  # real sequences of the whole batch over all ranks/micro-batches
    entropy: Tensor | None = None,  # [B, T] per-token entropy, required when cfg.entropy_coef != 0
    ref_logprobs: Tensor | None = None,  # [B, T] frozen reference, required when cfg.kl_coef != 0
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the batch loss, and metric sums (METRICS, above).

    The loss divides by the batch's global totals, not the micro-batch's own counts, so that
    gradient accumulation over micro-batches and ranks equals one pass over the whole batch.
    Ratios are against π_old so PPO's trust region is measured from the policy being
    trained; the gap from π_old back to the behaviour policy that actually sampled (async
    actors lag) is corrected by a detached importance weight on the surrogate term only
    (entropy and KL regularise the current policy, not the data).
    """
    _check(cfg, logprobs, advantages, total_tokens, total_samples, old_logprobs=old_logprobs,
           behaviour_logprobs=behaviour_logprobs, mask=mask, entropy=entropy,
           ref_logprobs=ref_logprobs)  # fmt: skip
    logprobs = logprobs.float()  # [B, T]
    old = old_logprobs.detach().float()  # [B, T]
    mask = mask.float()  # [B, T]
    adv = advantages.detach().float().unsqueeze(-1)  # [B, 1]

    # 1. PPO surrogate against π_old, dual-clipped.
    surrogate, clip_active = _dual_clipped_surrogate(logprobs - old, adv, cfg)  # [B, T]
    # 2. Off-policy correction π_old / π_behaviour on the surrogate.
    is_weight, capped = _importance_weight(old - behaviour_logprobs.detach().float(), cfg)
    per_token = surrogate * is_weight  # [B, T]

    # 3. Regularisers of the current policy: entropy bonus, k3 KL to the frozen reference.
    metrics: dict[str, Tensor] = {}
    if entropy is not None:
        ent = entropy.float()  # [B, T]
        if cfg.entropy_coef != 0:
            per_token = per_token - cfg.entropy_coef * ent
        metrics["entropy_sum"] = (ent.detach() * mask).sum()
    if ref_logprobs is not None:
        ref_log_ratio = (ref_logprobs.detach().float() - logprobs).clamp(
            -_MAX_LOG_RATIO, _MAX_LOG_RATIO
        )  # [B, T]
        k3 = ref_log_ratio.exp() - ref_log_ratio - 1.0  # [B, T]
        if cfg.kl_coef != 0:
            per_token = per_token + cfg.kl_coef * k3
        metrics["kl_sum"] = (k3.detach() * mask).sum()

    # 4. This micro-batch's share of the batch loss, and the metric sums.
    loss = _AGGREGATIONS[cfg.agg](per_token, mask, cfg, total_tokens, total_samples)  # []
    with torch.no_grad():
        metrics["pg_clipped_tokens"] = (clip_active.float() * mask).sum()
        metrics["ppo_kl_sum"] = ((old - logprobs) * mask).sum()
        metrics["is_weight_sum"] = (is_weight * mask).sum()
        metrics["is_capped_tokens"] = (capped.float() * mask).sum()
    return loss, metrics


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy of softmax(z) per row without keeping softmax(z) alive: forward and backward
    rebuild the probabilities one chunk of rows at a time from z and its logsumexp."""

    @staticmethod
    def forward(ctx, z: Tensor) -> Tensor:
        # z: [N, V] -> entropy [N]
        lse = torch.logsumexp(z, dim=-1)  # [N]
        ent = torch.empty_like(lse)  # [N]
        rows = max(1, _ENTROPY_CHUNK_ELEMENTS // max(1, z.shape[-1]))
        for start in range(0, z.shape[0], rows):
            zc = z[start : start + rows]  # [n, V]
            p = (zc - lse[start : start + rows, None]).exp_()  # [n, V]
            ent[start : start + rows] = lse[start : start + rows] - (p * zc).sum(-1)
        ctx.save_for_backward(z, lse, ent)
        return ent

    @staticmethod
    def backward(ctx, grad_ent: Tensor) -> Tensor:
        # dH/dz_j = −p_j (log p_j + H)
        z, lse, ent = ctx.saved_tensors
        grad = torch.empty_like(z)  # [N, V]
        rows = max(1, _ENTROPY_CHUNK_ELEMENTS // max(1, z.shape[-1]))
        for start in range(0, z.shape[0], rows):
            stop = start + rows
            logp = z[start:stop] - lse[start:stop, None]  # [n, V]
            g = logp.exp() * (logp + ent[start:stop, None])  # [n, V]
            grad[start:stop] = g.mul_(-grad_ent[start:stop, None])
        return grad


def token_logprobs_and_entropy(
    logits: Tensor,  # [B, T, V] logits at the positions that predict each target
    targets: Tensor,  # [B, T] token ids
    temperature: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / temperature) at the targets ([B, T]) and optionally the entropy of
    that distribution ([B, T]); computed in float32 (float64 inputs stay float64).

    The sampling temperature must be the actors', or π_old and π_behaviour differ by more
    than staleness. Memory: one [B, T, V] scaled copy of the logits (kept for backward); the
    log-softmax is never materialised (gather − logsumexp) and the entropy rebuilds the
    softmax chunk by chunk in forward and backward.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and targets [B, T]; got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    scaled = logits.to(dtype)  # [B, T, V]; the one copy when logits are bf16/fp16
    if temperature != 1.0:
        scaled = scaled / temperature if scaled is logits else scaled.div_(temperature)
    lse = torch.logsumexp(scaled, dim=-1)  # [B, T]
    picked = scaled.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [B, T]
    logprobs = picked - lse  # [B, T]
    if not with_entropy:
        return logprobs, None
    entropy = _ChunkedEntropy.apply(scaled.reshape(-1, scaled.shape[-1]))  # [B·T]
    return logprobs, entropy.reshape(logprobs.shape)
