"""LoRA adapters on the sglang engine: each publish loaded into the server as new adapters.

Who talks to whom: SGLangEngine (sglang.py) on a LoRA base hands every received bucket to
`SGLangAdapters.receive` (the actor's receive thread, the engine paused). A publish carries
the adapters that changed since the version the actor holds, each whole, sorted by wire
name (the names peft gives them, known from the model's config since `start`); once it is
whole, each adapter it carried is written as a PEFT folder (lora_folders.py) and loaded
with `POST /load_lora_adapter {lora_name, lora_path}` under a new name per version
(`<adapter>-v<version>-<n>`); the other adapters keep the version they have. `/generate`
names an adapter's current version in `lora_path`. A version is unloaded
(`POST /unload_lora_adapter`) and its folder deleted once a newer one serves and no
request of ours runs on it (lora_folders.AdapterSlots).

When a publish is whole: the receive calls do not say which bucket is the last, but the
wire order does. Every adapter has the same module names, so the smallest name of any
adapter sorts before the largest name of every other: once the adapters that began to
arrive are whole, an adapter whose first name sorts before the last name received is not
in the publish, and one whose first name sorts after it may still come. Names arriving
out of order, twice, or with a gap are refused. A call without tensors ends a publish
(the actor's call for a publish that carried none, or after its last bucket): one still
in part then fails.

A publish goes live only once it is verified: when it is whole its adapters are loaded
into the server under their new names (staged), but requests keep running on the
versions they had until `commit`, which SGLangEngine calls when it resumes after a load
that went through (the receiver has checked the digest trailer by then). A load that
fails after staging (a digest mismatch, a late error) is `discard`ed: the staged
versions are unloaded and their folders deleted, and the previous ones keep serving.

Why a new name per version and not unload-then-load under one name: SGLang refuses a
second adapter of a name it holds, and its unload waits (holding its adapter-update lock,
without a timeout) until every request on the adapter has finished, which a request
paused by our own pause_generation never does. Unloading only versions no request of ours
uses never waits. Until a publish carries an adapter its requests run on the base
(`lora_path` absent), which every adapter starts as (lora_B = 0); the digest counts it as
its initial tensors (lora_folders.initial_adapter_tensors), as the learner does.

The folders are read by the server from the path we send: a server started by the engine
shares this host's file system; one at actor.engine.sglang_url must see the same path.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from drmas.actors.engines import sglang_requests as api
from drmas.actors.engines.lora_folders import (
    AdapterSlots,
    initial_adapter_tensors,
    names_by_adapter,
    read_back,
    write_adapter_configs,
    write_adapter_tensors,
)
from drmas.models.lora import adapter_of_param
from drmas.transports.digest import digest_of

if TYPE_CHECKING:
    from drmas.config.model import LoraConfig

log = logging.getLogger("drmas.engine.sglang")


@dataclass(frozen=True)
class Loaded:
    """One version of one adapter as the server holds it."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class SGLangAdapters:
    """The LoRA half of an SGLangEngine. `call(route, body)` is one checked HTTP call to
    the server (raises SGLangHTTPError); `dtype`: the engine's (actor.engine.dtype), the
    initial adapters' in the digest."""

    def __init__(
        self,
        model_name: str,
        model_path: Path,
        lora: LoraConfig,
        adapters: Sequence[str],
        call: Callable[[str, dict[str, Any]], Any],
        dtype: str = "float32",
    ) -> None:
        self.model_name = model_name
        self.model_path = model_path
        self.lora = lora
        self.slots = AdapterSlots(adapters)
        self.call = call
        self.dtype: torch.dtype = getattr(torch, dtype)
        self.digest = ""
        """drmas digest of every adapter as it serves now: read back from the folders of
        those loaded, the initial tensors of the others ("" before the first publish)."""
        self.root: Path | None = None
        self.names: dict[str, list[str]] = {}
        """adapter -> wire names of its tensors (sorted), from start."""
        self._known: set[str] = set()
        self._initial: dict[str, list[tuple[str, torch.Tensor]]] = {}
        """adapter -> its initial tensors, for adapters no publish has carried yet."""
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_version = -1
        self._last = ""
        """The largest name received of the pending publish."""
        self._done = False
        """The pending version's publish was whole and is staged."""
        self._staged: tuple[int, dict[str, Loaded], str] | None = None
        """(version, adapter -> its new version loaded in the server, the digest once they
        serve): a whole publish waiting for `commit` (or `discard`)."""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # slots: the event loop and the receive thread

    @property
    def adapters(self) -> list[str]:
        return self.slots.adapters

    def start(self) -> None:
        """The folder root, the names a publish may carry and the initial adapters
        (blocking: run in a thread)."""
        self.root = Path(tempfile.mkdtemp(prefix=f"drmas-lora-{self.model_name}-"))
        initial = initial_adapter_tensors(self.model_path, self.lora, self.adapters, self.dtype)
        self.names = names_by_adapter(initial)
        self._known = {name for name, _ in initial}
        self._initial = {
            a: [(n, t) for n, t in initial if adapter_of_param(n) == a] for a in self.adapters
        }

    def receive(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> bool:
        """Keep one bucket of `version`'s publish (copies: the receiver reuses its buffer);
        once the publish is whole, load the adapters it carried into the server, staged
        (they serve after `commit`). No tensors: the publish ended (one that carried none
        is whole). True when the version is staged."""
        batch = list(named_tensors)
        if version != self._pending_version:
            self._pending, self._pending_version, self._last, self._done = {}, version, "", False
        if self._done and batch:
            self._refuse(f"received {batch[0][0]!r} after version {version}'s publish was whole")
        if self._done:
            return True
        for name, tensor in batch:
            if name not in self._known:
                self._refuse(
                    f"received {name!r}, not a tensor of adapters {self.adapters} "
                    "(do the learner and the actor run the same config?)"
                )
            if name <= self._last:
                self._refuse(f"received {name!r} after {self._last!r}: not sorted, or twice")
            self._last = name
            self._pending[name] = tensor.detach().to("cpu", copy=True)
        if not self._whole(ended=not batch):
            if batch:
                return False
            started = sorted({adapter_of_param(n) for n in self._pending})
            self._refuse(f"version {version}'s publish ended with adapter(s) {started} in part")
        pending, self._pending = self._pending, {}
        self._stage(version, sorted(pending.items()))
        self._done = True
        return True

    def _whole(self, ended: bool) -> bool:
        """Whether the pending publish is whole (see the module's docstring; once `ended`,
        an adapter that has not begun to arrive is not in it); ValueError when an adapter
        that began to arrive lacks a name sorting before the last one received."""
        whole = True
        for adapter, names in self.names.items():
            have = [name in self._pending for name in names]
            if not any(have):
                whole = whole and (ended or names[0] < self._last)  # else it may still come
                continue
            gap = next((n for n, h in zip(names, have) if not h and n < self._last), None)
            if gap is not None:
                self._refuse(f"the publish skipped {gap!r} of adapter {adapter!r}")
            whole = whole and all(have)
        return whole

    def _refuse(self, problem: str) -> NoReturn:
        self.discard()
        raise ValueError(f"{self.model_name}: {problem}")

    def discard(self) -> None:
        """Forget a publish that failed: what was received of it, and the versions it
        staged in the server (unloaded, their folders deleted). The previous versions
        keep serving."""
        self._pending, self._pending_version, self._last, self._done = {}, -1, "", False
        self._drop_staged()

    def _drop_staged(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            for loaded in staged[1].values():
                self.unload(loaded)
            log.warning("%s: version %d discarded before it served", self.model_name, staged[0])

    @property
    def staged_digest(self) -> str:
        """The digest once the staged publish serves ("" when none is staged)."""
        return self._staged[2] if self._staged is not None else ""

    def commit(self) -> int | None:
        """Make the staged publish serve: switch its adapters to their new versions (the
        others keep theirs) and unload what no request uses any more. Returns its version,
        None when nothing was staged."""
        staged, self._staged = self._staged, None
        if staged is None:
            return None
        version, new, digest = staged
        with self._lock:
            unused = self.slots.switch(new)
        for adapter in new:
            self._initial.pop(adapter, None)
        self.digest = digest
        for old in unused:
            self.unload(old)
        log.info("%s: adapters %s of version %d serve", self.model_name, sorted(new), version)
        return version

    def _stage(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """Write one folder per adapter received and load each into the server under a new
        name, switching nothing (`commit` does); on any failure the new ones are unloaded
        and deleted."""
        self._drop_staged()  # one never committed nor discarded would never serve
        assert self.root is not None, "SGLangAdapters.start() first"
        new: dict[str, Loaded] = {}
        for adapter in sorted({adapter_of_param(name) for name, _ in named}):
            lora_id = next(self._ids)
            name = f"{adapter}-v{version}-{lora_id}"
            new[adapter] = Loaded(name, lora_id, str(self.root / name))
        folders = {a: Path(loaded.lora_path) for a, loaded in new.items()}
        done: list[Loaded] = []
        try:
            write_adapter_tensors(named, folders)
            write_adapter_configs(folders, self.lora, str(self.model_path))
            for loaded in new.values():
                self.call(
                    "/load_lora_adapter", api.load_lora_body(loaded.lora_name, loaded.lora_path)
                )
                done.append(loaded)
            digest = self._digest_with(new)
        except BaseException:
            for loaded in done:
                self.unload(loaded)
            for folder in folders.values():
                shutil.rmtree(folder, ignore_errors=True)
            raise
        self._staged = (version, new, digest)
        log.info("%s: adapters %s of version %d staged", self.model_name, sorted(new), version)

    def _digest_with(self, new: dict[str, Loaded]) -> str:
        """The digest once `new` serves: every adapter, read back from its folder where one
        is loaded, else its initial tensors."""
        with self._lock:
            held = {**self.slots.current, **new}
        folders = {adapter: Path(loaded.lora_path) for adapter, loaded in held.items()}
        kept = [
            t for adapter, initial in self._initial.items() if adapter not in held for t in initial
        ]
        return digest_of(read_back(folders) + kept)

    def acquire(self, adapter: str) -> Loaded | None:
        """The version a request for `adapter` runs on (None: the base), held until release."""
        with self._lock:
            loaded: Loaded | None = self.slots.acquire(adapter)
        return loaded

    def release(self, loaded: Loaded | None) -> Loaded | None:
        """A request on `loaded` returned; returns the version to unload (superseded and
        unused now), else None."""
        with self._lock:
            old: Loaded | None = self.slots.release(loaded)
        return old

    def unload(self, loaded: Loaded | None) -> None:
        """Unload a version no request uses from the server and delete its folder (a
        failure only leaves it loaded: logged)."""
        if loaded is None:
            return
        try:
            self.call("/unload_lora_adapter", api.unload_lora_body(loaded.lora_name))
        except api.SGLangHTTPError as exc:
            log.warning("%s: unloading %s: %s", self.model_name, loaded.lora_name, exc)
        shutil.rmtree(loaded.lora_path, ignore_errors=True)

    def close(self) -> None:
        root, self.root = self.root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
