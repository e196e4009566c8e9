"""LoRA adapters on the sglang engine: each publish loaded into the server as new adapters.

Who talks to whom: SGLangEngine (sglang.py) on a LoRA base hands every received bucket to
`SGLangAdapters.receive` (the actor's receive thread, the engine paused). Once the publish
holds every adapter tensor (the names peft gives them, known from the model's config
since `start`), the adapters are written as PEFT folders (lora_folders.py) and loaded with
`POST /load_lora_adapter {lora_name, lora_path}` under a new name per version
(`<adapter>-v<version>-<n>`); `/generate` then names an adapter's current version in
`lora_path`. A version is unloaded (`POST /unload_lora_adapter`) and its folder deleted
once a newer one serves and no request of ours runs on it (lora_folders.AdapterSlots).

Why a new name per version and not unload-then-load under one name: SGLang refuses a
second adapter of a name it holds, and its unload waits (holding its adapter-update lock,
without a timeout) until every request on the adapter has finished, which a request
paused by our own pause_generation never does. Unloading only versions no request of ours
uses never waits. Before the first publish an adapter's requests run on the base
(`lora_path` absent), which every adapter starts as (lora_B = 0).

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
from typing import TYPE_CHECKING, Any

import torch

from drmas.actors.engines import sglang_requests as api
from drmas.actors.engines.lora_folders import (
    AdapterSlots,
    initial_adapter_tensors,
    read_back_digest,
    write_adapter_configs,
    write_adapter_tensors,
)

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
    the server (raises SGLangHTTPError)."""

    def __init__(
        self,
        model_name: str,
        model_path: Path,
        lora: LoraConfig,
        adapters: Sequence[str],
        call: Callable[[str, dict[str, Any]], Any],
    ) -> None:
        self.model_name = model_name
        self.model_path = model_path
        self.lora = lora
        self.slots = AdapterSlots(adapters)
        self.call = call
        self.digest = ""
        """drmas digest of the adapters serving now, read back from their folders."""
        self.root: Path | None = None
        self._expected: set[str] = set()
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_version = -1
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # slots: the event loop and the receive thread

    @property
    def adapters(self) -> list[str]:
        return self.slots.adapters

    def start(self) -> None:
        """The folder root, and the names a publish must carry (blocking: run in a thread)."""
        self.root = Path(tempfile.mkdtemp(prefix=f"drmas-lora-{self.model_name}-"))
        names = initial_adapter_tensors(self.model_path, self.lora, self.adapters)
        self._expected = {name for name, _ in names}

    def receive(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> bool:
        """Keep one bucket of `version`'s publish (copies: the receiver reuses its buffer);
        once every adapter tensor arrived, load the version. True when it was loaded."""
        if version != self._pending_version:
            self._pending, self._pending_version = {}, version
        for name, tensor in named_tensors:
            if name not in self._expected:
                self.discard()
                raise ValueError(
                    f"received {name!r}, not a tensor of adapters {self.adapters} of "
                    f"{self.model_name!r} (do the learner and the actor run the same config?)"
                )
            self._pending[name] = tensor.detach().to("cpu", copy=True)
        if len(self._pending) < len(self._expected):
            return False
        pending, self._pending = self._pending, {}
        self._load(version, sorted(pending.items()))
        return True

    def discard(self) -> None:
        """Forget a publish received in part (it failed)."""
        self._pending, self._pending_version = {}, -1

    def _load(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """Write one folder per adapter, load each as a new name, then switch to them; on
        any failure the new ones are unloaded and deleted and nothing is switched."""
        assert self.root is not None, "SGLangAdapters.start() first"
        new: dict[str, Loaded] = {}
        for adapter in self.adapters:
            lora_id = next(self._ids)
            name = f"{adapter}-v{version}-{lora_id}"
            new[adapter] = Loaded(name, lora_id, str(self.root / name))
        folders = {a: Path(loaded.lora_path) for a, loaded in new.items()}
        done: list[Loaded] = []
        try:
            write_adapter_configs(folders, self.lora, str(self.model_path))
            write_adapter_tensors(named, folders)
            for loaded in new.values():
                self.call(
                    "/load_lora_adapter", api.load_lora_body(loaded.lora_name, loaded.lora_path)
                )
                done.append(loaded)
            digest = read_back_digest(folders)
        except BaseException:
            for loaded in done:
                self.unload(loaded)
            for folder in folders.values():
                shutil.rmtree(folder, ignore_errors=True)
            raise
        with self._lock:
            unused = self.slots.switch(new)
        self.digest = digest
        for old in unused:
            self.unload(old)
        log.info("%s: adapters %s of version %d loaded", self.model_name, self.adapters, version)

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
