"""BM25 over a local corpus with the bm25s library (sparse scores precomputed at index time,
so a query costs a sum over its tokens' posting columns).

Tokenisation: lower-cased words of 2+ characters, English stopwords removed, no stemming
(a stemmer would make the index depend on whether PyStemmer is installed). The index is
cached in `<corpus>.bm25s/` (bm25s's save format plus meta.json) and rebuilt when the
corpus fingerprint or the bm25s version changes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

from drmas.retrieval.corpus import Passage, cached_build, corpus_fingerprint, load_corpus

log = logging.getLogger("drmas.retrieval")

INDEX_FORMAT = 1
"""Bump when what this module writes into the cache folder changes."""
STOPWORDS = "en"


def _import_bm25s() -> ModuleType:
    try:
        import bm25s
    except ImportError as exc:
        raise ImportError(
            f"the bm25 retriever needs bm25s ({exc}): pip install -e .[search]"
        ) from None
    return bm25s


class BM25Retriever:
    """Retriever over `corpus_path`; `built` says whether this instance built the index
    (False: it was loaded from the cache)."""

    def __init__(self, corpus_path: str | Path, *, k1: float = 1.5, b: float = 0.75) -> None:
        bm25s = _import_bm25s()
        self.corpus_path = Path(corpus_path)
        self.passages = load_corpus(self.corpus_path)
        self.folder = self.corpus_path.with_name(self.corpus_path.name + ".bm25s")
        key = {
            "fingerprint": corpus_fingerprint(self.corpus_path),
            "bm25s": bm25s.__version__,
            "format": INDEX_FORMAT,
            "passages": len(self.passages),
            "k1": k1,
            "b": b,
            "stopwords": STOPWORDS,
        }

        def build(tmp: Path) -> None:
            log.info("indexing %d passages with bm25s", len(self.passages))
            tokens = bm25s.tokenize(
                [f"{p.title}\n{p.text}" for p in self.passages],
                stopwords=STOPWORDS,
                show_progress=False,
            )
            index = bm25s.BM25(k1=k1, b=b)
            index.index(tokens, show_progress=False)
            index.save(str(tmp), show_progress=False)

        self.built = cached_build(self.folder, key, build)
        self._index = bm25s.BM25.load(str(self.folder), show_progress=False)
        self._bm25s = bm25s

    def search(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        """Best first, equal scores in corpus order (bm25s leaves ties in no fixed order;
        a policy should see the same ranking for the same query); passages that share no
        token with the query (score 0) are left out, so a query of unknown words returns []."""
        k = min(top_k, len(self.passages))
        if not queries or k <= 0:
            return [[] for _ in queries]
        tokens = self._bm25s.tokenize(
            queries, stopwords=STOPWORDS, return_ids=False, show_progress=False
        )
        # a few more than k, so that ties at the cut are ordered too
        wide = min(len(self.passages), k + TIE_MARGIN)
        indices, scores = self._index.retrieve(tokens, k=wide, show_progress=False, n_threads=0)
        out = []
        for row_i, row_s in zip(indices, scores, strict=True):
            ranked = sorted(
                ((float(s), int(i)) for i, s in zip(row_i, row_s, strict=True) if s > 0),
                key=lambda pair: (-round(pair[0], 6), pair[1]),
            )
            out.append([_scored(self.passages[i], s) for s, i in ranked[:k]])
        return out

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"BM25Retriever({str(self.corpus_path)!r})"


TIE_MARGIN = 8
"""Extra candidates fetched so that passages tied with the k-th are ordered by id too."""


def _scored(p: Passage, score: float) -> Passage:
    return Passage(p.id, p.title, p.text, score)
