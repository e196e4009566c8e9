"""The vllm engine against vLLM itself: sampling throughput and weight-update time.

1. Throughput: our VLLMEngine (AsyncLLM, every request submitted at once the way the
   actor's episodes do, results converted to GenerateResult) vs vLLM's own offline
   `LLM.generate` on the same 64 math-team prompts, model and sampling (temperature 1,
   top-p 1, exactly `--new-tokens` tokens: EOS ignored on both sides, log-probs of the
   sampled token on both sides). Both engines stay up; after a warm-up, rounds
   alternate so both see the same background load; medians of `--reps` rounds.
   ratio = ours / LLM.generate tokens per second (target >= 0.9).
2. Weight update, for builtin:tiny-qwen2 (~3 MB) and a ~50 MB Qwen2 built here with the
   same tokenizer: seconds to pause, receive a publish over our weight group (gloo,
   learner stand-in broadcasting from a thread in this process, 8 MB buckets) and load it
   into the running model, resume; vs vLLM reloading the same weights from disk
   (`reload_weights` from a safetensors folder) and vs save + reload (what a learner
   would have to do to use the disk path). Medians of `--reps`.

Run with the vLLM environment (needs the __main__ guard: vLLM spawns processes):

    .venv-vllm/bin/python benchmarks/perf/bench_vllm_engine.py [--out PATH] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from drmas.actors.engines.base import GenerateRequest
from drmas.actors.engines.vllm import VLLMEngine
from drmas.config.actor import EngineConfig
from drmas.config.model import WarmStartConfig
from drmas.config.transport import WeightSyncConfig
from drmas.models.builtin import resolve_model_path
from drmas.protocol.messages import JoinWeightGroup
from drmas.teams.math.transcripts import ARITHMETIC, transcript
from drmas.transports.weights import WeightSender

EAGER = {"enforce_eager": True}  # no torch.compile warm-up: the same on both sides


class NoEosEngine(VLLMEngine):
    """VLLMEngine whose requests ignore EOS (benchmark only: fixed token counts)."""

    def _params(self, request: GenerateRequest) -> Any:
        params = super()._params(request)
        params.ignore_eos = True
        return params


def prompts(batch: int) -> list[str]:
    rng = random.Random(0)
    return [transcript(rng, ARITHMETIC, i % 3)[0] for i in range(batch)]


def build_50mb_qwen2(tiny: Path, folder: Path) -> Path:
    """A Qwen2 of ~50 MB float32 with the tiny model's tokenizer (random weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").exists():
        return folder
    config = AutoConfig.from_pretrained(tiny)
    config.update(
        {
            "hidden_size": 512,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 1536,
        }
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    for f in tiny.iterdir():
        if "token" in f.name or f.name == "generation_config.json":
            shutil.copy(f, folder / f.name)
    return folder


async def ours_tokens_per_s(engine: VLLMEngine, prompt_ids: list[list[int]], new: int) -> float:
    requests = [GenerateRequest(p, 1.0, 1.0, new) for p in prompt_ids]
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == len(requests) * new, "a request stopped early"
    return tokens / seconds


def llm_tokens_per_s(llm: Any, prompt_ids: list[list[int]], new: int) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=new, ignore_eos=True, logprobs=0, detokenize=False
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompt_ids) * new, "a request stopped early"
    return tokens / seconds


async def throughput(path: Path, args: argparse.Namespace) -> dict:
    from vllm import LLM

    cfg = EngineConfig(name="vllm", max_batch=args.batch, max_model_len=512, extra_args=EAGER)
    engine = NoEosEngine("bench", path, cfg)
    await engine.start()
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=args.batch,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        seed=0,
        disable_log_stats=True,
        **EAGER,
    )
    texts = prompts(args.batch)
    ids = [list(engine.tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
    await ours_tokens_per_s(engine, ids, args.new_tokens)  # warm-up
    llm_tokens_per_s(llm, ids, args.new_tokens)
    ours, theirs = [], []
    for _ in range(args.reps):
        ours.append(await ours_tokens_per_s(engine, ids, args.new_tokens))
        theirs.append(llm_tokens_per_s(llm, ids, args.new_tokens))
    await engine.close()
    llm.llm_engine.engine_core.shutdown()
    a, b = statistics.median(ours), statistics.median(theirs)
    return {
        "engine_tokens_per_s": round(a, 1),
        "llm_generate_tokens_per_s": round(b, 1),
        "ratio": round(a / b, 3),
        "engine_runs": [round(x, 1) for x in ours],
        "llm_generate_runs": [round(x, 1) for x in theirs],
        "batch": args.batch,
        "max_new_tokens": args.new_tokens,
    }


async def weight_update(path: Path, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    cfg = EngineConfig(name="vllm", max_batch=8, max_model_len=512, extra_args=EAGER)
    engine = VLLMEngine("bench", path, cfg)
    await engine.start()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tensors = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    sender = WeightSender(WeightSyncConfig(timeout_s=60), "cpu")
    group_s, disk_s, save_disk_s = [], [], []
    scratch = Path(tempfile.mkdtemp(prefix="drmas-bench-reload-"))
    try:
        for rep in range(args.reps + 1):  # the first round is a warm-up
            version = rep + 1
            name = f"bench-v{version}"
            join = JoinWeightGroup("bench", version, name, sender.store_address, 1, 2, 60.0)
            start = time.perf_counter()
            sending = asyncio.create_task(asyncio.to_thread(sender.publish, name, 2, tensors, 60.0))
            await engine.pause()
            await engine.receive_weights(join, digest=False)
            await engine.resume()
            await sending
            seconds = time.perf_counter() - start
            sender.release()

            start = time.perf_counter()
            model.save_pretrained(scratch)  # what a learner would write for a disk reload
            saved = time.perf_counter() - start
            start = time.perf_counter()
            await engine.pause()
            await engine.llm.collective_rpc(
                "reload_weights",
                timeout=120,
                kwargs={"weights_path": str(scratch), "is_checkpoint_format": True},
            )
            await engine.resume()
            reload = time.perf_counter() - start
            if rep:
                group_s.append(seconds)
                disk_s.append(reload)
                save_disk_s.append(saved + reload)
    finally:
        await engine.close()
        shutil.rmtree(scratch, ignore_errors=True)
    g, d, sd = (statistics.median(x) for x in (group_s, disk_s, save_disk_s))
    return {
        "megabytes": round(nbytes / 1e6, 1),
        "our_group_s": round(g, 3),
        "disk_reload_s": round(d, 3),
        "save_and_disk_reload_s": round(sd, 3),
        "ratio_group_vs_disk_reload": round(g / d, 3),
        "our_group_runs": [round(x, 3) for x in group_s],
        "disk_reload_runs": [round(x, 3) for x in disk_s],
    }


async def main(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cache = Path(tempfile.gettempdir()) / "drmas-bench"
    tiny = resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))
    medium = build_50mb_qwen2(tiny, cache / "qwen2-50mb")
    import vllm

    return {
        "throughput": await throughput(tiny, args),
        "weight_update": {
            "tiny-qwen2": await weight_update(tiny, args),
            "qwen2-50mb": await weight_update(medium, args),
        },
        "reps": args.reps,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_engine.json"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
