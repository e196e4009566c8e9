"""`experiment=search` (the paper's setup) on a GPU, end to end (marker `gpu`). Run by
scripts/gpu_check.sh.

Everything of the paper's config that runs without downloads: its workflow (chat prompt
style is swapped for plain, since the tiny builtin models have no chat template), vLLM
actors when vllm is installed (else the hf engine, on CUDA, as on the GPU machine this
project gets), an HTTP retriever (`drmas
retriever` serving bm25 over the generated knowledge-base corpus, started here), bf16
learners on CUDA. The three 3B models become warm-started tiny search models and the
NQ/HotpotQA files the synthetic kb task. Checked: the run finishes, every batch trained
once, every weight load verified, and the Search Agent's queries reached the server.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drmas.transports.ports import free_port
from tests.integration.conftest import (
    REPO,
    drmas,
    read_metrics,
    read_summary,
    retriever_healthy,
    wait_for,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(300),
]

AGENTS = ("verifier", "searcher", "answerer")
STEPS = 2


def test_search_experiment_on_gpu_with_http_retriever(tmp_path: Path) -> None:
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    server = subprocess.Popen(
        [sys.executable, "-m", "drmas.launch.cli", "retriever", "experiment=search_tiny",
         f"run.cache_dir={cache}", f"retriever.port={port}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(
            lambda: retriever_healthy(url), 120, "drmas retriever never answered /health", server
        )
        out = drmas(
            "train",
            "experiment=search",
            "task.name=kb",
            "workflow.prompt_style=plain",
            f"retriever.url={url}",
            f"actor.engine.name={engine}",
            "actor.engine.device=cuda",
            "actor.engine.max_model_len=512",
            "actor.engine.gpu_memory_utilization=0.2",
            "learner.device=cuda",
            "placement.learner_memory=0.1",  # three tiny learners share a GPU with 3 engines
            *(f"models.{m}.path=builtin:tiny-qwen2" for m in AGENTS),
            *(f"models.{m}.lr=1e-4" for m in AGENTS),
            *(f"models.{m}.warmstart.workflow=search" for m in AGENTS),
            *(f"models.{m}.warmstart.steps=200" for m in AGENTS),
            *(f"models.{m}.warmstart.batch_size=16" for m in AGENTS),
            *(f"models.{m}.warmstart.lr=1e-3" for m in AGENTS),
            "group_size=5",
            "batch_groups=4",
            f"train.steps={STEPS}",
            "sampling.max_new_tokens=32",
            "algorithm.loss.max_response_len=32",
            "val.every=2",
            "val.num_tasks=8",
            "val.n=2",
            "val.k=2",
            f"run.dir={run_dir}",
            f"run.cache_dir={cache}",
            timeout=270,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=30)
    summary = read_summary(run_dir)
    c = summary["counters"]
    assert c.get("groups_trained_twice", 0) == 0 and c.get("weight_digest_mismatch", 0) == 0
    for model in AGENTS:
        assert summary["trained_groups"][model] == STEPS * 4
    rollout = [x for x in read_metrics(run_dir) if "rollout/search_calls" in x]
    assert sum(x["rollout/search_calls"] for x in rollout) > 0  # queries went over HTTP
    print(f"\nexperiment=search on GPU ({engine}): {summary['counters']}")
