"""policy_loss and token_logprobs_and_entropy: hand-derived values, gradient accumulation over
micro-batches, and a comparison with torch.distributions.Categorical."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from drmas.config.learner import LossConfig
from drmas.learners import loss as loss_module
from drmas.learners.loss import policy_loss, token_logprobs_and_entropy

torch.set_num_threads(1)

LN = math.log


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _call(
    cur: list[list[float]],
    adv: list[float],
    cfg: LossConfig,
    *,
    old: list[list[float]] | None = None,
    behaviour: list[list[float]] | None = None,
    mask: list[list[float]] | None = None,
    total_tokens: int | None = None,
    total_samples: int | None = None,
    **kw: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    logprobs = _t(cur).requires_grad_(True)
    old_t = _t(old) if old is not None else logprobs.detach().clone()
    beh_t = _t(behaviour) if behaviour is not None else old_t.clone()
    mask_t = _t(mask) if mask is not None else torch.ones_like(old_t)
    loss, metrics = policy_loss(
        logprobs,
        old_t,
        beh_t,
        torch.tensor(adv),
        mask_t,
        cfg,
        total_tokens=total_tokens if total_tokens is not None else int(mask_t.sum()),
        total_samples=total_samples if total_samples is not None else len(cur),
        **kw,
    )
    loss.backward()
    assert logprobs.grad is not None
    return loss, metrics, logprobs.grad


def test_ratio_one_gives_minus_advantage() -> None:
    # r = 1 everywhere (cur = old = behaviour): per-token loss −A.
    # A = (1.5, −0.5), 3 tokens each: token-mean = (3·(−1.5) + 3·0.5)/6 = −3/6 = −0.5.
    # d loss / d logprob = −A·r/6 → −0.25 on sequence 0, +0.5/6 on sequence 1.
    cur = [[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]]
    loss, m, grad = _call(cur, [1.5, -0.5], LossConfig())
    assert loss.item() == pytest.approx(-0.5)
    torch.testing.assert_close(grad, _t([[-0.25] * 3, [0.5 / 6] * 3]))
    assert m["pg_clipped_tokens"].item() == 0
    assert m["ppo_kl_sum"].item() == pytest.approx(0.0)
    assert m["is_weight_sum"].item() == pytest.approx(6.0)  # w = 1 on 6 tokens
    assert m["is_capped_tokens"].item() == 0
    assert "entropy_sum" not in m and "kl_sum" not in m


@pytest.mark.parametrize(
    ("adv", "ratio", "expected", "clipped", "grad_flows"),
    [
        # A > 0, r = 1.5 above 1 + 0.2: max(−1.5, −1.2) = −1.2, clipped, no gradient.
        (1.0, 1.5, -1.2, True, False),
        # A > 0, r = 0.5 below 1 − 0.2: max(−0.5, −0.8) = −0.5, unclipped branch wins.
        (1.0, 0.5, -0.5, False, True),
        # A < 0, r = 0.5: max(0.5, 0.8) = 0.8, clipped at 1 − 0.2, no gradient.
        (-1.0, 0.5, 0.8, True, False),
        # A < 0, r = 1.1 inside the range: 1.1.
        (-1.0, 1.1, 1.1, False, True),
        # A < 0, r = 1.5: max(1.5, 1.2) = 1.5 (the surrogate keeps the larger loss), < 3.
        (-1.0, 1.5, 1.5, False, True),
        # Dual clip: A = −1, r = 5: max(5, 1.2) = 5 > −A·c = 3 → 3, no gradient.
        (-1.0, 5.0, 3.0, True, False),
        # Dual clip: A = −2, r = 4: max(8, 2.4) = 8 > 6 → 6.
        (-2.0, 4.0, 6.0, True, False),
        # A = −2, r = 2.9: 5.8 < 6, unclipped.
        (-2.0, 2.9, 5.8, False, True),
    ],
)
def test_clipping(
    adv: float, ratio: float, expected: float, clipped: bool, grad_flows: bool
) -> None:
    old = -1.0
    loss, m, grad = _call([[old + LN(ratio)]], [adv], LossConfig(), old=[[old]])
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["pg_clipped_tokens"].item() == float(clipped)
    # ppo_kl_sum = old − cur = −ln r
    assert m["ppo_kl_sum"].item() == pytest.approx(-LN(ratio), abs=1e-6)
    if grad_flows:
        # d(−A·r)/d logprob = −A·r
        assert grad.item() == pytest.approx(-adv * ratio, rel=1e-5)
    else:
        assert grad.item() == 0.0


def test_dual_clip_disabled() -> None:
    # dual_clip <= 1: A = −1, r = 5 keeps max(5, 1.2) = 5.
    for c in (1.0, 0.0):
        loss, m, _ = _call([[LN(5.0)]], [-1.0], LossConfig(dual_clip=c), old=[[0.0]])
        assert loss.item() == pytest.approx(5.0, rel=1e-5)
        assert m["pg_clipped_tokens"].item() == 0


def test_asymmetric_clip() -> None:
    # clip_high = 0.28: A = 1, r = 1.5 → −1.28; clip_low = 0.1: A = −1, r = 0.5 → 0.9.
    cfg = LossConfig(clip_low=0.1, clip_high=0.28)
    loss, _, _ = _call([[LN(1.5)]], [1.0], cfg, old=[[0.0]])
    assert loss.item() == pytest.approx(-1.28, rel=1e-5)
    loss, _, _ = _call([[LN(0.5)]], [-1.0], cfg, old=[[0.0]])
    assert loss.item() == pytest.approx(0.9, rel=1e-5)


def test_extreme_log_ratio_stays_finite() -> None:
    # r = e^60 would overflow float32; the dual clip bounds the loss at −A·c = 3 and the
    # gradient is 0, not NaN.
    loss, _, grad = _call([[0.0]], [-1.0], LossConfig(), old=[[-60.0]])
    assert loss.item() == pytest.approx(3.0)
    assert grad.item() == 0.0


# Off-policy correction. r = 1 (cur = old = 0), A = 1 → surrogate −1 per token.
# old − behaviour = ln 1.5 → π_old/π_b = 1.5 ; ln 3 → 3 > C = 2 ; ln 0.5 → 0.5.
IS_BEHAVIOUR = [[-LN(1.5), -LN(3.0), -LN(0.5)]]


@pytest.mark.parametrize(
    ("mode", "weights"),
    [
        ("tis", [1.5, 2.0, 0.5]),  # min(ratio, 2)
        ("mask", [1.0, 0.0, 1.0]),  # drop the token above C
        ("none", [1.0, 1.0, 1.0]),
    ],
)
def test_importance_correction(mode: str, weights: list[float]) -> None:
    cfg = LossConfig(is_correction=mode)
    loss, m, grad = _call([[0.0, 0.0, 0.0]], [1.0], cfg, old=[[0.0] * 3], behaviour=IS_BEHAVIOUR)
    # token-mean over 3 tokens of −w: −Σw/3 ; gradient −A·r·w/3 = −w/3.
    assert loss.item() == pytest.approx(-sum(weights) / 3, rel=1e-5)
    torch.testing.assert_close(grad, _t([[-w / 3 for w in weights]]))
    assert m["is_weight_sum"].item() == pytest.approx(sum(weights), rel=1e-5)
    assert m["is_capped_tokens"].item() == 1  # the ratio-3 token, in every mode


def test_is_cap_configurable() -> None:
    # C = 4: ratios 1.5, 3, 0.5 are all under the cap → weights as they are.
    cfg = LossConfig(is_cap=4.0)
    loss, m, _ = _call([[0.0] * 3], [1.0], cfg, old=[[0.0] * 3], behaviour=IS_BEHAVIOUR)
    assert loss.item() == pytest.approx(-(1.5 + 3.0 + 0.5) / 3, rel=1e-5)
    assert m["is_capped_tokens"].item() == 0


# Aggregation. r = 1, A = (1, −2): per-token loss −1 on sequence 0 (3 real tokens) and +2 on
# sequence 1 (2 real tokens); padding positions hold garbage log-probs that must not count.
AGG_CUR = [[0.0, 0.0, 0.0, 7.0], [0.0, 0.0, -9.0, 3.0]]
AGG_OLD = [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
AGG_MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    ("agg", "totals", "expected"),
    [
        # Σ loss / tokens = (−3 + 4)/5 = 0.2
        ("token-mean", (5, 2), 0.2),
        # with global totals of a larger batch: (−3 + 4)/10 = 0.1
        ("token-mean", (10, 4), 0.1),
        # per sequence mean: −3/3 = −1, 4/2 = 2 ; (−1 + 2)/2 = 0.5
        ("seq-mean-token-mean", (5, 2), 0.5),
        # (−1 + 2)/4 = 0.25
        ("seq-mean-token-mean", (10, 4), 0.25),
        # per sequence sum / L (L = 8): −3/8, 4/8 ; (−3/8 + 4/8)/2 = 1/16
        ("seq-mean-token-sum-norm", (5, 2), 1 / 16),
    ],
)
def test_aggregation(agg: str, totals: tuple[int, int], expected: float) -> None:
    cfg = LossConfig(agg=agg, max_response_len=8)
    loss, m, grad = _call(
        AGG_CUR,
        [1.0, -2.0],
        cfg,
        old=AGG_OLD,
        mask=AGG_MASK,
        total_tokens=totals[0],
        total_samples=totals[1],
    )
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert (grad * (1 - _t(AGG_MASK))).abs().sum().item() == 0.0  # no gradient into padding
    assert m["ppo_kl_sum"].item() == 0.0  # padding's garbage ratios are not in the metrics
    assert m["is_weight_sum"].item() == 5.0


def test_padding_sequence_contributes_nothing() -> None:
    # A third, all-padding row: seq-mean-token-mean divides its 0 by max(1, 0) (no NaN).
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        cfg = LossConfig(agg=agg, max_response_len=8)
        base, _, _ = _call(
            AGG_CUR, [1.0, -2.0], cfg, old=AGG_OLD, mask=AGG_MASK, total_tokens=5, total_samples=2
        )
        padded, _, grad = _call(
            [*AGG_CUR, [4.0, 4.0, 4.0, 4.0]],
            [1.0, -2.0, 0.0],
            cfg,
            old=[*AGG_OLD, [0.0] * 4],
            mask=[*AGG_MASK, [0.0] * 4],
            total_tokens=5,
            total_samples=2,
        )
        assert padded.item() == pytest.approx(base.item())
        assert torch.isfinite(grad).all()


def test_entropy_bonus() -> None:
    # A = 0 → surrogate 0; entropy 2.0 per token, coef 0.1 → per token −0.2 → token-mean −0.2.
    # entropy_sum = 2.0 · 3 real tokens = 6 (the padding token's 100 is ignored).
    cfg = LossConfig(entropy_coef=0.1)
    entropy = _t([[2.0, 2.0, 2.0, 100.0]])
    loss, m, _ = _call([[0.0] * 4], [0.0], cfg, mask=[[1, 1, 1, 0]], entropy=entropy)
    assert loss.item() == pytest.approx(-0.2)
    assert m["entropy_sum"].item() == pytest.approx(6.0)
    # With coef 0 the entropy is only measured.
    loss, m, _ = _call([[0.0] * 4], [0.0], LossConfig(), mask=[[1, 1, 1, 0]], entropy=entropy)
    assert loss.item() == 0.0
    assert m["entropy_sum"].item() == pytest.approx(6.0)


def test_entropy_gradient_flows() -> None:
    # d(−c·H)/dH = −c / total_tokens = −0.1/2.
    entropy = torch.tensor([[1.0, 3.0]], requires_grad=True)
    _call([[0.0, 0.0]], [0.0], LossConfig(entropy_coef=0.1), entropy=entropy)
    assert entropy.grad is not None
    torch.testing.assert_close(entropy.grad, torch.full((1, 2), -0.05))


def test_kl_k3() -> None:
    # ref − cur = ln 2 → k3 = e^{ln 2} − ln 2 − 1 = 1 − ln 2 ≈ 0.30685; coef 0.5, A = 0:
    # token-mean = 0.5·(1 − ln 2). Gradient of k3 w.r.t. cur: −e^{ref−cur} + 1 = −1 → ·0.5/2.
    cfg = LossConfig(kl_coef=0.5)
    ref = _t([[LN(2.0) - 1.0, LN(2.0) - 2.0]])
    loss, m, grad = _call([[-1.0, -2.0]], [0.0], cfg, ref_logprobs=ref)
    assert loss.item() == pytest.approx(0.5 * (1 - LN(2.0)), rel=1e-5)
    assert m["kl_sum"].item() == pytest.approx(2 * (1 - LN(2.0)), rel=1e-5)
    torch.testing.assert_close(grad, torch.full((1, 2), -0.25))
    # ref = cur → k3 = 1 − 0 − 1 = 0.
    loss, m, _ = _call([[-1.0, -2.0]], [0.0], cfg, ref_logprobs=_t([[-1.0, -2.0]]))
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    assert m["kl_sum"].item() == pytest.approx(0.0, abs=1e-7)


def test_metrics_are_detached_scalars() -> None:
    cfg = LossConfig(entropy_coef=0.1, kl_coef=0.1)
    logprobs = torch.zeros(2, 3, requires_grad=True)
    _, m = policy_loss(
        logprobs,
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.ones(2),
        torch.ones(2, 3),
        cfg,
        total_tokens=6,
        total_samples=2,
        entropy=torch.ones(2, 3, requires_grad=True),
        ref_logprobs=torch.zeros(2, 3),
    )
    assert set(m) == {
        "pg_clipped_tokens",
        "ppo_kl_sum",
        "is_weight_sum",
        "is_capped_tokens",
        "entropy_sum",
        "kl_sum",
    }
    for value in m.values():
        assert value.shape == () and not value.requires_grad


@pytest.mark.parametrize(
    ("cfg", "kw", "message"),
    [
        (LossConfig(agg="seq-sum"), {}, "unknown loss agg"),
        (LossConfig(is_correction="clip"), {}, "unknown is_correction"),
        (LossConfig(is_cap=0.0), {}, "is_cap"),
        (LossConfig(entropy_coef=0.01), {}, "entropy="),
        (LossConfig(kl_coef=0.01), {}, "ref_logprobs="),
        (LossConfig(), {"total_tokens": 0}, "total_tokens=0"),
        (LossConfig(), {"advantages": torch.ones(2, 3)}, "advantages must be"),
        (LossConfig(), {"mask": torch.ones(2, 4)}, "mask has shape"),
    ],
)
def test_validation(cfg: LossConfig, kw: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "logprobs": torch.zeros(2, 3),
        "old_logprobs": torch.zeros(2, 3),
        "behaviour_logprobs": torch.zeros(2, 3),
        "advantages": torch.ones(2),
        "mask": torch.ones(2, 3),
        "cfg": cfg,
        "total_tokens": 6,
        "total_samples": 2,
    }
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        policy_loss(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("mode", ["tis", "mask", "none"])
def test_micro_batches_sum_to_whole_batch(agg: str, mode: str) -> None:
    # Summing micro-batch losses computed with the batch's global totals must give the loss and
    # the gradient of one pass over the whole batch, however the batch is split.
    gen = torch.Generator().manual_seed(0)
    b, t = 7, 6
    lengths = torch.tensor([6, 3, 0, 1, 5, 6, 2])  # row 2 is a padding sequence
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    base = -torch.rand(b, t, generator=gen) * 2
    old = base + 0.3 * torch.randn(b, t, generator=gen)
    behaviour = old + 0.8 * torch.randn(b, t, generator=gen)
    ref = base + 0.2 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, generator=gen)
    entropy_in = torch.rand(b, t, generator=gen)
    cfg = LossConfig(
        agg=agg, is_correction=mode, entropy_coef=0.01, kl_coef=0.05, max_response_len=t
    )
    totals = {"total_tokens": int(mask.sum()), "total_samples": int((lengths > 0).sum())}

    def run(rows: slice, params: torch.Tensor, ent: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return policy_loss(
            params[rows],
            old[rows],
            behaviour[rows],
            adv[rows],
            mask[rows],
            cfg,
            entropy=ent[rows],
            ref_logprobs=ref[rows],
            **totals,
        )

    whole_p = base.clone().requires_grad_(True)
    whole_e = entropy_in.clone().requires_grad_(True)
    whole, whole_m = run(slice(None), whole_p, whole_e)
    whole.backward()

    split_p = base.clone().requires_grad_(True)
    split_e = entropy_in.clone().requires_grad_(True)
    total = torch.zeros(())
    sums: dict[str, torch.Tensor] = {}
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7)):
        part, part_m = run(rows, split_p, split_e)
        part.backward()
        total = total + part.detach()
        for k, v in part_m.items():
            sums[k] = sums.get(k, torch.zeros(())) + v

    torch.testing.assert_close(total, whole.detach(), atol=1e-6, rtol=1e-5)
    assert whole_p.grad is not None and split_p.grad is not None
    torch.testing.assert_close(split_p.grad, whole_p.grad, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(split_e.grad, whole_e.grad, atol=1e-7, rtol=1e-5)
    for k, v in whole_m.items():
        torch.testing.assert_close(sums[k], v, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# token_logprobs_and_entropy
# ---------------------------------------------------------------------------------------------
def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple:
    dist = torch.distributions.Categorical(logits=logits / temperature)
    return dist.log_prob(targets), dist.entropy()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_logprobs_and_entropy_match_categorical(temperature: float) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=gen) * 3
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    w_lp = torch.randn(3, 5, generator=gen)
    w_ent = torch.randn(3, 5, generator=gen)

    ours_in = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(ours_in, targets, temperature, with_entropy=True)
    assert ent is not None
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()

    ref_in = logits.clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(ref_in, targets, temperature)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()

    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_in.detach(), logits)  # the caller's logits are untouched


def test_without_entropy() -> None:
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    lp, ent = token_logprobs_and_entropy(logits, targets, 1.0, with_entropy=False)
    assert ent is None
    torch.testing.assert_close(lp, _reference(logits, targets, 1.0)[0])


def test_bfloat16_logits_computed_in_float32_and_untouched() -> None:
    logits = (torch.randn(2, 4, 9) * 2).to(torch.bfloat16)
    before = logits.clone()
    targets = torch.randint(0, 9, (2, 4))
    lp, ent = token_logprobs_and_entropy(logits, targets, 0.6, with_entropy=True)
    assert lp.dtype == torch.float32 and ent is not None and ent.dtype == torch.float32
    ref_lp, ref_ent = _reference(logits.float(), targets, 0.6)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits, before)


def test_entropy_gradcheck_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of 2 rows (V = 3 → 7 // 3) so forward and backward cross chunk boundaries.
    monkeypatch.setattr(loss_module, "_ENTROPY_CHUNK_ELEMENTS", 7)
    logits = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(loss_module._ChunkedEntropy.apply, (logits,))
    targets = torch.randint(0, 3, (1, 5))
    _, ent = token_logprobs_and_entropy(logits.detach()[None], targets, 0.9, with_entropy=True)
    torch.testing.assert_close(ent, _reference(logits.detach()[None], targets, 0.9)[1])


def test_logprobs_validation() -> None:
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(torch.zeros(1, 2, 3), torch.zeros(1, 2), 0.0, False)
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        token_logprobs_and_entropy(torch.zeros(2, 3), torch.zeros(2), 1.0, False)


def test_config_is_not_mutated() -> None:
    cfg = LossConfig()
    before = replace(cfg)
    _call([[0.0]], [1.0], cfg)
    assert cfg == before


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_a_loss_weight_folded_into_the_advantage_weights_each_samples_surrogate(agg: str) -> None:
    """algorithm.advantage.balance_calls weights a sample's policy-gradient loss by scaling
    its advantage: exact because the dual-clipped, importance-weighted surrogate is
    positively homogeneous in the advantage. Checked per sample against its loss alone,
    with ratios inside and outside the clip range, both signs, and the behaviour gap."""
    cfg = LossConfig(agg=agg, max_response_len=3)
    cur = [[LN(1.5), LN(0.7), -0.2], [LN(0.5), LN(1.1), -0.1], [LN(4.0), LN(0.9), 0.0]]
    old = [[0.0, 0.0, -0.1], [0.0, 0.0, 0.0], [0.0, 0.0, 0.1]]
    beh = [[-0.1, 0.0, -0.1], [0.2, 0.0, 0.0], [0.0, -0.3, 0.1]]
    mask = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    adv, w = [0.8, -1.2, -0.6], [0.5, 1.5, 2.0]
    totals = {"total_tokens": 8, "total_samples": 3}
    weighted, _, grad = _call(cur, [a * x for a, x in zip(adv, w)], cfg, old=old, behaviour=beh,
                              mask=mask, **totals)  # fmt: skip
    parts = [
        _call([cur[i]], [adv[i]], cfg, old=[old[i]], behaviour=[beh[i]], mask=[mask[i]], **totals)
        for i in range(3)
    ]
    assert float(weighted) == pytest.approx(
        sum(x * float(p[0]) for x, p in zip(w, parts)), rel=1e-6
    )
    for i, (x, p) in enumerate(zip(w, parts)):
        assert torch.allclose(grad[i], x * p[2][0], rtol=1e-5, atol=1e-7)
