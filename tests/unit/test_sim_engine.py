"""SimEngine: batching counted in decode steps, its timing model, valid ids and log-probs,
weight loads that consume a real broadcast and fingerprint it, pause/resume."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import torch

from drmas.actors.engines import make_engine
from drmas.actors.engines.base import GenerateRequest, GenerateResult
from drmas.actors.engines.sim import SimEngine
from drmas.config.actor import EngineConfig
from drmas.config.model import LoraConfig
from drmas.config.transport import WeightSyncConfig
from drmas.models.builtin import char_tokenizer
from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.digest import digest_of
from drmas.transports.weights import WeightReceiver, WeightSender

T = TypeVar("T")
VOCAB = len(char_tokenizer())  # 99: 3 special ids + 96 characters


def run(body: Callable[[SimEngine], Awaitable[T]], **cfg: Any) -> tuple[T, SimEngine]:
    """Start a SimEngine without a model folder (builtin character tokenizer), run body."""
    engine = SimEngine("policy", "", EngineConfig(name="sim", **cfg))

    async def main() -> T:
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.close()

    return asyncio.run(asyncio.wait_for(main(), 60)), engine


def request(n: int, prompt: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(prompt or [10, 11, 12], temperature=1.0, top_p=1.0, max_new_tokens=n)


def test_registered_under_its_config_name() -> None:
    engine = make_engine("policy", "", EngineConfig(name="sim"))
    assert isinstance(engine, SimEngine)
    on_a_lora_base = make_engine("policy", "", EngineConfig(name="sim"), LoraConfig(rank=4), ["a"])
    assert isinstance(on_a_lora_base, SimEngine)
    with pytest.raises(ValueError, match=r"needs lora\.rank > 0 and its adapter names"):
        make_engine("policy", "", EngineConfig(name="sim"), LoraConfig(rank=4), [])
    with pytest.raises(ValueError, match=r"needs lora\.rank > 0 and its adapter names"):
        make_engine("policy", "", EngineConfig(name="sim"), None, ["a"])


def test_a_request_adapter_changes_nothing() -> None:
    """No model, no adapters: a request naming one is served as any other, from the same
    random stream (same seed: the same tokens)."""

    def tokens(adapter: str) -> list[list[int]]:
        async def body(engine: SimEngine) -> list[GenerateResult]:
            requests = [GenerateRequest([10, 11], 1.0, 1.0, 8, adapter=adapter)] * 3
            return await asyncio.gather(*(engine.generate(r) for r in requests))

        results, _ = run(body, sim_stop_prob=0.0, sim_token_latency_s=0.0)
        return [r.token_ids for r in results]

    assert tokens("solver") == tokens("") and len(tokens("")[0]) == 8


def test_concurrent_requests_share_decode_steps() -> None:
    """16 requests of 20 tokens pending together: 20 decode steps (one batch), not 320."""

    async def body(engine: SimEngine) -> list[GenerateResult]:
        return await asyncio.gather(*(engine.generate(request(20)) for _ in range(16)))

    results, engine = run(body, sim_stop_prob=0.0, sim_token_latency_s=0.001)
    assert all(len(r.token_ids) == 20 and r.finish_reason == "length" for r in results)
    assert engine.prefill_steps == 1
    assert engine.decode_steps == 20
    assert engine.tokens_generated == 16 * 20


def test_max_batch_splits_the_work() -> None:
    """max_batch=4 with 8 requests: the second half waits for room, so twice the steps."""

    async def body(engine: SimEngine) -> list[GenerateResult]:
        return await asyncio.gather(*(engine.generate(request(10)) for _ in range(8)))

    _, engine = run(body, sim_stop_prob=0.0, sim_token_latency_s=0.001, max_batch=4)
    assert engine.decode_steps == 20
    assert engine.prefill_steps == 2


def test_sequential_requests_cost_one_step_per_token_each() -> None:
    async def body(engine: SimEngine) -> None:
        for _ in range(3):
            await engine.generate(request(5))

    _, engine = run(body, sim_stop_prob=0.0, sim_token_latency_s=0.001)
    assert engine.decode_steps == 15 and engine.prefill_steps == 3


def test_latency_model_batching_beats_sequential_and_prompts_cost() -> None:
    """Relative timing: a batch of 8 takes about as long as 1 request (<< 8×), and a long
    prompt costs more than a short one under a per-prompt-token price."""
    latency = 0.01

    def timed(body: Callable[[SimEngine], Awaitable[Any]], **cfg: Any) -> float:
        async def wrapped(engine: SimEngine) -> float:
            start = time.perf_counter()
            await body(engine)
            return time.perf_counter() - start

        return run(wrapped, sim_stop_prob=0.0, **cfg)[0]

    one = timed(lambda e: e.generate(request(10)), sim_token_latency_s=latency)
    eight = timed(
        lambda e: asyncio.gather(*(e.generate(request(10)) for _ in range(8))),
        sim_token_latency_s=latency,
    )
    assert one >= 10 * latency  # 10 decode steps of at least `latency` each
    assert eight < 3 * one  # sequential would be 8x
    short = timed(
        lambda e: e.generate(request(1, [10] * 10)),
        sim_token_latency_s=0.0,
        sim_prompt_latency_s_per_token=0.002,
    )
    long = timed(
        lambda e: e.generate(request(1, [10] * 200)),
        sim_token_latency_s=0.0,
        sim_prompt_latency_s_per_token=0.002,
    )
    assert long >= 200 * 0.002 and long > 3 * short


def test_ids_in_vocabulary_logprobs_valid_and_both_finish_reasons() -> None:
    async def body(engine: SimEngine) -> list[GenerateResult]:
        return await asyncio.gather(*(engine.generate(request(30)) for _ in range(40)))

    results, engine = run(body, sim_stop_prob=0.05, sim_token_latency_s=0.0)
    eos = engine.eos_token_id
    reasons = {r.finish_reason for r in results}
    assert reasons == {"stop", "length"}
    for r in results:
        assert len(r.token_ids) == len(r.logprobs) >= 1
        assert all(0 <= t < VOCAB for t in r.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in r.logprobs)
        if r.finish_reason == "stop":
            assert r.token_ids[-1] == eos and eos not in r.token_ids[:-1]
        else:
            assert len(r.token_ids) == 30 and eos not in r.token_ids


def test_sim_vocab_size_caps_the_ids_and_seed_makes_it_reproducible() -> None:
    async def body(engine: SimEngine) -> list[int]:
        return (await engine.generate(request(200))).token_ids

    first, _ = run(body, sim_stop_prob=0.0, sim_token_latency_s=0.0, sim_vocab_size=20, seed=3)
    again, _ = run(body, sim_stop_prob=0.0, sim_token_latency_s=0.0, sim_vocab_size=20, seed=3)
    other, _ = run(body, sim_stop_prob=0.0, sim_token_latency_s=0.0, sim_vocab_size=20, seed=4)
    assert max(first) < 20 and len(set(first)) > 5
    assert first == again and first != other


def test_prompt_outside_the_vocabulary_is_refused() -> None:
    async def body(engine: SimEngine) -> None:
        await engine.generate(request(3, [VOCAB]))

    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(body)


def test_model_folder_tokenizer_and_config_vocab(tmp_path: Any) -> None:
    """A model folder gives the tokenizer and vocab_size; no weights file is needed."""
    char_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"vocab_size": 50}')
    engine = SimEngine("policy", tmp_path, EngineConfig(name="sim"))

    async def body() -> GenerateResult:
        await engine.start()
        try:
            return await engine.generate(request(100))
        finally:
            await engine.close()

    result = asyncio.run(body())
    assert engine.vocab_size == 50 and max(result.token_ids) < 50
    assert engine.tokenizer.decode([engine.tokenizer.eos_token_id]) == "<eos>"


def test_load_weights_over_a_real_broadcast_sets_version_and_digest() -> None:
    """Learner-side WeightSender -> WeightReceiver -> SimEngine.load_weights, several
    buckets: the engine's digest equals the digest of what was sent."""
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("model.embed.weight", torch.randn(300, 64, generator=g)),
        ("model.norm.weight", torch.randn(64, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(300, 64, generator=g)),
    ]
    cfg = WeightSyncConfig(bucket_mb=0.05, timeout_s=20)  # 50 KiB buckets: several
    sender = WeightSender(cfg)
    join = JoinWeightGroup("policy", 7, "policy/v7/1", sender.store_address, 1, 2, 20.0)
    engine = SimEngine("policy", "", EngineConfig(name="sim"))
    stats: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: stats.update(
            sent=sender.publish(join.group_name, 2, tensors, 20.0, peers=["sim"])
        )
    )
    thread.start()
    received = WeightReceiver(cfg).receive_into(join, lambda ts: engine.load_weights(ts, 7))
    thread.join(timeout=30)
    assert stats["sent"].bytes == received.bytes and received.buckets >= 3
    assert engine.version == 7 and engine.weight_loads == received.buckets
    assert engine.weights_digest() == digest_of(tensors)
    # a new version starts a fresh digest
    engine.load_weights([tensors[0]], 8)
    assert engine.version == 8 and engine.weights_digest() == digest_of([tensors[0]])


def test_pause_holds_between_steps_and_resume_continues() -> None:
    async def body(engine: SimEngine) -> tuple[int, int, GenerateResult]:
        pending = asyncio.ensure_future(engine.generate(request(50)))
        while engine.decode_steps < 3:
            await asyncio.sleep(0)
        await engine.pause()
        held_at = engine.decode_steps
        for _ in range(200):  # with no latency a step needs a few yields: room for all 50
            await asyncio.sleep(0)
        after_hold = engine.decode_steps
        engine.load_weights([("w", torch.ones(2))], 1)
        await engine.resume()
        return held_at, after_hold, await pending

    (held_at, after_hold, result), engine = run(
        body, sim_stop_prob=0.0, sim_token_latency_s=0.0, sim_prompt_latency_s_per_token=0.0
    )
    assert held_at == after_hold  # no decode step while paused
    assert len(result.token_ids) == 50 and result.finish_reason == "length"
    assert result.version == 0  # the version the request started with (as hf)
    assert engine.version == 1


def test_close_fails_pending_requests() -> None:
    async def main() -> None:
        engine = SimEngine("policy", "", EngineConfig(name="sim", sim_token_latency_s=0.01))
        await engine.start()
        pending = asyncio.ensure_future(engine.generate(request(1000)))
        while engine.decode_steps < 1:  # admitted and decoding
            await asyncio.sleep(0)
        await engine.close()
        with pytest.raises(RuntimeError, match="engine closed"):
            await pending

    asyncio.run(asyncio.wait_for(main(), 60))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="sim_stop_prob"):
        SimEngine("policy", "", EngineConfig(name="sim", sim_stop_prob=1.5))
    with pytest.raises(ValueError, match="sim_token_latency_s"):
        SimEngine("policy", "", EngineConfig(name="sim", sim_token_latency_s=-1))


def test_lora_base_digest_covers_every_adapter_across_subset_publishes(tmp_path: Any) -> None:
    """On a LoRA base a publish carries the adapters that changed; the learner fingerprints
    all of them. sim has no model, yet its digest must be over every adapter: the initial
    ones (as the learner builds them) with what arrived in their place."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from drmas.config.actor import EngineConfig
    from drmas.models.lora import add_adapters
    from drmas.transports.digest import digest_of
    from tests.unit.lora_helpers import ADAPTERS, LORA, published, tiny_model_folder

    folder = tiny_model_folder(tmp_path / "qwen2")
    engine = make_engine("base", str(folder), EngineConfig(name="sim"), LORA, ADAPTERS)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    initial = published(add_adapters(base, LORA, ADAPTERS))  # the learner's, before any step
    first, second = ADAPTERS[0], ADAPTERS[1]
    moved = [(n, t + 1.0) if f".{first}." in n else (n, t) for n, t in initial]
    engine.load_weights([(n, t) for n, t in moved if f".{first}." in n], 1)
    assert engine.version == 1 and engine.weights_digest() == digest_of(moved)
    engine.load_weights([], 2)  # a publish of no adapter: the version alone
    assert engine.version == 2 and engine.weights_digest() == digest_of(moved)
    again = [(n, t * 2.0) if f".{second}." in n else (n, t) for n, t in moved]
    engine.load_weights([(n, t) for n, t in again if f".{second}." in n], 3)
    assert engine.weights_digest() == digest_of(again) != digest_of(moved)
