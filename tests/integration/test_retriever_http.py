"""`drmas retriever` as a real process: serves the bm25 index of a corpus over HTTP, gives
the same passages and scores as the in-process retriever, and stops on SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from drmas.retrieval.bm25 import BM25Retriever
from drmas.retrieval.http import HttpRetriever
from drmas.transports.ports import free_port
from tests.integration.conftest import REPO, retriever_healthy, wait_for
from tests.unit.test_retrieval import write_corpus


def test_drmas_retriever_serves_what_bm25_finds(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl", n=500)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "drmas.launch.cli", "retriever", f"retriever.corpus_path={corpus}",
         f"retriever.port={port}", "retriever.top_k=2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        wait_for(
            lambda: retriever_healthy(url), 60, "drmas retriever never answered /health", server
        )
        queries = ["Zorvath Quell", "where was Zorvath Quell born", "qwxyzzy", "born in"]
        served = HttpRetriever(url, timeout_s=10).search(queries, 3)
        local = BM25Retriever(corpus)  # the server built the index: this one loads it
        assert not local.built
        assert served == local.search(queries, 3)
        assert served[0][0].id == served[1][0].id == "planted"
        assert served[2] == []
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=30)
    assert server.returncode == 0, out[-3000:]
    assert url in out and "stopped" in out


def test_drmas_retriever_refuses_http_and_a_missing_corpus(tmp_path: Path) -> None:
    def run(*overrides: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "drmas.launch.cli", "retriever", *overrides],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    out = run("retriever.name=http", "retriever.url=http://127.0.0.1:1")
    assert out.returncode == 2 and "retriever.name=bm25" in out.stderr
    out = run(f"retriever.corpus_path={tmp_path / 'missing.jsonl'}")
    assert out.returncode == 2 and "retriever.corpus_path" in out.stderr
