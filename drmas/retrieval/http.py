"""Client of a retrieval server speaking Search-R1's API (`drmas retriever`, or Search-R1's
own E5 + FAISS Wikipedia server).

    POST {url}/retrieve  {"queries": [q, ...], "topk": k, "return_scores": true}
    ->  {"result": [[{"document": {"id": ..., "contents": "\\"Title\\"\\ntext"}, "score": s},
                     ...], ...]}                                  one list per query

With `return_scores: false` a server answers `[[document, ...], ...]` instead; documents
that carry `title` and `text` are read as such. Stdlib only: one short-lived connection per
batch, an explicit timeout, and proxies from the environment ignored (a retriever is a
service inside the cluster, and an http_proxy meant for the internet would swallow it).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from drmas.retrieval.corpus import Passage, parse_contents

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RetrieverError(RuntimeError):
    """The server could not be reached or answered something unusable."""


class HttpRetriever:
    def __init__(self, url: str, *, timeout_s: float = 60.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever.url {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def search(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        if not queries:
            return []
        body = {"queries": queries, "topk": top_k, "return_scores": True}
        result = self._post("/retrieve", body)
        if not isinstance(result, dict) or not isinstance(result.get("result"), list):
            raise RetrieverError(
                f"{self.url}/retrieve answered JSON without a 'result' list: {_excerpt(result)}"
            )
        lists = result["result"]
        if len(lists) != len(queries):
            raise RetrieverError(
                f"{self.url}/retrieve answered {len(lists)} result lists for {len(queries)} queries"
            )
        return [[self._passage(item) for item in hits][:top_k] for hits in lists]

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise RetrieverError(
                f"{self.url}{path} answered HTTP {exc.code} {exc.reason}: {detail}"
            ) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise self._timeout() from None
            raise RetrieverError(
                f"cannot reach the retriever at {self.url} ({exc.reason}): start one with "
                "`drmas retriever` or check retriever.url"
            ) from None
        except TimeoutError:
            raise self._timeout() from None
        except OSError as exc:  # e.g. the server closed the connection without an answer
            raise RetrieverError(f"{self.url}{path} failed: {exc!r}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise RetrieverError(
                f"{self.url}{path} answered malformed JSON: {raw[:200]!r}"
            ) from None

    def _timeout(self) -> RetrieverError:
        return RetrieverError(
            f"the retriever at {self.url} did not answer within {self.timeout_s} s "
            "(retriever.timeout_s)"
        )

    def _passage(self, item: Any) -> Passage:
        score = 0.0
        if isinstance(item, dict) and "document" in item:
            score = float(item.get("score", 0.0))
            item = item["document"]
        if not isinstance(item, dict):
            raise RetrieverError(f"{self.url}/retrieve: a result is not a document: {item!r}")
        if "title" in item and "text" in item:
            title, text = str(item["title"]), str(item["text"])
        elif "contents" in item:
            title, text = parse_contents(str(item["contents"]))
        else:
            raise RetrieverError(
                f"{self.url}/retrieve: a document has neither contents nor title and text: "
                f"{_excerpt(item)}"
            )
        return Passage(str(item.get("id", "")), title, text, score)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"HttpRetriever({self.url!r})"


def _excerpt(value: Any) -> str:
    return json.dumps(value)[:200]
