"""The one way a cache folder is built (drmas/cache.py): complete or absent under its final
name, built once by concurrent callers, stale folders replaced, and readable by others
like an ordinary folder whatever modes its builder wrote."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from drmas.cache import build_folder


def modes(root: Path) -> dict[str, int]:
    """Permission bits of `root` and of everything under it, by relative path."""
    found = {".": root.stat().st_mode & 0o7777}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = path.stat().st_mode & 0o7777
    return found


def private_builder(tmp: Path) -> None:
    """A builder that makes everything private to its owner (as mkstemp and mkdtemp do)."""
    (tmp / "sub").mkdir(mode=0o700)
    for name in ("data.bin", "sub/nested.json"):
        fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"x")
        os.close(fd)
    os.chmod(tmp / "sub", 0o700)  # mkdir's mode is masked by the umask: set it for sure


def test_a_built_folder_is_readable_like_an_ordinary_folder(tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "thing"
    assert build_folder(folder, private_builder, lambda p: (p / "data.bin").is_file())
    assert modes(folder) == {
        ".": 0o755,
        "sub": 0o755,
        "data.bin": 0o644,
        "sub/nested.json": 0o644,
    }


def test_build_once_then_reuse_and_replace_a_stale_folder(tmp_path: Path) -> None:
    folder = tmp_path / "thing"
    calls: list[Path] = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        (tmp / "version").write_text(str(len(calls)))

    def current(p: Path) -> bool:
        return (p / "version").is_file() and (p / "version").read_text() == want[0]

    want = ["1"]
    assert build_folder(folder, build, current)
    assert calls[0] != folder and calls[0].parent == folder.parent  # a temporary name
    assert not build_folder(folder, build, current) and len(calls) == 1
    want = ["2"]  # the key changed: the folder there is stale
    assert build_folder(folder, build, current)
    assert (folder / "version").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing", "thing.lock"]


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    folder = tmp_path / "thing"
    started, release = threading.Event(), threading.Event()
    calls: list[Path] = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        started.set()
        assert release.wait(30), "the test never let the build finish"
        (tmp / "done").write_text("")

    results: list[bool] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                build_folder(folder, build, lambda p: (p / "done").exists())
            )
        )
        for _ in range(3)
    ]
    threads[0].start()
    assert started.wait(30)
    for thread in threads[1:]:
        thread.start()
    assert not folder.exists()  # nothing under the final name while it is being built
    release.set()
    for thread in threads:
        thread.join(30)
    assert len(calls) == 1 and sorted(results) == [False, False, True]


def test_a_failed_build_leaves_nothing_and_leftovers_are_removed(tmp_path: Path) -> None:
    folder = tmp_path / "thing"
    (tmp_path / ".thing.abc123.tmp").mkdir()  # a killed builder's
    (tmp_path / ".thing.v2.abc123.tmp").mkdir()  # another folder's ("thing.v2")

    def broken(tmp: Path) -> None:
        (tmp / "half").write_text("")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        build_folder(folder, broken, lambda p: p.exists())
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.v2.abc123.tmp", "thing.lock"]
