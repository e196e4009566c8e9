"""Retrieval for the search team: a Search Agent's `<search>query</search>` becomes the top-k
passages appended to the team context. Retrieval indexes the corpus it is given (a JSONL
path: retriever.corpus_path, or the one a team supplies); which corpus a task comes with
is the team's business (drmas/teams/search/kb.py).

    corpus.py    Passage, load_corpus (JSONL), corpus_fingerprint, the index cache
    bm25.py      BM25Retriever: bm25s over a local corpus
    dense.py     DenseRetriever: sentence embeddings + FAISS flat inner product
    http.py      HttpRetriever: client of a Search-R1-style /retrieve server
    server.py    `drmas retriever`: serves bm25 or dense over HTTP
    batching.py  BatchingRetriever: an actor's concurrent searches -> one batched call

Importing this package imports none of bm25s, faiss, torch: each retriever imports its
library when it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from drmas.config.retrieval import RetrieverConfig
from drmas.retrieval.corpus import CorpusError, Passage, corpus_fingerprint, load_corpus

__all__ = [
    "CorpusError",
    "Passage",
    "Retriever",
    "RetrieverConfig",
    "build_retriever",
    "corpus_fingerprint",
    "load_corpus",
    "resolve_corpus_path",
]


class Retriever(Protocol):
    def search(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        """One list per query, best first, at most top_k passages, `score` set."""
        ...

    def close(self) -> None: ...


def _bm25(cfg: RetrieverConfig, corpus: Path | None) -> Retriever:
    from drmas.retrieval.bm25 import BM25Retriever

    return BM25Retriever(_need_corpus(cfg, corpus))


def _dense(cfg: RetrieverConfig, corpus: Path | None) -> Retriever:
    from drmas.retrieval.dense import DenseRetriever

    return DenseRetriever(
        _need_corpus(cfg, corpus), model_path=cfg.dense_model or None, device=cfg.device
    )


def _http(cfg: RetrieverConfig, corpus: Path | None) -> Retriever:
    from drmas.retrieval.http import HttpRetriever

    if not cfg.url:
        raise ValueError(
            "retriever.name=http needs retriever.url (e.g. retriever.url=http://HOST:8000, "
            "a `drmas retriever` or Search-R1 retrieval server)"
        )
    return HttpRetriever(cfg.url, timeout_s=cfg.timeout_s)


BUILDERS: dict[str, Callable[[RetrieverConfig, Path | None], Retriever]] = {
    "bm25": _bm25,
    "dense": _dense,
    "http": _http,
}


def build_retriever(cfg: RetrieverConfig, corpus_path: str | Path | None) -> Retriever:
    """The retriever `cfg.name` names; bm25 and dense build (or load) their index over
    `corpus_path` here, which can take minutes the first time."""
    if cfg.name not in BUILDERS:
        raise ValueError(f"unknown retriever.name={cfg.name!r}; set one of {sorted(BUILDERS)}")
    return BUILDERS[cfg.name](cfg, Path(corpus_path) if corpus_path else None)


def _need_corpus(cfg: RetrieverConfig, corpus: Path | None) -> Path:
    if corpus is None:
        raise ValueError(
            f"retriever.name={cfg.name} needs a corpus: set retriever.corpus_path "
            "(a JSONL of id, title, text per line)"
        )
    return corpus


def resolve_corpus_path(
    cfg: RetrieverConfig, team_corpus: Callable[[], Path | None] | None = None
) -> Path | None:
    """The corpus the retriever indexes: None for http (the server has its own), else
    retriever.corpus_path (which must be a file), else the one the team supplies:
    `team_corpus()` is called only then, since it may generate one (the search team's
    knowledge base, drmas/teams/search/kb.py:search_corpus)."""
    if cfg.name == "http":
        return None
    if cfg.corpus_path:
        path = Path(cfg.corpus_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"retriever.corpus_path {str(path)!r} is not a file; set retriever.corpus_path "
                "to a JSONL corpus (id, title, text per line)"
            )
        return path
    supplied = team_corpus() if team_corpus is not None else None
    if supplied is None:
        raise ValueError(
            f"retriever.name={cfg.name} has no corpus: set retriever.corpus_path (a JSONL of "
            "id, title, text per line), or use a team that supplies one (the search team "
            "generates its knowledge base's for task.name=kb)"
        )
    return Path(supplied)
