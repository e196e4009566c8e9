"""The sglang engine on a real SGLang server (marker `gpu`; skipped without CUDA or
without the sglang package: `pip install 'drmas[sglang]'`). Run by scripts/gpu_check.sh.

A tiny Qwen2 (character tokenizer, head_dim 64, bfloat16) is written to a temporary
folder; the engine starts `sglang.launch_server` on it as a managed child, generates
greedily, then a WeightSender (learner rank 0, gloo on CPU as the actor holds no GPU)
publishes a second model's weights to a WeightReceiver whose buckets go through the
engine's bridge into the server, exactly as the actor's sync_weights does. Checked: the
version the engine and the server report, and that the server's log-probs match a
transformers forward pass of whichever weights it should hold (tolerance 0.05 nats, for
bfloat16 kernels), before and after the update. Timings are printed (-s), never asserted.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="not on this GPU machine: sglang is not installed (pip install "
        "'drmas[sglang]'; its CUDA wheels are far over what can travel to the GPU machine "
        "this project gets), so its GPU path stays untested",
    ),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(300),
]

PROMPT = "12+7="
TOL = 0.05


def tiny_qwen2(folder: Path, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from drmas.models.builtin import char_tokenizer

    tokenizer = char_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def reference_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """log softmax of the HF model (float32 on CPU) at each generated position."""
    model = model.float().eval()
    ids = torch.tensor([prompt_ids + tokens[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 :]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [float(logp[i, t]) for i, t in enumerate(tokens)]


def test_sglang_generates_and_takes_a_publish(tmp_path: Path) -> None:
    from drmas.actors.engines.base import GenerateRequest
    from drmas.actors.engines.sglang import SGLangEngine
    from drmas.actors.engines.sglang_server import SGLangOptions
    from drmas.config.actor import EngineConfig
    from drmas.config.transport import WeightSyncConfig
    from drmas.protocol.messages import JoinWeightGroup
    from drmas.transports.weights import WeightReceiver, WeightSender

    folder = tmp_path / "model"
    old_model, tokenizer = tiny_qwen2(folder, seed=0)
    new_model, _ = tiny_qwen2(tmp_path / "new", seed=1)
    prompt = tokenizer(PROMPT)["input_ids"]
    request = GenerateRequest(prompt, temperature=0.0, top_p=1.0, max_new_tokens=8)
    opts = SGLangOptions(dtype="bfloat16", mem_fraction=0.3, start_timeout_s=300.0,
                         extra_args=["--disable-cuda-graph"])  # fmt: skip
    engine = SGLangEngine("m", folder, EngineConfig(dtype="bfloat16"), opts)
    sender = WeightSender(WeightSyncConfig(bucket_mb=0.5, backend="gloo"))

    async def main() -> None:
        start = time.perf_counter()
        await engine.start()
        print(f"\nSGLang server ready in {time.perf_counter() - start:.1f} s")
        try:
            before = await engine.generate(request)
            want = reference_logprobs(old_model, prompt, before.token_ids)
            assert before.logprobs == pytest.approx(want, abs=TOL)

            named = [(n, t.detach().cpu()) for n, t in new_model.state_dict().items()]
            join = JoinWeightGroup("m", 1, "m-v1", sender.store_address, 1, 2, 120.0)
            sent = threading.Thread(target=sender.publish, args=("m-v1", 2, named, 120.0))
            sent.start()
            start = time.perf_counter()
            await engine.pause()
            try:
                stats = await asyncio.to_thread(
                    WeightReceiver().receive_into, join, lambda b: engine.load_weights(b, 1)
                )
            finally:
                await engine.resume()
            sent.join(120)
            print(
                f"publish of {stats.bytes / 2**20:.1f} MiB in {stats.buckets} buckets through "
                f"the bridge: {time.perf_counter() - start:.2f} s"
            )
            assert engine.version == 1
            assert await asyncio.to_thread(engine.server_weight_version) == "1"

            after = await engine.generate(request)
            assert after.version == 1
            want = reference_logprobs(new_model, prompt, after.token_ids)
            assert after.logprobs == pytest.approx(want, abs=TOL)
            assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) > TOL
        finally:
            await engine.close()

    asyncio.run(main())
