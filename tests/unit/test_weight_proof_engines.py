"""Weights that prove themselves, as the engines see them: what each expects a publish to
cover, and what the actor does when a publish is refused (hf and sim roll back; an engine
whose workers load in place, like vLLM and SGLang, is quarantined), with a real sender in
a thread over gloo on loopback. vLLM's worker side runs against a fake vLLM worker."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import drmas.transports.weights.sender as sender_module
from drmas.actors.engines import make_engine
from drmas.actors.engines.expected import expected_for, folder_expected, pack
from drmas.actors.main import Actor
from drmas.config import load_config
from drmas.protocol.messages import JoinWeightGroup, LeaseReturn, WeightsLoaded
from drmas.transports.digest import digest_of
from drmas.transports.weights import Header, WeightSender, check_covers, spec_of
from drmas.transports.weights.group import Pipeline
from drmas.transports.weights.layout import WeightSyncError, expected_of
from tests.fixtures.engines import InPlace


class Tampering(Pipeline):
    """What an on-path change of the bytes looks like: one bit of each bucket flipped
    after rank 0 fingerprinted it."""

    def push(self, tensor: torch.Tensor, what: str) -> None:
        tensor = tensor.clone()
        tensor.view(torch.uint8)[0] ^= 1
        super().push(tensor, what)


def learner_specs(tiny_qwen_folder: Path) -> list[tuple[str, torch.Tensor]]:
    """What learner rank 0 publishes for this folder: its named_parameters, in bf16."""
    from transformers import AutoModelForCausalLM

    from drmas.learners.model_io import hf_name

    lm = AutoModelForCausalLM.from_pretrained(tiny_qwen_folder)
    torch.manual_seed(1)
    return [
        (hf_name(n), torch.randn_like(p, dtype=torch.bfloat16)) for n, p in lm.named_parameters()
    ]


def test_the_hf_engine_and_the_folder_expect_exactly_what_the_learner_sends(
    tiny_qwen_folder,
) -> None:
    sent = learner_specs(tiny_qwen_folder)
    header = Header(2**20, [spec_of(n, t) for n, t in sent])

    async def main() -> None:
        engine = make_engine(
            "solver", str(tiny_qwen_folder), load_config([]).actor.engine_of("solver")
        )
        await engine.start()
        join = JoinWeightGroup("solver", 1, "g", "h:1", 1, 2, 5.0)
        expected = expected_for(engine, join)
        assert expected is not None
        check_covers(header, expected, "g")  # the learner's header passes
        with pytest.raises(WeightSyncError, match=f"missing {len(sent) - 1} "):
            check_covers(Header(2**20, header.tensors[:1]), expected, "g")
        await engine.close()

    asyncio.run(asyncio.wait_for(main(), timeout=60))
    folder = folder_expected(str(tiny_qwen_folder))
    assert folder is not None
    check_covers(header, folder, "g")  # sim and vLLM expect the same set


def run_join(
    actor: Actor, weight_sender: WeightSender, join: JoinWeightGroup, state, engine
) -> list:
    """The actor takes `join` while rank 0 publishes `state` to it; returns what it sent."""
    sent: list[Any] = []
    actor.client.send = sent.append  # type: ignore[method-assign]
    errors: list[Exception] = []

    def publish() -> None:
        try:
            weight_sender.publish(
                join.group_name, 2, state, 10.0, token=join.token, version=join.version
            )
        except WeightSyncError as exc:
            errors.append(exc)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()

    async def main() -> None:
        actor.engines = {"solver": engine}
        actor.running[7] = asyncio.create_task(asyncio.sleep(60))
        actor.leases[7] = None  # type: ignore[assignment]
        actor.started_at[7] = 0.0
        actor.joins.append((join, time.monotonic()))
        await actor.sync_weights()
        for task in actor.running.values():
            task.cancel()

    asyncio.run(asyncio.wait_for(main(), timeout=60))
    thread.join(30)
    return sent


def test_a_tampered_publish_never_goes_live_on_the_hf_engine(
    tiny_qwen_folder, weight_sender, monkeypatch
) -> None:
    monkeypatch.setattr(sender_module, "Pipeline", Tampering)
    cfg = load_config([])
    actor = Actor(cfg, "a1")
    engine = make_engine("solver", str(tiny_qwen_folder), cfg.actor.engine_of("solver"))
    asyncio.run(engine.start())
    before = engine.weights_digest()
    join = JoinWeightGroup("solver", 1, "g-hf", weight_sender.store_address, 1, 2, 10.0, "tok")
    sent = run_join(actor, weight_sender, join, learner_specs(tiny_qwen_folder), engine)
    loaded = [m for m in sent if isinstance(m, WeightsLoaded)]
    assert len(loaded) == 1 and not loaded[0].ok
    assert "digest" in loaded[0].error and "restored" in loaded[0].error
    assert engine.version == 0 and engine.weights_digest() == before  # bit for bit
    asyncio.run(engine.close())


def test_a_partial_header_is_refused_by_the_actor_before_loading(
    tiny_qwen_folder, weight_sender, monkeypatch
) -> None:
    """The attack of the issue, through the actor: 1 of the model's tensors, NaN-filled."""
    cfg = load_config([])
    actor = Actor(cfg, "a1")
    engine = make_engine("solver", str(tiny_qwen_folder), cfg.actor.engine_of("solver"))
    asyncio.run(engine.start())
    before = engine.weights_digest()
    loads: list[int] = []
    original = engine.load_weights
    engine.load_weights = lambda t, v: (loads.append(v), original(t, v))  # type: ignore[method-assign]
    name, tensor = learner_specs(tiny_qwen_folder)[0]
    nan = [(name, torch.full_like(tensor, float("nan")))]
    join = JoinWeightGroup("solver", 1, "g-part", weight_sender.store_address, 1, 2, 5.0)
    sent = run_join(actor, weight_sender, join, nan, engine)
    loaded = [m for m in sent if isinstance(m, WeightsLoaded)]
    assert len(loaded) == 1 and not loaded[0].ok and "missing" in loaded[0].error
    assert loads == []  # not a byte reached the model
    assert engine.weights_digest() == before and engine.version == 0
    asyncio.run(engine.close())


@pytest.mark.parametrize("rolls_back", [True, False])
def test_a_tampered_publish_rolls_back_sim_and_quarantines_an_in_place_engine(
    weight_sender, monkeypatch, rolls_back: bool
) -> None:
    monkeypatch.setattr(sender_module, "Pipeline", Tampering)
    cfg = load_config(["actor.engine.name=sim"])
    actor = Actor(cfg, "a1")
    sim = make_engine("solver", "", cfg.actor.engine_of("solver"))
    asyncio.run(sim.start())
    sim.load_weights([("w", torch.zeros(3))], 1)  # serving v1
    before = sim.weights_digest()
    engine = sim if rolls_back else InPlace(sim)
    join = JoinWeightGroup(
        "solver", 2, f"g-sim-{rolls_back}", weight_sender.store_address, 1, 2, 10.0
    )
    sent = run_join(actor, weight_sender, join, [("w", torch.ones(3))], engine)
    loaded = [m for m in sent if isinstance(m, WeightsLoaded)]
    assert len(loaded) == 1 and not loaded[0].ok and "digest" in loaded[0].error
    if rolls_back:
        assert sim.version == 1 and sim.weights_digest() == before
        assert 7 in actor.running
    else:  # half-loaded in place: its groups go back, no lease until a publish loads
        assert actor.quarantined == {"solver": 1} and sim.version == 1
        assert any(isinstance(m, LeaseReturn) and m.lease_ids == [7] for m in sent)
    asyncio.run(sim.close())


def vllm_receive(
    weight_sender: WeightSender, join: JoinWeightGroup, state, expected, packed: bool = False
) -> tuple[dict[str, Any], Any]:
    """One DrmasWorkerExtension.drmas_receive_weights in a fake vLLM worker (the mixin on
    a class with what it needs of vLLM's Worker) while rank 0 publishes `state`; `packed`:
    its weight is kept flat, as vLLM on CPU prepacks linear weights (no read-back)."""
    from drmas.actors.engines.vllm_worker import DrmasWorkerExtension

    class FakeVllmWorker(DrmasWorkerExtension):
        def __init__(self) -> None:
            self.device = torch.device("cpu")
            self.model = torch.nn.Linear(4, 4, bias=False)
            if packed:
                self.model.weight = torch.nn.Parameter(torch.zeros(16))
            self.model_runner = type("Runner", (), {"get_model": lambda _: self.model})()
            self.reloaded: list[str] = []

        def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
            for name, tensor in weights_iterator:
                self.reloaded.append(name)
                self.model.weight.data.copy_(tensor.reshape(self.model.weight.shape))

    def publish() -> None:
        with contextlib.suppress(WeightSyncError):  # the refused cases fail rank 0 too
            weight_sender.publish(join.group_name, 2, state, 10.0)

    worker = FakeVllmWorker()
    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    reply = worker.drmas_receive_weights(msgspec.msgpack.encode(join), True, pack(expected))
    thread.join(30)
    return reply, worker


def test_vllm_workers_refuse_a_partial_header_and_tampered_bytes(
    weight_sender, monkeypatch
) -> None:
    """The worker side of the vllm engine: a header naming 1 of 2 expected tensors never
    reaches vLLM's reload; tampered bytes fail the reload at its end (before the engine
    resumes), and the error comes back in the reply, which VLLMEngine raises, so the
    actor quarantines the engine (the in-place case above)."""
    linear = [("weight", torch.zeros(4, 4)), ("bias", torch.zeros(4))]
    state = [("weight", torch.full((4, 4), 2.0))]
    join = JoinWeightGroup("m", 1, "g-vllm-partial", weight_sender.store_address, 1, 2, 5.0)
    reply, worker = vllm_receive(weight_sender, join, state, expected_of(linear, "linear"))
    assert "missing 1" in reply["error"] and worker.reloaded == []

    monkeypatch.setattr(sender_module, "Pipeline", Tampering)
    join = JoinWeightGroup("m", 1, "g-vllm-tamper", weight_sender.store_address, 1, 2, 10.0)
    reply, worker = vllm_receive(weight_sender, join, state, expected_of(state, "weight"))
    assert "digest" in reply["error"] and worker.reloaded == ["weight"]


@pytest.mark.parametrize("packed", [False, True])
def test_a_vllm_worker_reports_its_fingerprint_without_hashing_what_the_receiver_did(
    weight_sender, monkeypatch, packed: bool
) -> None:
    """The worker's fingerprint of a publish: read back from the model where it can, else
    (CPU-prepacked weights) the digest the receiver checked against rank 0's, never a
    second hash of every tensor as it streams into the reload."""
    import drmas.actors.engines.vllm_worker as worker_module

    hashed: list[str] = []

    class Counting(worker_module.Digest):  # type: ignore[name-defined]
        def add(self, name: str, tensor: torch.Tensor) -> None:
            hashed.append(name)
            super().add(name, tensor)

    monkeypatch.setattr(worker_module, "Digest", Counting)
    state = [("weight", torch.arange(16.0).reshape(4, 4))]
    join = JoinWeightGroup("m", 1, f"g-vllm-fp-{packed}", weight_sender.store_address, 1, 2, 10.0)
    reply, worker = vllm_receive(weight_sender, join, state, expected_of(state, "weight"), packed)
    assert reply["error"] == "" and worker.reloaded == ["weight"]
    assert reply["digest"] == digest_of(state)
    assert reply["digest_source"] == ("received" if packed else "read back")
    assert hashed == []


def test_sglang_and_vllm_engines_expect_the_folders_parameters(tiny_qwen_folder) -> None:
    """Neither holds the model in this process: both expect what the folder's architecture
    names (checked by the actor's receiver for SGLang, in vLLM's workers for vLLM)."""
    from drmas.actors.engines.sglang import SGLangEngine
    from drmas.actors.engines.sglang_server import SGLangOptions
    from drmas.actors.engines.vllm import VLLMEngine
    from drmas.config.actor import EngineConfig

    header = Header(2**20, [spec_of(n, t) for n, t in learner_specs(tiny_qwen_folder)])
    join = JoinWeightGroup("policy", 1, "g", "h:1", 1, 2, 5.0)
    sglang = SGLangEngine("policy", tiny_qwen_folder, EngineConfig(), SGLangOptions(url="http://x"))
    vllm = VLLMEngine("policy", tiny_qwen_folder, EngineConfig(name="vllm"))
    for engine in (sglang, vllm):
        expected = expected_for(engine, join)
        assert expected is not None
        check_covers(header, expected, "g")
        with pytest.raises(WeightSyncError, match="missing 1 "):
            check_covers(Header(2**20, header.tensors[1:]), expected, "g")


def test_on_a_lora_base_a_publish_must_carry_whole_adapters_it_names(tiny_qwen_folder) -> None:
    """The hf engine (its live adapters) and the folder-built expectation of sim, vLLM and
    SGLang agree; a join naming adapter "x" takes every parameter of "x" and nothing
    else; a join naming none (an older broker) takes whole adapters only."""
    from drmas.actors.engines.expected import adapters_expected
    from drmas.actors.engines.hf import HFEngine
    from drmas.config.actor import EngineConfig
    from drmas.config.model import LoraConfig
    from drmas.models.lora import adapter_of_param

    lora = LoraConfig(rank=4, init_seed=3)

    async def main() -> None:
        engine = HFEngine("policy", tiny_qwen_folder, EngineConfig(device="cpu"), lora, ["x", "y"])
        await engine.start()
        every = [spec_of(n, t) for n, t in engine._adapter_params.items()]
        await engine.close()
        of_x = [s for s in every if adapter_of_param(s.name) == "x"]
        of_y = [s for s in every if adapter_of_param(s.name) == "y"]
        assert of_x and of_y and len(of_x) == len(of_y)
        for expect in (
            lambda carried: engine.expected_weights(carried),
            lambda carried: adapters_expected(tiny_qwen_folder, lora, ["x", "y"], carried),
        ):
            only_x = expect(["x"])
            check_covers(Header(2**20, of_x), only_x, "g")
            for wrong, match in ((of_x[1:], "missing 1 "), (of_x + of_y[:1], "unknown 1 ")):
                with pytest.raises(WeightSyncError, match=match):
                    check_covers(Header(2**20, wrong), only_x, "g")
            unnamed = expect([])
            for whole in ([], of_y, of_x + of_y):
                check_covers(Header(2**20, whole), unnamed, "g")
            with pytest.raises(WeightSyncError, match="missing 1 "):
                check_covers(Header(2**20, of_x + of_y[1:]), unnamed, "g")

    asyncio.run(asyncio.wait_for(main(), timeout=60))
