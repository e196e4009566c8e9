"""Passages, the JSONL corpus they come from, and the on-disk index cache next to it.

A corpus line is `{"id": ..., "title": ..., "text": ...}`, or Search-R1's form
`{"id": ..., "contents": "\\"Title\\"\\ntext"}` (wiki-18 is written that way). Indexes built
from a corpus are cached in a folder next to it, keyed by the corpus fingerprint, so the
second actor (or the second run) loads instead of rebuilding.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drmas.cache import build_folder

log = logging.getLogger("drmas.retrieval")


@dataclass(frozen=True)
class Passage:
    """One retrieved (or indexed) passage; `score` is the retriever's, higher is better."""

    id: str
    title: str
    text: str
    score: float = 0.0


class CorpusError(ValueError):
    """A corpus file that cannot be read as passages (the message names file and line)."""


def load_corpus(path: str | Path) -> list[Passage]:
    """All passages of a JSONL corpus, in file order (blank lines are skipped)."""
    path = Path(path)
    passages = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                passages.append(_passage(_loads(line, path, number)))
    if not passages:
        raise CorpusError(f"corpus {path} holds no passages (an empty file)")
    return passages


def _passage(row: dict[str, Any]) -> Passage:
    if "contents" in row and "text" not in row:
        title, text = parse_contents(str(row["contents"]))
        return Passage(str(row["id"]), title, text)
    return Passage(str(row["id"]), str(row["title"]), str(row["text"]))


def _loads(line: str, path: Path, number: int) -> dict[str, Any]:
    where = f"corpus {path}, line {number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{where}: not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(row).__name__}")
    keys = (
        ("id", "contents") if "contents" in row and "text" not in row else ("id", "title", "text")
    )
    for key in keys:
        if key not in row:
            raise CorpusError(
                f"{where}: missing key {key!r} (each line needs id, title, text; or id, contents)"
            )
    return row


def parse_contents(contents: str) -> tuple[str, str]:
    """Search-R1's `"Title"\\ntext` as (title, text); without a quoted first line the whole
    string is text."""
    first, sep, rest = contents.partition("\n")
    if sep and len(first) >= 2 and first.startswith('"') and first.endswith('"'):
        return first[1:-1], rest
    return "", contents


def format_contents(title: str, text: str) -> str:
    """The inverse of parse_contents (what a Search-R1 client expects in `contents`)."""
    return f'"{title}"\n{text}'


def corpus_fingerprint(path: str | Path) -> str:
    """sha256 of the file's bytes (hex), read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------
# Index cache


def cached_build(folder: Path, key: dict[str, Any], build: Callable[[Path], None]) -> bool:
    """Make `folder` hold an index whose meta.json equals `key`; True if this call built it.

    `build(tmp)` writes the index files into an empty temporary folder; meta.json is
    written last (drmas/cache.py renames the folder into place, so a folder under its
    final name with a matching meta.json is always complete, and concurrent builders,
    several actors starting at once, build it once). A stale index (another corpus
    fingerprint or library version) is replaced.
    """

    def build_index(tmp: Path) -> None:
        start = time.perf_counter()
        build(tmp)
        (tmp / "meta.json").write_text(json.dumps(key, indent=1, sort_keys=True))
        log.info("built %s in %.1f s", folder, time.perf_counter() - start)

    return build_folder(folder, build_index, lambda path: _read_meta(path) == key)


def _read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None
