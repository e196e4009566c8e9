"""The statistics of the advantage-mode study (benchmarks/studies/study_advantage_modes.py).

    per-seed values ── mean_ci ──> mean, sd and 95 % Student-t interval over seeds
    paired differences ── mean_ci + significant ──> does the interval exclude 0
    paired log ratios ── ratio_ci ──> geometric-mean ratio and its interval
    per-seed wins ── sign_test ──> two-sided binomial p, ties left out
    paired differences ── paired_p ──> two-sided paired t-test p; several ── holm ──> adjusted

Pure functions of lists of floats, so the tables of docs/results.md can be checked by a
unit test against values worked out by hand. The t quantiles come from scipy, not from a
table typed in: the study's page must be reproducible from the recorded runs alone.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from scipy import stats

CONFIDENCE = 0.95


def t_quantile(df: int) -> float:
    """The two-sided 95 % Student-t quantile with `df` degrees of freedom (2.776 for 4)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 values (df >= 1), got df={df}")
    return float(stats.t.ppf(0.5 + CONFIDENCE / 2, df))


def mean_ci(values: list[float]) -> dict[str, Any]:
    """Mean, sample sd and 95 % Student-t interval over independent seeds. With one value
    there is no interval (lo, hi and sd are None); with none, no mean either."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "lo": None, "hi": None}
    mean = statistics.fmean(values)
    if n == 1:
        return {"n": 1, "mean": mean, "sd": None, "lo": None, "hi": None}
    sd = statistics.stdev(values)
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half}


def significant(ci: dict[str, Any]) -> dict[str, Any]:
    """The interval with `significant`: True when it excludes 0 (a paired difference)."""
    lo, hi = ci["lo"], ci["hi"]
    return {**ci, "significant": lo is not None and hi is not None and (lo > 0 or hi < 0)}


def paired_p(differences: Sequence[float]) -> float:
    """Two-sided p of a paired t-test that the mean difference is 0 (one value per seed)."""
    if len(differences) < 2:
        raise ValueError("a paired t-test needs at least 2 differences")
    return float(stats.ttest_1samp(list(differences), 0.0).pvalue)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of several p-values (same order as given): the family
    of contrasts one study reports, so "significant" means after the correction."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def ratio_ci(numerators: list[float], denominators: list[float]) -> dict[str, Any]:
    """A paired ratio over seeds: the t interval of the mean log ratio, exponentiated
    (a geometric mean ratio; `significant` when its interval excludes 1)."""
    if len(numerators) != len(denominators):
        raise ValueError("ratio_ci needs one numerator per denominator (paired by seed)")
    logs = [math.log(a / b) for a, b in zip(numerators, denominators)]
    ci = significant(mean_ci(logs))
    return {
        "n": ci["n"],
        "mean": None if ci["mean"] is None else math.exp(ci["mean"]),
        "lo": None if ci["lo"] is None else math.exp(ci["lo"]),
        "hi": None if ci["hi"] is None else math.exp(ci["hi"]),
        "significant": ci["significant"],
    }


def relative(ci: dict[str, Any], base: float) -> dict[str, Any]:
    """A difference and its interval in % of `base` (the paired difference over the
    baseline's mean), computed from the unrounded values."""
    if not base:
        raise ValueError("relative: the baseline mean is 0, no percentage exists")
    return {k: (None if ci.get(k) is None else 100.0 * ci[k] / base) for k in ("mean", "lo", "hi")}


def sign_test(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Per seed, is a > b? Wins, losses and ties, and the two-sided binomial p over the
    seeds that are not tied (4 wins, 0 losses, 1 tie: p = 2 / 2**4 = 0.125)."""
    if len(a) != len(b):
        raise ValueError("sign_test needs paired values (one a per b)")
    more = sum(x > y for x, y in zip(a, b))
    fewer = sum(x < y for x, y in zip(a, b))
    ties = len(a) - more - fewer
    p = float(stats.binomtest(more, more + fewer, 0.5).pvalue) if more + fewer else 1.0
    return {"more": more, "fewer": fewer, "ties": ties, "p": p}


def seeds_needed(mean: float, sd: float, limit: int = 10_000) -> int | None:
    """The fewest seeds n whose 95 % interval, t(n-1) * sd / sqrt(n), is narrower than
    |mean|: how many seeds it takes for this mean difference, at this spread, to come out
    significant half the time. None if sd is 0 or more than `limit` would be needed."""
    if not sd or not mean:
        return None
    for n in range(2, limit + 1):
        if t_quantile(n - 1) * sd / math.sqrt(n) < abs(mean):
            return n
    return None
