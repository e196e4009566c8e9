"""`drmas train experiment=search_tiny` end to end: three non-shared tiny models (Verifier,
Search Agent, Answer Agent), bm25 over the generated knowledge-base corpus, a real broker,
gloo learners and an hf actor on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import drmas, read_metrics, read_summary

pytestmark = pytest.mark.slow

AGENTS = ("verifier", "searcher", "answerer")
STEPS = 3
SMALL = [
    "experiment=search_tiny",
    f"train.steps={STEPS}",
    "group_size=3",
    "batch_groups=2",
    "val.every=3",
    "val.num_tasks=4",
    "val.n=2",
    "val.k=2",
    "broker.heartbeat_timeout_s=8",
    "weights.timeout_s=20",
    # a short warm start: enough to write the tags sometimes, so searches happen
    *(f"models.{m}.warmstart.steps=300" for m in AGENTS),
    # one build for all three (the Search Agent's own warm start is a second build)
    "models.searcher.warmstart.workflow=search",
]


def test_search_tiny_trains_three_models_with_real_retrieval(
    tmp_path: Path, model_cache: Path
) -> None:
    run_dir = tmp_path / "run"
    out = drmas("train", *SMALL, f"run.dir={run_dir}", f"run.cache_dir={model_cache}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    lines = read_metrics(run_dir)
    train = [x for x in lines if "val/tasks" not in x]
    assert [x["step"] for x in train] == list(range(1, STEPS + 1))
    for line in train:
        for agent in AGENTS:
            assert f"reward/{agent}/mean" in line or f"advantage/{agent}/std" in line
        for model in AGENTS:
            assert f"loss/{model}" in line and f"grad_norm/{model}" in line
    # rollout/* are means over the episodes accepted since the previous line: a line
    # written before any new group arrived (often the last) has none
    rollout = [x for x in train if "rollout/em" in x]
    assert rollout
    for line in rollout:
        for key in ("em", "f1", "answered", "search_calls", "turns", "invalid_actions"):
            assert f"rollout/{key}" in line
        assert 1.0 <= line["rollout/turns"] <= 3.0  # search_tiny: max_turns=3
        assert 0.0 <= line["rollout/search_calls"] <= 2.0
        assert 0.0 <= line["rollout/f1"] <= 1.0
    # the Search Agent did search (the warm start taught it the tag), so bm25 ran
    assert sum(x["rollout/search_calls"] for x in rollout) > 0
    val = [x for x in lines if "val/tasks" in x]
    assert {x["step"] for x in val} >= {0, STEPS}
    for line in val:
        assert {"val/avg@2", "val/pass@2", "val/em", "val/f1", "val/search_calls"} <= set(line)

    summary = read_summary(run_dir)
    c = summary["counters"]
    assert c.get("groups_trained_twice", 0) == 0
    assert c.get("weight_digest_mismatch", 0) == 0
    for model in AGENTS:
        assert summary["trained_groups"][model] == STEPS * 2

    # the run's config points at the generated corpus, whose bm25 index was built once,
    # next to it, before the actors started
    cfg = (run_dir / "config.yaml").read_text()
    corpus = Path(cfg.split("corpus_path: ", 1)[1].split("\n", 1)[0].strip("'\""))
    assert corpus.is_file() and corpus.is_relative_to(model_cache)
    passages = [json.loads(line) for line in corpus.read_text().splitlines()]
    assert passages and {"id", "title", "text"} <= set(passages[0])
