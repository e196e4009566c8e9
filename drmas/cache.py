"""Where drmas keeps what it builds once and reuses (builtin models, the synthetic knowledge
base's corpus, retrieval indexes: $DRMAS_CACHE, else ~/.cache/drmas), and the one way
such a folder is built (`build_folder`).

Several processes often want the same folder at once (every actor of a run starts
together, and runs share a cache), possibly as different users of one shared cache. So a
folder is built under a temporary name next to its final one and renamed into place:
under its final name it is always complete. Builders serialise on a lock file next to it
(drmas/filelock.py): the second one waits, then finds the folder. Whatever the builder
wrote, the folder ends up readable like any ordinary one (FOLDER_MODE, FILE_MODE), so a
cache shared by a group stays usable by all its members.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from drmas.filelock import file_lock

FOLDER_MODE = 0o755
"""Mode of every folder of a built cache folder (mkdtemp would leave its own at 0700)."""
FILE_MODE = 0o644
"""Mode of every file of a built cache folder, whatever mode its writer gave it."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("DRMAS_CACHE") or Path.home() / ".cache" / "drmas")


def build_folder(
    folder: Path, build: Callable[[Path], None], complete: Callable[[Path], bool]
) -> bool:
    """Make `folder` complete, building it at most once; True if this call built it.

    `complete(path)` says whether a folder at `path` is usable as it is (e.g. its last
    file is there, or its key matches). Otherwise `build(tmp)` writes the contents into
    an empty temporary folder next to `folder`; its files and folders get FILE_MODE and
    FOLDER_MODE and it is renamed to `folder`, replacing an incomplete or stale one there
    (a process still reading a stale one was reading outdated contents anyway). Holding
    the lock, temporary folders left by a killed builder are removed first.
    """
    if complete(folder):
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(folder.parent / f"{folder.name}.lock"):
        if complete(folder):
            return False
        _remove_leftovers(folder)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
        try:
            build(tmp)
            share(tmp)
            if folder.exists():
                old = tmp.with_suffix(".old")
                os.rename(folder, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return True


def share(root: Path) -> None:
    """FOLDER_MODE on `root` and every folder under it, FILE_MODE on every file (symbolic
    links are left alone: their targets are not part of the cache)."""
    os.chmod(root, FOLDER_MODE)
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                os.chmod(path, FOLDER_MODE)
            elif stat.S_ISREG(mode):
                os.chmod(path, FILE_MODE)


def _remove_leftovers(folder: Path) -> None:
    """Temporary (`.NAME.XXXX.tmp`) and replaced (`.NAME.XXXX.old`) folders of `folder`
    only: another folder's, say `NAME.v2`'s, never match."""
    own = re.compile(rf"\.{re.escape(folder.name)}\.[^.]+\.(tmp|old)")
    for path in folder.parent.iterdir():
        if own.fullmatch(path.name):
            shutil.rmtree(path, ignore_errors=True)
