"""One hash per load: the receiver hashes the engine's own tensors once each bucket is
loaded (the hf engine's `loaded_view`), so the check of rank 0's digest also proves the
engine holds what was sent, and the actor reports that fingerprint without a second pass
over the model. Hashes run on worker threads (Digest.submit) while the stream goes on.

The publish comes from a real sender in a thread over gloo on loopback; the engine is the
hf engine on the tiny builtin model, driven by the real Actor.sync_weights."""

from __future__ import annotations

import asyncio

import torch

import drmas.transports.digest as digest_module
from drmas.actors.engines import ReadsBack, make_engine
from drmas.actors.main import Actor
from drmas.config import load_config
from drmas.config.model import LoraConfig
from drmas.protocol.messages import JoinWeightGroup, WeightsLoaded
from drmas.transports.digest import Digest, digest_of
from tests.unit.test_weight_proof_engines import run_join


def new_weights(engine) -> list[tuple[str, torch.Tensor]]:
    """What learner rank 0 publishes to this engine: every parameter, in its dtype, new values."""
    torch.manual_seed(3)
    return [(n, torch.randn_like(p)) for n, p in engine.model.named_parameters()]


def test_the_actor_reports_the_read_back_fingerprint_without_hashing_the_model_again(
    tiny_qwen_folder, weight_sender
) -> None:
    cfg = load_config([])
    actor = Actor(cfg, "a1")
    engine = make_engine("solver", str(tiny_qwen_folder), cfg.actor.engine_of("solver"))
    asyncio.run(engine.start())
    assert isinstance(engine, ReadsBack) and engine.loaded_view() is not None
    second_passes: list[int] = []
    original = engine.weights_digest
    engine.weights_digest = lambda: (second_passes.append(1), original())[1]  # type: ignore[method-assign]
    state = new_weights(engine)
    join = JoinWeightGroup("solver", 1, "g-rb", weight_sender.store_address, 1, 2, 10.0, "tok")
    sent = run_join(actor, weight_sender, join, state, engine)
    loaded = [m for m in sent if isinstance(m, WeightsLoaded)]
    assert len(loaded) == 1 and loaded[0].ok, loaded
    assert second_passes == []  # the fingerprint came from the receive
    assert loaded[0].digest == digest_of(state) == original()  # what the learner reports
    asyncio.run(engine.close())


def test_a_load_that_silently_skips_a_tensor_is_caught_and_rolled_back(
    tiny_qwen_folder, weight_sender
) -> None:
    """An engine bug the bucket's own hash cannot see: load_weights drops one tensor.
    Hashing what the engine holds after the load fails the digest check: the publish is
    refused and the previous weights serve again."""
    cfg = load_config([])
    actor = Actor(cfg, "a1")
    engine = make_engine("solver", str(tiny_qwen_folder), cfg.actor.engine_of("solver"))
    asyncio.run(engine.start())
    before = engine.weights_digest()
    state = new_weights(engine)
    dropped = state[-1][0]
    original = engine.load_weights

    def lossy(tensors, version) -> None:
        original([(n, t) for n, t in tensors if n != dropped], version)

    engine.load_weights = lossy  # type: ignore[method-assign]
    join = JoinWeightGroup("solver", 1, "g-lossy", weight_sender.store_address, 1, 2, 10.0, "tok")
    sent = run_join(actor, weight_sender, join, state, engine)
    loaded = [m for m in sent if isinstance(m, WeightsLoaded)]
    assert len(loaded) == 1 and not loaded[0].ok
    assert "did not take them" in loaded[0].error and "restored" in loaded[0].error
    assert engine.version == 0 and engine.weights_digest() == before
    asyncio.run(engine.close())


def test_a_lora_base_offers_no_read_back(tiny_qwen_folder) -> None:
    """Its fingerprint covers every adapter; a publish may carry some."""
    cfg = load_config([])
    engine = make_engine(
        "solver",
        str(tiny_qwen_folder),
        cfg.actor.engine_of("solver"),
        LoraConfig(rank=4),
        ["solver", "verifier"],
    )
    asyncio.run(engine.start())
    assert isinstance(engine, ReadsBack) and engine.loaded_view() is None
    asyncio.run(engine.close())


def test_submitted_hashes_equal_inline_ones_and_bound_what_is_queued(monkeypatch) -> None:
    monkeypatch.setattr(digest_module, "PENDING_BYTES", 3000)
    torch.manual_seed(0)
    tensors = [(f"t{i}", torch.randn(200 + 50 * i)) for i in range(12)]  # 800..2,950 bytes
    inline, background = Digest(), Digest()
    for name, tensor in tensors:
        inline.add(name, tensor)
        background.submit(name, tensor)
        assert background._pending_bytes <= 3000  # waits rather than queue more
    background.submit("t0", tensors[5][1])  # a repeated name: the last one counts
    inline.add("t0", tensors[5][1])
    expected = digest_of([("t0", tensors[5][1]), *tensors[1:]])
    assert background.hexdigest() == inline.hexdigest() == expected
    assert background.hexdigest_of(["t3"]) == inline.hexdigest_of(["t3"])


def test_a_tensor_changed_after_wait_does_not_change_the_digest() -> None:
    tensor = torch.ones(1000)
    digest = Digest()
    digest.submit("w", tensor)
    digest.wait()
    tensor.add_(1)  # the next optimizer step, say
    assert digest.hexdigest() == digest_of([("w", torch.ones(1000))])
