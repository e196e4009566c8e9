"""HFEngine against independent references: transformers' own generate (greedy), a plain
full forward pass (log-probs), and each request generated alone (continuous batching); on a
LoRA base, an unbatched peft forward with each request's adapter active."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from drmas.actors.engines.base import GenerateRequest, GenerateResult
from drmas.actors.engines.hf import HFEngine
from drmas.config.actor import EngineConfig
from drmas.config.model import LoraConfig, WarmStartConfig
from drmas.models.builtin import resolve_model_path
from drmas.models.lora import adapter_param_names, add_adapters
from drmas.transports.digest import digest_of

torch.set_num_threads(1)

T = TypeVar("T")
PROMPTS = [
    "Solve.\nQuestion: 3+4\nSolver:",
    "Check.\nQuestion: 12-19\nSolver: \\boxed{-7}\nVerifier:",
    "Hi",
    "Solve.\nQuestion: 18+18\nSolver: \\boxed{35}\nVerifier: <verify>no</verify>\nSolver:",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random (not warm-started) tiny Qwen2 from the builtin builder."""
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


@pytest.fixture(scope="module")
def reference(model_path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    return model, AutoTokenizer.from_pretrained(model_path)


def with_engine(
    model_path: Path,
    body: Callable[[HFEngine], Awaitable[T]],
    adapters: tuple[str, ...] = (),
    **cfg: Any,
) -> T:
    """`body` run on a started engine; `adapters`: a LoRA base (LORA) with these adapters."""

    async def main() -> T:
        lora = LORA if adapters else None
        config = EngineConfig(device="cpu", **cfg)
        engine = HFEngine("policy", model_path, config, lora, adapters)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.close()

    return asyncio.run(main())


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def greedy(prompt_ids: list[int], n: int, stop: tuple[str, ...] = ()) -> GenerateRequest:
    return GenerateRequest(prompt_ids, temperature=0.0, top_p=1.0, max_new_tokens=n, stop=stop)


def test_greedy_batch_matches_transformers_generate(model_path: Path, reference: Any) -> None:
    model, tokenizer = reference
    prompts = [ids_of(tokenizer, p) for p in PROMPTS]
    n = 12

    async def body(engine: HFEngine) -> list[GenerateResult]:
        return await asyncio.gather(*(engine.generate(greedy(p, n)) for p in prompts))

    results = with_engine(model_path, body)
    batch = tokenizer(PROMPTS, add_special_tokens=False, padding=True, return_tensors="pt")
    assert tokenizer.padding_side == "left"
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=n)
    eos = tokenizer.eos_token_id
    for row, result in zip(out[:, batch["input_ids"].shape[1] :].tolist(), results):
        expected = row[: row.index(eos) + 1] if eos in row else row
        assert result.token_ids == expected
        assert result.finish_reason == ("stop" if eos in row else "length")
        assert result.version == 0


def test_logprobs_equal_a_full_forward_pass(model_path: Path, reference: Any) -> None:
    model, tokenizer = reference
    prompts = [ids_of(tokenizer, p) for p in PROMPTS]
    requests = [
        GenerateRequest(prompts[0], temperature=1.0, top_p=1.0, max_new_tokens=10),
        GenerateRequest(prompts[1], temperature=0.7, top_p=0.9, max_new_tokens=10),
        GenerateRequest(prompts[2], temperature=0.0, top_p=1.0, max_new_tokens=10),
        GenerateRequest(prompts[3], temperature=1.3, top_p=0.5, max_new_tokens=10),
    ]

    async def body(engine: HFEngine) -> list[GenerateResult]:
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    for request, result in zip(requests, with_engine(model_path, body)):
        assert len(result.logprobs) == len(result.token_ids) > 0
        ids = request.prompt_ids + result.token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        temperature = request.temperature or 1.0
        logp = torch.log_softmax(logits / temperature, dim=-1)
        start = len(request.prompt_ids) - 1
        expected = [logp[start + i, t].item() for i, t in enumerate(result.token_ids)]
        assert result.logprobs == pytest.approx(expected, abs=1e-4)
        assert all(lp <= 0.0 for lp in result.logprobs)


def test_stop_strings_and_length(model_path: Path, reference: Any) -> None:
    _, tokenizer = reference
    prompt = ids_of(tokenizer, PROMPTS[0])

    async def body(engine: HFEngine) -> tuple[GenerateResult, GenerateResult, GenerateResult]:
        free = await engine.generate(greedy(prompt, 20))
        text = tokenizer.decode(free.token_ids, skip_special_tokens=True)
        assert len(text) >= 8, "the random model ended too early for this test"
        stop = text[4:6]
        stopped = await engine.generate(greedy(prompt, 20, stop=("never-appears", stop)))
        short = await engine.generate(greedy(prompt, 3))
        return free, stopped, short

    free, stopped, short = with_engine(model_path, body)
    text = tokenizer.decode(free.token_ids, skip_special_tokens=True)
    first = text.index(text[4:6]) + 2  # characters up to the end of the first occurrence
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:first]  # one token per character
    assert tokenizer.decode(stopped.token_ids).endswith(text[4:6])
    assert short.finish_reason == "length"
    assert short.token_ids == free.token_ids[:3] and len(short.logprobs) == 3


def test_requests_joining_a_running_batch_decode_exactly_as_alone(
    model_path: Path, reference: Any
) -> None:
    """Iteration-level scheduling: a second wave arrives while the first decodes, is admitted
    into the running batch (its prompts both longer and shorter than the running cache),
    and every row's greedy tokens equal those of the request generated alone."""
    _, tokenizer = reference
    first = [ids_of(tokenizer, p) for p in PROMPTS[:2]]
    second = [ids_of(tokenizer, PROMPTS[3]), ids_of(tokenizer, PROMPTS[2])]
    n = 24

    async def body(engine: HFEngine) -> tuple[list[GenerateResult], list[GenerateResult], int]:
        alone = [await engine.generate(greedy(p, n)) for p in first + second]
        wave1 = [asyncio.ensure_future(engine.generate(greedy(p, n))) for p in first]
        start = engine.tokens_generated
        while engine.tokens_generated < start + 2 * 5:  # both rows have decoded 5 tokens
            await asyncio.sleep(0)
        assert engine.num_running == 2
        wave2 = [asyncio.ensure_future(engine.generate(greedy(p, n))) for p in second]
        peak = 0
        while not all(f.done() for f in wave1 + wave2):
            peak = max(peak, engine.num_running)
            await asyncio.sleep(0)
        return alone, [f.result() for f in wave1 + wave2], peak

    alone, together, peak = with_engine(model_path, body)
    assert peak == 4  # the second wave ran alongside the first
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


def test_max_batch_limits_running_rows(model_path: Path, reference: Any) -> None:
    _, tokenizer = reference
    prompts = [ids_of(tokenizer, p) for p in PROMPTS] * 2

    async def body(engine: HFEngine) -> tuple[list[GenerateResult], int]:
        tasks = [asyncio.ensure_future(engine.generate(greedy(p, 8))) for p in prompts]
        peak = 0
        while not all(t.done() for t in tasks):
            peak = max(peak, engine.num_running)
            await asyncio.sleep(0)
        return [t.result() for t in tasks], peak

    results, peak = with_engine(model_path, body, max_batch=3)
    assert peak == 3
    assert [r.token_ids for r in results[:4]] == [r.token_ids for r in results[4:]]


def test_pause_holds_load_weights_changes_outputs_and_version(
    model_path: Path, reference: Any
) -> None:
    model, tokenizer = reference
    prompt = ids_of(tokenizer, PROMPTS[0])
    new_weights = {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(i))
        for i, (name, tensor) in enumerate(model.state_dict().items())
        if name != "lm_head.weight"
    }

    async def body(engine: HFEngine) -> tuple[GenerateResult, GenerateResult, GenerateResult]:
        before = await engine.generate(greedy(prompt, 16))
        running = asyncio.ensure_future(engine.generate(greedy(prompt, 40)))
        while engine.num_running == 0:
            await asyncio.sleep(0)
        await engine.pause()
        held = engine.tokens_generated
        for _ in range(20):
            await asyncio.sleep(0)
        assert engine.tokens_generated == held
        assert not running.done() and engine.num_running == 1
        engine.load_weights(new_weights.items(), version=3)
        assert engine.version == 3
        await engine.resume()
        after = await engine.generate(greedy(prompt, 16))
        return before, await running, after

    before, straddling, after = with_engine(model_path, body)
    assert straddling.version == 0  # admitted before the load
    assert after.version == 3
    assert after.token_ids != before.token_ids


def test_load_weights_names_shapes_and_tied_embeddings(model_path: Path, reference: Any) -> None:
    model, _ = reference
    embed = model.state_dict()["model.embed_tokens.weight"]

    async def body(engine: HFEngine) -> None:
        assert engine.weights_digest() != ""
        with pytest.raises(KeyError, match=r"model\.no_such\.weight"):
            engine.load_weights([("model.no_such.weight", torch.zeros(1))], version=1)
        with pytest.raises(ValueError, match="shape"):
            engine.load_weights([("model.norm.weight", torch.zeros(7))], version=1)
        assert engine.version == 0
        doubled = (embed * 2).to(torch.bfloat16)  # cast to the engine's dtype on copy
        engine.load_weights([("lm_head.weight", doubled)], version=1)
        assert engine.model is not None
        got = engine.model.get_input_embeddings().weight
        assert torch.equal(got, doubled.float())  # tied: one tensor, either name
        engine.load_weights([("model.embed_tokens.weight", embed)], version=2)
        assert torch.equal(engine.model.get_output_embeddings().weight, embed)
        assert engine.version == 2

    with_engine(model_path, body)


def test_a_backup_restores_the_weights_and_version_after_a_partial_load(
    model_path: Path, reference: Any
) -> None:
    async def body(engine: HFEngine) -> None:
        before = engine.weights_digest()
        backup = engine.backup_weights()
        assert engine.model is not None
        width = engine.model.get_input_embeddings().weight.shape[1]
        engine.load_weights([("model.norm.weight", torch.full((width,), 3.0))], version=5)
        with pytest.raises(KeyError):
            engine.load_weights([("model.no_such.weight", torch.zeros(1))], version=5)
        assert engine.version == 5 and engine.weights_digest() != before  # half-loaded
        engine.restore_weights(backup)
        assert engine.version == 0 and engine.weights_digest() == before

    with_engine(model_path, body)


def test_sampling_is_reproducible_from_the_seed(model_path: Path, reference: Any) -> None:
    _, tokenizer = reference
    prompts = [ids_of(tokenizer, p) for p in PROMPTS]

    async def body(engine: HFEngine) -> list[list[int]]:
        requests = [GenerateRequest(p, 1.0, 1.0, 12) for p in prompts]
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        return [r.token_ids for r in results]

    a = with_engine(model_path, body, seed=7)
    b = with_engine(model_path, body, seed=7)
    c = with_engine(model_path, body, seed=8)
    assert a == b
    assert a != c


def test_close_fails_pending_requests_and_cancelled_callers_are_dropped(
    model_path: Path, reference: Any
) -> None:
    _, tokenizer = reference
    prompt = ids_of(tokenizer, PROMPTS[0])

    async def main() -> None:
        engine = HFEngine("policy", model_path, EngineConfig(device="cpu"))
        await engine.start()
        cancelled = asyncio.ensure_future(engine.generate(greedy(prompt, 50)))
        while engine.num_running == 0:
            await asyncio.sleep(0)
        cancelled.cancel()
        ok = await engine.generate(greedy(prompt, 4))  # the engine keeps serving
        assert len(ok.token_ids) == 4 and engine.num_running == 0
        await engine.pause()
        pending = asyncio.ensure_future(engine.generate(greedy(prompt, 4)))
        await asyncio.sleep(0)
        await engine.close()
        with pytest.raises(RuntimeError, match="engine closed"):
            await pending
        with pytest.raises(RuntimeError, match="engine closed"):
            await engine.generate(greedy(prompt, 4))

    asyncio.run(main())


# ------------------------------------------------------------------ LoRA adapters

LORA = LoraConfig(rank=4, init_seed=3)
ADAPTERS = ("x", "y")


def lora_reference(model_path: Path) -> Any:
    """The learner's side: the base in fp32 with the adapters built by add_adapters."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path)
    return add_adapters(base, LORA, list(ADAPTERS)).eval()


@pytest.fixture(scope="module")
def trained(model_path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """A LoRA reference whose adapters moved away from the base (lora_B nonzero, each
    adapter its own values), and those adapter tensors by name: what a publish carries."""
    peft_model = lora_reference(model_path)
    params = dict(peft_model.named_parameters())
    published: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, name in enumerate(adapter_param_names(peft_model)):
            noise = torch.randn(params[name].shape, generator=torch.Generator().manual_seed(i))
            params[name].add_(0.1 * noise)
            published[name] = params[name].detach().clone()
    return peft_model, published


def reference_logits(peft_model: Any, adapter: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of one unbatched sequence with `adapter` ("" = the base)."""
    with torch.no_grad():
        if adapter:
            peft_model.set_adapter(adapter)
            return peft_model(input_ids=torch.tensor([ids])).logits[0].double()
        with peft_model.disable_adapter():
            return peft_model(input_ids=torch.tensor([ids])).logits[0].double()


def test_a_mixed_adapter_batch_gives_each_request_its_own_adapter(
    model_path: Path, reference: Any, trained: Any
) -> None:
    """Six requests over adapters x, y and the base in one engine (max_batch 4: two join the
    running batch later): each row's greedy tokens are its adapter's greedy choice and its
    log-probs its adapter's, from an unbatched peft forward; a base row is the plain model."""
    base_model, tokenizer = reference
    peft_model, published = trained
    prompts = [ids_of(tokenizer, p) for p in PROMPTS]
    requests = [
        GenerateRequest(prompts[0], 0.0, 1.0, 12, adapter="x"),
        GenerateRequest(prompts[0], 0.0, 1.0, 12, adapter="y"),
        GenerateRequest(prompts[0], 0.0, 1.0, 12, adapter=""),
        GenerateRequest(prompts[1], 1.0, 1.0, 10, adapter="y"),
        GenerateRequest(prompts[3], 0.8, 1.0, 10, adapter="x"),
        GenerateRequest(prompts[2], 1.0, 1.0, 10, adapter=""),
    ]

    async def body(engine: HFEngine) -> list[GenerateResult]:
        engine.load_weights(published.items(), version=2)
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    results = with_engine(model_path, body, adapters=ADAPTERS, max_batch=4)
    for request, result in zip(requests, results):
        ids = request.prompt_ids + result.token_ids
        logits = reference_logits(peft_model, request.adapter, ids)
        if not request.adapter:
            with torch.no_grad():
                plain = base_model(input_ids=torch.tensor([ids])).logits[0].double()
            assert torch.allclose(logits, plain, atol=1e-5)
        start = len(request.prompt_ids) - 1
        steps = logits[start : start + len(result.token_ids)]
        logp = torch.log_softmax(steps / (request.temperature or 1.0), dim=-1)
        expected = logp.gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
        assert result.logprobs == pytest.approx(expected.tolist(), abs=1e-5)
        assert result.version == 2
        if request.temperature == 0.0:
            assert result.token_ids == steps.argmax(dim=-1).tolist()
            ended = result.token_ids[-1] == tokenizer.eos_token_id
            assert ended or len(result.token_ids) == request.max_new_tokens
    x, y, base = (r.token_ids for r in results[:3])
    assert x != y and x != base and y != base  # the adapters matter


def test_lora_weights_digest_load_and_restore_cover_the_adapters_only(
    model_path: Path, trained: Any
) -> None:
    """The engine starts from the learner's adapters bit for bit; its digest is over the
    adapter tensors under the learner's names; a publish of bf16 copies into a bf16 engine
    digests as what was sent; base names and unknown adapters are refused; a backup
    restores the adapters after a partial load."""
    _, published = trained
    fresh = lora_reference(model_path)
    initial = digest_of((n, p) for n, p in fresh.named_parameters() if "lora_" in n)
    sent = {name: tensor.to(torch.bfloat16) for name, tensor in published.items()}

    async def fp32(engine: HFEngine) -> None:
        assert engine.weights_digest() == initial
        with pytest.raises(KeyError, match="unknown adapter parameter"):
            engine.load_weights([("base_model.model.model.norm.weight", torch.ones(1))], 1)
        with pytest.raises(ValueError, match="no adapter 'z'"):
            await engine.generate(GenerateRequest([5, 6], 0.0, 1.0, 2, adapter="z"))
        backup = engine.backup_weights()
        first = sorted(published)[:3]
        engine.load_weights([(n, published[n]) for n in first], version=4)
        assert engine.version == 4 and engine.weights_digest() != initial
        engine.restore_weights(backup)
        assert engine.version == 0 and engine.weights_digest() == initial

    async def bf16(engine: HFEngine) -> None:
        engine.load_weights(sent.items(), version=1)
        assert engine.weights_digest() == digest_of(sent.items())

    with_engine(model_path, fp32, adapters=ADAPTERS)
    with_engine(model_path, bf16, adapters=ADAPTERS, dtype="bfloat16")


def test_lora_publish_of_some_adapters_keeps_the_others(model_path: Path, trained: Any) -> None:
    """x alone (v1): x as sent, y exactly as it started (the same generation), the digest
    over both; y alone (v2): the digest over all that was sent; a subset naming a tensor
    that is no adapter parameter fails half-way and the backup restores v2; a publish
    without tensors (v3) sets the version only."""
    _, published = trained
    fresh = lora_reference(model_path)
    initial = {n: p.detach().clone() for n, p in fresh.named_parameters() if "lora_" in n}
    x = sorted((n, t) for n, t in published.items() if ".x." in n)
    y = sorted((n, t) for n, t in published.items() if ".y." in n)

    def on(adapter: str) -> GenerateRequest:
        return GenerateRequest([5, 6, 7, 8], 0.0, 1.0, 8, adapter=adapter)

    async def body(engine: HFEngine) -> None:
        y0 = await engine.generate(on("y"))
        engine.load_weights(x, version=1)
        assert engine.version == 1
        assert engine.weights_digest() == digest_of({**initial, **dict(x)}.items())
        y1 = await engine.generate(on("y"))
        assert (y1.token_ids, y1.logprobs, y1.version) == (y0.token_ids, y0.logprobs, 1)
        x1 = await engine.generate(on("x"))
        engine.load_weights(y, version=2)
        assert engine.weights_digest() == digest_of(published.items())
        x2 = await engine.generate(on("x"))
        assert (x2.token_ids, x2.logprobs) == (x1.token_ids, x1.logprobs)
        backup = engine.backup_weights()
        stray = x[0][0].replace(".x.", ".z.")
        with pytest.raises(KeyError, match=r"unknown adapter parameter .*\.z\."):
            engine.load_weights([(x[0][0], torch.zeros_like(x[0][1])), (stray, x[0][1])], 3)
        assert engine.version == 2 and engine.weights_digest() != digest_of(published.items())
        engine.restore_weights(backup)
        assert engine.version == 2 and engine.weights_digest() == digest_of(published.items())
        engine.load_weights([], version=3)
        assert engine.version == 3 and engine.weights_digest() == digest_of(published.items())

    with_engine(model_path, body, adapters=ADAPTERS)


def test_a_model_without_adapters_refuses_an_adapter_request(model_path: Path) -> None:
    async def body(engine: HFEngine) -> None:
        with pytest.raises(ValueError, match=r"lora\.rank is 0"):
            await engine.generate(GenerateRequest([5, 6], 0.0, 1.0, 2, adapter="x"))

    with_engine(model_path, body)
    with pytest.raises(ValueError, match=r"need lora\.rank > 0"):
        HFEngine("policy", model_path, EngineConfig(device="cpu"), LoraConfig(rank=0), ["x"])


def test_the_event_loop_runs_while_a_step_computes(model_path: Path, reference: Any) -> None:
    """A step's model calls run off the event loop: a forward that waits for a task on the
    loop (as a long prefill would keep heartbeats from going out) still completes, and the
    tokens are those of an undisturbed run."""
    _, tokenizer = reference
    request = greedy(ids_of(tokenizer, PROMPTS[0]), 6)

    async def body(engine: HFEngine) -> tuple[list[int], list[int]]:
        plain = await engine.generate(request)
        loop_ran = threading.Event()
        forward = engine._forward

        def waiting_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            with pytest.raises(RuntimeError):  # off the loop's thread: no running loop
                asyncio.get_running_loop()
            assert loop_ran.wait(60), "the event loop did not run during the step"
            return forward(*args, **kwargs)

        async def ticker() -> None:
            while True:
                loop_ran.set()
                await asyncio.sleep(0.001)

        engine._forward = waiting_forward  # type: ignore[method-assign]
        ticking = asyncio.create_task(ticker())
        try:
            loop_ran.clear()
            again = await engine.generate(request)
        finally:
            ticking.cancel()
            engine._forward = forward  # type: ignore[method-assign]
        return plain.token_ids, again.token_ids

    plain, again = with_engine(model_path, body)
    assert again == plain


def test_a_request_stops_at_the_models_context(model_path: Path, reference: Any) -> None:
    """The builtin model takes 512 positions: a response ends where prompt + response fill
    them (finish_reason "length"), and a prompt that fills them is refused up front, as the
    broker would refuse the step."""
    model, _ = reference
    context = model.config.max_position_embeddings
    prompt = [5] * (context - 3)

    async def body(engine: HFEngine) -> GenerateResult:
        with pytest.raises(
            ValueError, match=f"{context} tokens leaves no room in the model's context of {context}"
        ):
            await engine.generate(greedy([5] * context, 4))
        return await engine.generate(greedy(prompt, 20))

    result = with_engine(model_path, body)
    assert len(result.token_ids) <= 3 and len(prompt) + len(result.token_ids) <= context
    if len(result.token_ids) == 3:
        assert result.finish_reason == "length"
