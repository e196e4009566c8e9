"""drmas.retrieval: corpus loading, bm25 and dense retrieval of a planted fact, the index
cache, the HTTP client's errors, the server's API, and batching of concurrent searches."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from drmas.retrieval import (
    CorpusError,
    Passage,
    RetrieverConfig,
    build_retriever,
    corpus_fingerprint,
    load_corpus,
    resolve_corpus_path,
)
from drmas.retrieval.batching import BatchingRetriever
from drmas.retrieval.http import HttpRetriever, RetrieverError
from drmas.transports.ports import free_port
from tests.fixtures.waiting import wait_until

PLANTED = {"id": "planted", "title": "Zorvath Quell", "text": "Zorvath Quell was born in Miravel."}
SYLLABLES = ["ka", "lo", "mi", "ra", "te", "vu", "son", "dar", "bel", "nor", "fen", "pim"]
FACTS = [
    "{p} was born in {c}.",
    "{p} works as a {j} in {c}.",
    "{p} is married to {q}.",
    "{p} studied music in {c}.",
]


def write_corpus(path: Path, n: int = 500, seed: int = 0) -> Path:
    """n made-up people facts (the same sentence shapes as the planted one), the planted
    passage in the middle."""
    rng = random.Random(seed)

    def name() -> str:
        return "".join(rng.choice(SYLLABLES) for _ in range(2)).capitalize()

    rows = []
    for i in range(n):
        person = f"{name()} {name()}"
        fact = rng.choice(FACTS).format(
            p=person, c=name(), j=rng.choice(["baker", "pilot", "weaver"]), q=f"{name()} {name()}"
        )
        rows.append({"id": f"d{i}", "title": person, "text": fact})
    rows.insert(n // 2, PLANTED)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


# ---------------------------------------------------------------------------------------
# corpus


def test_load_corpus_both_forms(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps({"id": 1, "title": "A", "text": "alpha"})
        + "\n\n"  # blank lines are skipped
        + json.dumps({"id": "w2", "contents": '"Bo Taki"\nBo Taki was born in Lumo.\nA baker.'})
        + "\n"
    )
    assert load_corpus(path) == [
        Passage("1", "A", "alpha"),
        Passage("w2", "Bo Taki", "Bo Taki was born in Lumo.\nA baker."),
    ]


def test_corpus_errors_name_file_line_and_key(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(PLANTED) + "\n" + json.dumps({"id": "x", "title": "T"}) + "\n")
    with pytest.raises(CorpusError, match=r"c\.jsonl, line 2: missing key 'text'"):
        load_corpus(path)
    path.write_text("{not json\n")
    with pytest.raises(CorpusError, match="line 1: not JSON"):
        load_corpus(path)
    path.write_text("\n")
    with pytest.raises(CorpusError, match="no passages"):
        load_corpus(path)


def test_fingerprint_is_sha256_of_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"abc")
    # sha256("abc"), FIPS 180-2 appendix B.1
    assert corpus_fingerprint(path) == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


# ---------------------------------------------------------------------------------------
# config -> retriever


def test_build_retriever_names_the_key_to_set(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"retriever.name"):
        build_retriever(RetrieverConfig(name="bing"), None)
    with pytest.raises(ValueError, match=r"retriever.url"):
        build_retriever(RetrieverConfig(name="http"), None)
    with pytest.raises(ValueError, match=r"retriever.corpus_path"):
        build_retriever(RetrieverConfig(name="bm25"), None)
    assert repr(build_retriever(RetrieverConfig(name="http", url="http://h:1/"), None)) == (
        "HttpRetriever('http://h:1')"
    )


def test_resolve_corpus_path(tmp_path: Path) -> None:
    assert resolve_corpus_path(RetrieverConfig(name="http")) is None
    with pytest.raises(FileNotFoundError, match=r"retriever.corpus_path"):
        resolve_corpus_path(RetrieverConfig(corpus_path=str(tmp_path / "no.jsonl")))
    with pytest.raises(ValueError, match=r"set retriever.corpus_path"):
        resolve_corpus_path(RetrieverConfig())
    given = write_corpus(tmp_path / "given.jsonl", n=3)
    assert resolve_corpus_path(RetrieverConfig(corpus_path=str(given))) == given

    # The team's corpus: asked for only when retriever.corpus_path is empty (making it may
    # mean generating it), and never for http.
    supplied = write_corpus(tmp_path / "team.jsonl", n=3)
    calls: list[str] = []

    def team_corpus() -> Path:
        calls.append("asked")
        return supplied

    assert resolve_corpus_path(RetrieverConfig(corpus_path=str(given)), team_corpus) == given
    assert resolve_corpus_path(RetrieverConfig(name="http"), team_corpus) is None
    assert calls == []
    assert resolve_corpus_path(RetrieverConfig(), team_corpus) == supplied
    assert calls == ["asked"]
    with pytest.raises(ValueError, match=r"set retriever.corpus_path"):
        resolve_corpus_path(RetrieverConfig(), lambda: None)  # a team without one


# ---------------------------------------------------------------------------------------
# bm25


def test_bm25_finds_the_planted_fact(corpus: Path) -> None:
    from drmas.retrieval.bm25 import BM25Retriever

    bm25 = BM25Retriever(corpus)
    hits = bm25.search(["Zorvath Quell", "where was zorvath born", "Miravel"], 3)
    assert [h[0].id for h in hits] == ["planted"] * 3
    assert all(len(h) <= 3 for h in hits)
    assert all(a.score >= b.score > 0 for h in hits for a, b in itertools.pairwise(h))
    assert hits[0][0] == Passage(**PLANTED, score=hits[0][0].score)
    # No known token (unknown words, stopwords only, empty): no results, no crash.
    assert bm25.search(["qwxyzzy", "the of and", ""], 3) == [[], [], []]
    assert bm25.search([], 3) == []
    # top_k above the corpus size: at most every passage that matches.
    assert [p.id for p in bm25.search(["Zorvath"], 10_000)[0]] == ["planted"]


def test_bm25_index_is_cached_and_rebuilt_when_the_corpus_changes(tmp_path: Path) -> None:
    from drmas.retrieval.bm25 import BM25Retriever

    path = write_corpus(tmp_path / "c.jsonl", n=50)
    first = BM25Retriever(path)
    meta = first.folder / "meta.json"
    assert first.built and json.loads(meta.read_text())["fingerprint"] == corpus_fingerprint(path)
    stamp = meta.stat().st_mtime_ns
    second = BM25Retriever(path)
    assert not second.built and meta.stat().st_mtime_ns == stamp
    assert second.search(["Zorvath Quell"], 3) == first.search(["Zorvath Quell"], 3)

    with open(path, "a") as f:
        f.write(json.dumps({"id": "new", "title": "Ilsa Bront", "text": "Ilsa Bront rows."}) + "\n")
    third = BM25Retriever(path)
    assert third.built
    assert third.search(["Ilsa Bront"], 1)[0][0].id == "new"
    assert not list(tmp_path.glob(".*.tmp")) and not list(tmp_path.glob(".*.old"))


def test_bm25_concurrent_builders_build_once(tmp_path: Path) -> None:
    from drmas.retrieval.bm25 import BM25Retriever

    path = write_corpus(tmp_path / "c.jsonl", n=200)
    built: list[bool] = []

    def construct() -> None:
        built.append(BM25Retriever(path).built)

    threads = [threading.Thread(target=construct) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(built) == [False, False, True]


# ---------------------------------------------------------------------------------------
# dense (loads a 90 MB model: one retriever for the module)


@pytest.fixture(scope="module")
def dense(corpus: Path) -> Iterator[object]:
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("faiss")
    from drmas.retrieval.dense import DenseRetriever

    retriever = DenseRetriever(corpus)
    yield retriever
    retriever.close()


def test_dense_finds_the_planted_fact_from_a_paraphrase(dense: object, corpus: Path) -> None:
    from drmas.retrieval.dense import DenseRetriever

    assert isinstance(dense, DenseRetriever)
    hits = dense.search(["Where was Zorvath Quell born?", "In which town was Quell born?"], 3)
    assert all(len(h) == 3 for h in hits)
    assert all("planted" in [p.id for p in h] for h in hits)
    assert hits[0][0].id == "planted"
    assert all(-1.0 <= p.score <= 1.0 + 1e-5 for h in hits for p in h)  # cosine similarities
    assert all(a.score >= b.score for h in hits for a, b in itertools.pairwise(h))
    assert dense.search([], 3) == []
    # A second retriever over the same corpus and model loads the cached embeddings.
    again = DenseRetriever(corpus)
    assert dense.built is True and again.built is False
    assert again.search(["Where was Zorvath Quell born?"], 3)[0] == hits[0]


# ---------------------------------------------------------------------------------------
# HTTP client against a stand-in server


class _Canned(BaseHTTPRequestHandler):
    """Answers POST /retrieve with whatever `self.server.answer(request)` returns."""

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status, body = self.server.answer(request)  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the client gave up (the timeout test)
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def canned() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_http_client_reads_both_search_r1_forms(canned: ThreadingHTTPServer) -> None:
    seen = []

    def answer(request: dict) -> tuple[int, bytes]:
        seen.append(request)
        scored = [
            {"document": {"id": "7", "contents": '"Bo Taki"\nBo Taki was born in Lumo.'}, "score": 2.5},
            {"document": {"id": "8", "title": "T", "text": "x"}, "score": 1.0},
        ]  # fmt: skip
        plain = [{"id": "9", "contents": '"A"\nb'}]
        return 200, json.dumps({"result": [scored, plain]}).encode()

    canned.answer = answer  # type: ignore[attr-defined]
    hits = HttpRetriever(_url(canned) + "/", timeout_s=5).search(["q1", "q2"], 2)
    assert seen == [{"queries": ["q1", "q2"], "topk": 2, "return_scores": True}]
    assert hits == [
        [Passage("7", "Bo Taki", "Bo Taki was born in Lumo.", 2.5), Passage("8", "T", "x", 1.0)],
        [Passage("9", "A", "b", 0.0)],
    ]


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (200, b"{not json", "malformed JSON"),
        (200, b'{"result": [[]]}', "1 result lists for 2 queries"),
        (200, b'{"answer": []}', "without a 'result' list"),
        (200, b'{"result": [[{"id": "1"}], []]}', "neither contents nor title"),
        (500, b'{"error": "index exploded"}', "HTTP 500.*index exploded"),
    ],
)
def test_http_client_errors(
    canned: ThreadingHTTPServer, status: int, body: bytes, error: str
) -> None:
    canned.answer = lambda request: (status, body)  # type: ignore[attr-defined]
    with pytest.raises(RetrieverError, match=error):
        HttpRetriever(_url(canned), timeout_s=5).search(["a", "b"], 3)


def test_http_client_refused_and_timeout(canned: ThreadingHTTPServer) -> None:
    with pytest.raises(RetrieverError, match=r"drmas retriever.*retriever.url"):
        HttpRetriever(f"http://127.0.0.1:{free_port()}", timeout_s=5).search(["a"], 3)

    def slow(request: dict) -> tuple[int, bytes]:
        time.sleep(1.0)
        return 200, b'{"result": [[]]}'

    canned.answer = slow  # type: ignore[attr-defined]
    with pytest.raises(RetrieverError, match=r"within 0.2 s \(retriever.timeout_s\)"):
        HttpRetriever(_url(canned), timeout_s=0.2).search(["a"], 3)


# ---------------------------------------------------------------------------------------
# server (in-process) <-> client


def _post(url: str, body: bytes) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_server_round_trip_and_bad_requests(corpus: Path) -> None:
    from drmas.retrieval.bm25 import BM25Retriever
    from drmas.retrieval.server import make_server

    bm25 = BM25Retriever(corpus)
    server = make_server(bm25, "127.0.0.1", 0, top_k_default=2)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        queries = ["Zorvath Quell", "qwxyzzy", "born in"]
        assert HttpRetriever(url).search(queries, 3) == bm25.search(queries, 3)

        status, plain = _post(url + "/retrieve", b'{"queries": ["Zorvath Quell born"]}')
        assert status == 200  # topk defaults to the server's, no scores: plain documents
        assert len(plain["result"][0]) == 2
        assert (
            plain["result"][0][0]["contents"]
            == '"Zorvath Quell"\nZorvath Quell was born in Miravel.'
        )

        for body, error in [
            (b"[1]", "JSON object"),
            (b"{oops", "not JSON"),
            (b'{"queries": "one"}', "list of strings"),
            (b'{"queries": ["a"], "topk": -1}', "integer in 1..100"),
            (b'{"queries": ["a"], "topk": 1000000000000}', "integer in 1..100"),
            (json.dumps({"queries": ["q"] * 1025}).encode(), "at most 1024"),
            (json.dumps({"queries": ["q" * 5000]}).encode(), "longer than"),
            (b'{"queries": ["a"], "return_scores": "yes"}', "true or false"),
        ]:
            status, answer = _post(url + "/retrieve", body)
            assert (status, error in answer["error"]) == (400, True), (body, answer)
        assert _post(url + "/nope", b"{}")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_server_caps_connections_and_times_out_stalled_clients(corpus: Path) -> None:
    import socket

    from drmas.retrieval import server as srv
    from drmas.retrieval.bm25 import BM25Retriever

    limits = srv.Limits(max_connections=4, request_timeout_s=2.0)  # the window for the 503
    server = srv.make_server(BM25Retriever(corpus), "127.0.0.1", 0, 2, limits)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    port = server.server_address[1]
    stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        for s in stalled:  # a POST that never sends its body: each holds a thread
            s.sendall(b"POST /retrieve HTTP/1.1\r\nContent-Length: 100\r\n\r\n")
        wait_until(lambda: server.serving == 4, "the server never took the stalled clients")
        status, answer = _post(f"http://127.0.0.1:{port}/retrieve", b'{"queries": ["a"]}')
        assert status == 503 and "too many" in answer["error"]
        assert threading.active_count() < 20  # no thread per stalled client beyond the cap
        # the request deadline drops the stalled ones, which frees their slots
        wait_until(lambda: server.serving == 0, "the stalled clients were never dropped")
        status, _ = _post(f"http://127.0.0.1:{port}/retrieve", b'{"queries": ["a"]}')
        assert status == 200
    finally:
        for s in stalled:
            s.close()
        server.shutdown()
        server.server_close()


def test_retriever_refuses_a_remote_bind_unless_allowed() -> None:
    from drmas.retrieval.server import check_bind
    from drmas.transports.security import SecurityError

    check_bind("127.0.0.1", allow_remote=False)
    with pytest.raises(SecurityError, match=r"retriever\.allow_remote=true"):
        check_bind("0.0.0.0", allow_remote=False)
    check_bind("0.0.0.0", allow_remote=True)  # allowed, with a warning


# ---------------------------------------------------------------------------------------
# batching


class Recorder:
    """Answers query q with one passage whose id is q; records each batch."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.delay_s = delay_s
        self.fail = fail
        self.closed = False

    def search(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        self.batches.append(list(queries))
        time.sleep(self.delay_s)
        if self.fail:
            raise OSError("disk on fire")
        return [[Passage(q, "t", "x", 1.0)] * top_k for q in queries]

    def close(self) -> None:
        self.closed = True

    def __repr__(self) -> str:
        return "Recorder()"


def test_concurrent_searches_become_one_batch() -> None:
    recorder = Recorder()
    batching = BatchingRetriever(recorder, top_k=2, max_batch=64, timeout_s=10)

    async def main() -> list[list[Passage]]:
        return await asyncio.gather(*(batching.search(f"q{i}") for i in range(10)))

    results = asyncio.run(main())
    assert recorder.batches == [[f"q{i}" for i in range(10)]]
    assert [[p.id for p in r] for r in results] == [[f"q{i}"] * 2 for i in range(10)]
    assert (batching.calls, batching.batches, batching.queries) == (10, 1, 10)
    batching.close()
    assert recorder.closed


def test_max_batch_and_queries_arriving_during_a_batch() -> None:
    recorder = Recorder(delay_s=0.2)
    batching = BatchingRetriever(recorder, top_k=1, max_batch=4, timeout_s=10)

    async def main() -> None:
        first = asyncio.gather(*(batching.search(f"a{i}") for i in range(6)))
        await asyncio.sleep(0.05)  # the first batch of 4 is running
        second = asyncio.gather(*(batching.search(f"b{i}") for i in range(3)))
        await asyncio.gather(first, second)

    asyncio.run(main())
    assert recorder.batches == [
        ["a0", "a1", "a2", "a3"],
        ["a4", "a5", "b0", "b1"],
        ["b2"],
    ]
    assert (batching.calls, batching.batches, batching.queries) == (9, 3, 9)


def test_a_failed_batch_fails_every_caller() -> None:
    batching = BatchingRetriever(Recorder(fail=True), top_k=1, max_batch=64, timeout_s=10)

    async def main() -> list[object]:
        return await asyncio.gather(
            *(batching.search(f"q{i}") for i in range(3)), return_exceptions=True
        )

    errors = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) for e in errors)
    assert all("Recorder() failed on a batch of 3 queries: disk on fire" in str(e) for e in errors)
    assert isinstance(errors[0].__cause__, OSError)  # type: ignore[union-attr]


def test_timeout_names_the_setting() -> None:
    batching = BatchingRetriever(Recorder(delay_s=0.4), top_k=1, max_batch=64, timeout_s=0.1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"retriever.timeout_s=0.1"):
        asyncio.run(batching.search("slow"))
    assert time.monotonic() - start < 2.0
