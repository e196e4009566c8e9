"""The vllm engine's LoRA parts without vLLM (drmas/actors/engines/vllm_lora.py): engine
arguments, requests checked against the adapters, and the switch of LoRARequests driven
against a stand-in for vLLM's AsyncLLM (add_lora / remove_lora).
tests/integration/test_vllm_lora_live.py runs the real one; test_lora_folders.py the folders.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from drmas.actors.engines import lora_folders as lf
from drmas.actors.engines import vllm_lora as vl
from drmas.actors.engines.vllm import VLLMEngine, engine_args
from drmas.config.actor import EngineConfig
from drmas.config.model import LoraConfig
from drmas.transports.digest import digest_of
from tests.unit.lora_helpers import ADAPTERS, LORA, peft_model, published, tiny_model_folder


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("qwen2"))


# ------------------------------------------------------------------ engine arguments
@pytest.mark.parametrize(("rank", "slot"), [(1, 1), (4, 8), (8, 8), (9, 16), (512, 512)])
def test_max_lora_rank_is_the_smallest_vllm_slot_that_holds_the_rank(rank: int, slot: int) -> None:
    args = vl.lora_engine_args(LoraConfig(rank=rank), ADAPTERS)
    assert args == {"enable_lora": True, "max_loras": 2, "max_lora_rank": slot, "max_cpu_loras": 4}


def test_base_slot_and_too_large_a_rank() -> None:
    args = vl.lora_engine_args(LORA, ADAPTERS, base_slot=True)
    assert (args["max_loras"], args["max_cpu_loras"]) == (3, 5)
    with pytest.raises(ValueError, match=r"lora.rank=600 exceeds .* \(512\)"):
        vl.lora_engine_args(LoraConfig(rank=600), ADAPTERS)


def test_engine_args_on_a_lora_base(tmp_path: Path) -> None:
    full = engine_args(tmp_path, EngineConfig(name="vllm"))
    assert not set(vl.LORA_ARGS) & set(full)
    args = engine_args(tmp_path, EngineConfig(name="vllm"), LORA, ADAPTERS)
    assert args["enable_lora"] is True and args["max_loras"] == 2 and args["max_lora_rank"] == 8
    clash = EngineConfig(name="vllm", extra_args={"max_loras": 4})
    engine_args(tmp_path, clash)  # a full model: the user's to set
    with pytest.raises(ValueError, match="max_loras"):
        engine_args(tmp_path, clash, LORA, ADAPTERS)


def test_the_engine_takes_the_adapters_and_checks_requests(model_path: Path) -> None:
    """make_engine's keyword arguments (lora=, adapters=); tests/integration runs it."""
    engine = VLLMEngine(
        "policy", model_path, EngineConfig(name="vllm"), lora=LORA, adapters=ADAPTERS
    )
    assert engine.adapters is not None
    assert engine.adapters.adapters == ADAPTERS and engine.adapters.lora == LORA
    engine._check_adapter("solver")
    engine._check_adapter("")  # the base
    with pytest.raises(ValueError, match=r"'critic'; this engine serves \['solver', 'verifier'\]"):
        engine._check_adapter("critic")
    full = VLLMEngine("policy", model_path, EngineConfig(name="vllm"))
    assert full.adapters is None and full.backup_weights() is None
    with pytest.raises(ValueError, match="has no adapters"):
        full._check_adapter("solver")


# ------------------------------------------------------------------ slots
@dataclass(frozen=True)
class FakeRequest:
    """vLLM's LoRARequest fields the server uses."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class FakeLLM:
    """AsyncLLM's LoRA calls: records them; refuses the adapter paths in `refuse`."""

    def __init__(self) -> None:
        self.loaded: dict[int, FakeRequest] = {}
        self.removed: list[int] = []
        self.refuse: set[str] = set()

    async def add_lora(self, request: FakeRequest) -> bool:
        assert (Path(request.lora_path) / lf.CONFIG_FILE).exists()
        assert (Path(request.lora_path) / lf.TENSORS_FILE).exists()
        if request.lora_name.split("-")[0] in self.refuse:
            return False
        self.loaded[request.lora_int_id] = request
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.loaded.pop(lora_id, None) is not None


def worker(sent: list[tuple[str, torch.Tensor]]) -> Any:
    """The worker's part of a publish (vllm_worker.drmas_receive_adapters)."""

    async def fetch(folders: dict[str, str]) -> dict[str, Any]:
        written = lf.write_adapter_tensors(sent, {a: Path(f) for a, f in folders.items()})
        return {"error": "", "adapters": sorted(written), "tensors": sum(written.values())}

    return fetch


def test_adapter_server_switches_versions_and_removes_unused_ones(model_path: Path) -> None:
    server = vl.AdapterServer("policy", model_path, LORA, ADAPTERS, FakeRequest)
    llm = FakeLLM()

    async def main() -> None:
        await server.start(llm, base_slot=True)
        first = dict(server.slots.current)
        assert sorted(first) == ADAPTERS and server.slots.base is not None
        assert len(llm.loaded) == 3
        assert server.slots.acquire("") is server.slots.base  # the base: an initial adapter
        await server.release(llm, server.slots.base)
        running = server.slots.acquire("solver")  # a request on the solver's version 0
        sent = published(peft_model(model_path))
        digest, reply = await server.receive(llm, 1, worker(sent), digest=True)
        assert digest == digest_of(sent) and reply["tensors"] == len(sent)
        assert server.slots.current["solver"].lora_name.startswith("solver-v1-")
        # verifier v0 was unused: removed at once; solver v0 only when its request ends
        assert llm.removed == [first["verifier"].lora_int_id]
        assert not Path(first["verifier"].lora_path).exists()
        assert Path(first["solver"].lora_path).exists()
        await server.release(llm, running)
        assert llm.removed[-1] == first["solver"].lora_int_id
        assert not Path(first["solver"].lora_path).exists()
        assert server.slots.superseded == {} and server.slots.base.lora_int_id in llm.loaded
        root = server.root
        assert root is not None
        server.close()
        assert not root.exists()

    asyncio.run(main())


def test_a_failed_publish_switches_nothing(model_path: Path) -> None:
    server = vl.AdapterServer("policy", model_path, LORA, ADAPTERS, FakeRequest)
    llm = FakeLLM()
    sent = published(peft_model(model_path))

    async def broken(folders: dict[str, str]) -> dict[str, Any]:
        raise RuntimeError("vLLM worker of 'policy': WeightSyncError: rank 0 gone")

    async def main() -> None:
        await server.start(llm, base_slot=False)
        before = dict(server.slots.current)
        assert server.slots.base is None and server.slots.acquire("") is None
        with pytest.raises(RuntimeError, match="rank 0 gone"):
            await server.receive(llm, 1, broken, digest=False)
        llm.refuse = {"verifier"}
        with pytest.raises(RuntimeError, match="did not load LoRA adapter"):
            await server.receive(llm, 1, worker(sent), digest=False)
        assert server.slots.current == before  # the previous adapters keep serving
        assert server.root is not None
        assert sorted(p.name for p in server.root.iterdir()) == sorted(
            r.lora_name for r in before.values()
        )  # the new folders were removed again
        assert set(llm.loaded) == {r.lora_int_id for r in before.values()}
        server.close()

    asyncio.run(main())


def only(sent: list[tuple[str, torch.Tensor]], adapter: str) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in sent if f".{adapter}." in n]


def test_a_publish_of_one_adapter_switches_only_that_one(model_path: Path) -> None:
    """The verifier alone at v1: a new LoRARequest and folder for it, the solver keeps its
    version-0 LoRARequest (the same object, folder untouched); the digest read back covers
    both adapters: the learner's initial solver and the verifier sent. Then a publish of
    nothing (v2): nothing added or removed, the digest unchanged. Then the solver (v3)."""
    server = vl.AdapterServer("policy", model_path, LORA, ADAPTERS, FakeRequest)
    llm = FakeLLM()
    initial = lf.initial_adapter_tensors(model_path, LORA, ADAPTERS)
    sent = published(peft_model(model_path))

    async def main() -> None:
        await server.start(llm, base_slot=True)
        first = dict(server.slots.current)
        solver_file = Path(first["solver"].lora_path) / lf.TENSORS_FILE
        stamp = solver_file.stat().st_mtime_ns
        assert lf.read_back_digest({a: Path(r.lora_path) for a, r in first.items()}) == digest_of(
            initial
        )  # version 0 holds the learner's initial adapters
        digest, reply = await server.receive(llm, 1, worker(only(sent, "verifier")), digest=True)
        assert reply["adapters"] == ["verifier"]
        assert digest == digest_of(only(initial, "solver") + only(sent, "verifier"))
        assert server.slots.current["solver"] is first["solver"]
        assert server.slots.current["verifier"].lora_name.startswith("verifier-v1-")
        assert solver_file.stat().st_mtime_ns == stamp
        assert llm.removed == [first["verifier"].lora_int_id]
        assert len(llm.loaded) == 3  # solver v0, the base's, verifier v1
        assert server.root is not None
        folders = sorted(p.name for p in server.root.iterdir())
        assert len(folders) == 3 and not any(f.startswith("solver-v1") for f in folders)

        before = dict(server.slots.current)
        empty, reply = await server.receive(llm, 2, worker([]), digest=True)
        assert reply["adapters"] == [] and empty == digest
        assert server.slots.current == before
        assert sorted(p.name for p in server.root.iterdir()) == folders

        digest, _ = await server.receive(llm, 3, worker(only(sent, "solver")), digest=True)
        assert digest == digest_of(sent)
        assert server.slots.current["verifier"] is before["verifier"]
        assert server.slots.current["solver"].lora_name.startswith("solver-v3-")
        server.close()

    asyncio.run(main())


def test_a_failed_publish_of_one_adapter_switches_nothing(model_path: Path) -> None:
    """An adapter received in part, or an adapter vLLM refuses: no switch, the new folders
    removed, nothing left added in vLLM."""
    server = vl.AdapterServer("policy", model_path, LORA, ADAPTERS, FakeRequest)
    llm = FakeLLM()
    sent = published(peft_model(model_path))

    async def main() -> None:
        await server.start(llm, base_slot=False)
        before = dict(server.slots.current)
        loaded = set(llm.loaded)
        part = only(sent, "verifier")[:-1] + only(sent, "solver")
        with pytest.raises(ValueError, match=r"'verifier' in part: 1 of its tensors missing"):
            await server.receive(llm, 1, worker(part), digest=False)
        llm.refuse = {"verifier"}
        with pytest.raises(RuntimeError, match="did not load LoRA adapter"):
            await server.receive(llm, 1, worker(sent), digest=False)
        assert server.slots.current == before and set(llm.loaded) == loaded
        assert server.root is not None
        assert sorted(p.name for p in server.root.iterdir()) == sorted(
            r.lora_name for r in before.values()
        )
        server.close()

    asyncio.run(main())


def test_eval_loads_chosen_adapters_without_a_weight_group(model_path: Path) -> None:
    """drmas eval hands a vLLM engine the adapters of chosen PEFT folders in this process
    (LoadsAdapters.load_adapters, not load_weights): the given adapter switches to a new
    folder holding exactly those tensors, the other keeps its initial one, and the digest
    read back covers both."""
    from drmas.actors.engines import LoadsAdapters

    engine = VLLMEngine(
        "policy", model_path, EngineConfig(name="vllm"), lora=LORA, adapters=ADAPTERS
    )
    assert isinstance(engine, LoadsAdapters)
    assert engine.adapters is not None
    engine.adapters.make_request = FakeRequest
    engine.llm = FakeLLM()

    async def main() -> None:
        assert engine.adapters is not None
        await engine.adapters.start(engine.llm, base_slot=False)
        before = dict(engine.adapters.slots.current)
        sent = published(peft_model(model_path))
        initial = lf.initial_adapter_tensors(model_path, LORA, ADAPTERS)
        await engine.load_adapters(only(sent, "solver"), 0)
        now = engine.adapters.slots.current
        assert now["verifier"] is before["verifier"] and now["solver"] is not before["solver"]
        expected = [*only(sent, "solver"), *only(initial, "verifier")]
        assert engine.weights_digest() == digest_of(expected)
        engine.adapters.close()

    asyncio.run(main())
