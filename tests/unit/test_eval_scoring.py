"""`drmas eval` without engines: the per-source table (unbiased pass@k, standard errors) and
the errors for weights it cannot find."""

from __future__ import annotations

from pathlib import Path

import pytest

from drmas.config import load_config
from drmas.launch.evaluate import EvalError, EvalSettings, choose_weights, format_table, score
from drmas.protocol.messages import Task


def test_scores_per_source_with_the_unbiased_estimator() -> None:
    s = EvalSettings(k=2, n=4)
    a0, a1 = Task("a:0", "q", "x", "aime"), Task("a:1", "q", "x", "aime")
    m0 = Task("m:0", "q", "x", "math500")
    results = [
        (a0, [1.0, 0.0, 0.0, 0.0], [{"turns": 1.0}] * 4),  # c = 1 of 4
        (a1, [0.0, 0.0, 0.0, 0.0], [{"turns": 3.0}] * 4),
        (m0, [1.0, 1.0, 0.3, 1.0], [{"turns": 2.0}] * 4),  # 0.3 is no success
    ]
    report = score(results, s)
    aime = report["sources"]["aime"]
    assert aime["tasks"] == 2
    assert aime["pass@2"] == pytest.approx((1 - 3 / 6 + 0.0) / 2)  # 1 - C(3,2)/C(4,2) = 0.5
    assert aime["avg@2"] == pytest.approx((0.25 + 0.0) / 2)
    assert aime["avg@2/se"] == pytest.approx(0.125)  # std of [0.25, 0] / sqrt(2)
    assert report["sources"]["math500"]["pass@2"] == 1.0
    overall = report["overall"]
    assert overall["tasks"] == 3 and overall["avg@2"] == pytest.approx((0.25 + 0 + 0.75) / 3)
    assert overall["turns"] == pytest.approx(2.0)
    assert not any(key.startswith(("aime/", "math500/")) for key in overall)
    assert report["per_task"] == {"a:0": 1, "a:1": 0, "m:0": 3}
    table = format_table({"settings": {"k": 2}, **report})
    assert "| aime | 2 | 0.125 ± 0.125 | 0.250 ± 0.250 |" in table
    assert "| all | 3 |" in table and "turns 2.000" in table


def test_weights_it_cannot_find_are_explained(tmp_path: Path) -> None:
    cfg = load_config([])
    with pytest.raises(EvalError, match=r"neither a model .* nor an agent"):
        choose_weights(cfg, None, None, {"critic": str(tmp_path)})
    with pytest.raises(EvalError, match="no Hugging Face folder"):
        choose_weights(cfg, None, None, {"solver": str(tmp_path)})
    with pytest.raises(EvalError, match="--step needs a run folder"):
        choose_weights(cfg, None, 3, {})
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(EvalError, match=r"no checkpoint at step 3 \(has \[\]\)"):
        choose_weights(cfg, tmp_path, 3, {})
