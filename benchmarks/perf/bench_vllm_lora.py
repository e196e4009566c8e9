"""Generation with vLLM's multi-LoRA: one engine serving N adapters of one base against N
engines, one whole model per agent, on a real model (builtin:smollm2-135m).

For N = 2 and 4 agents, three ways to serve the same requests (temperature 1, top-p 1,
exactly `--new-tokens` tokens each: EOS ignored; `--batch` prompts of the math team, the
j-th asked by agent j mod N), all through drmas's own VLLMEngine:
- lora: one engine with `enable_lora` and the N adapters (drmas's initial adapters, as a
  run starts them; LoRA kernels run whatever the weights), each request naming its agent's
  adapter: what `models.<m>.lora` gives an actor;
- full: N engines of the base, one per agent, each given its agent's requests, all
  submitted at once: what an actor holding N whole models does;
- one_plain_engine: one engine without LoRA serving every request: what the adapters
  themselves cost.
All engines of an N stay up together; after a warm-up round of each way, the rounds
alternate between the ways (`--reps` rounds), so they see the same background load;
medians. Ratios: lora / full and lora / one_plain_engine, in tokens/s. Also each way's
memory once started: the proportional set size of its engines' processes (vLLM's engine
cores and workers; shared pages counted once), summed, in GB.

Run with the vLLM environment (the __main__ guard matters: vLLM spawns processes):

    .venv-vllm/bin/python benchmarks/perf/bench_vllm_lora.py [--out benchmarks/results/vllm_lora.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.perf.bench_lora import compare_ways, prompts  # noqa: E402
from benchmarks.perf.bench_vllm_engine import NoEosEngine  # noqa: E402
from drmas.actors.engines.base import GenerateRequest  # noqa: E402
from drmas.actors.engines.vllm import VLLMEngine  # noqa: E402
from drmas.config.actor import EngineConfig  # noqa: E402
from drmas.config.model import LoraConfig, WarmStartConfig  # noqa: E402
from drmas.models.builtin import resolve_model_path  # noqa: E402

MODEL = "builtin:smollm2-135m"
RANK = 8  # as experiment=smol_math
EAGER = {"enforce_eager": True}  # no torch.compile warm-up: the same for every way
# NoEosEngine (bench_vllm_engine.py): requests ignore EOS, so every one runs to --new-tokens


def pss_gb(before: set[int]) -> float:
    """Proportional set size (resident memory, pages shared between processes counted once
    in all) of this process's children started since `before`: the engine cores and
    workers of the engines just started, in GB."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        if child.pid not in before:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += child.memory_full_info().pss
    return round(total / 1e9, 3)


async def started(engines: list[VLLMEngine]) -> tuple[list[VLLMEngine], float]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    for engine in engines:
        await engine.start()
    return engines, pss_gb(before)


async def generation(n: int, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    names = [f"agent{i}" for i in range(n)]
    cfg = EngineConfig(name="vllm", max_batch=args.batch, max_model_len=512, extra_args=EAGER)
    lora = LoraConfig(rank=RANK, alpha=2 * RANK)
    (lora_engine,), lora_gb = await started([NoEosEngine("base", path, cfg, lora, names)])
    full_engines, full_gb = await started([NoEosEngine(name, path, cfg) for name in names])
    (plain,), plain_gb = await started([NoEosEngine("plain", path, cfg)])
    ids = prompts(lora_engine.tokenizer, args.batch)
    new = args.new_tokens
    ways = {
        "lora": [(lora_engine, GenerateRequest(p, 1.0, 1.0, new, adapter=names[j % n]))
                 for j, p in enumerate(ids)],
        "full": [(full_engines[j % n], GenerateRequest(p, 1.0, 1.0, new))
                 for j, p in enumerate(ids)],
        "one_plain_engine": [(plain, GenerateRequest(p, 1.0, 1.0, new)) for p in ids],
    }  # fmt: skip
    try:
        result = await compare_ways(ways, new, args.reps)
    finally:
        for engine in [lora_engine, *full_engines, plain]:
            await engine.close()
    return result | {
        "engine_pss_gb": {"lora": lora_gb, "full": full_gb, "one_plain_engine": plain_gb},
        "ratio_pss_lora_vs_full": round(lora_gb / full_gb, 3) if full_gb else None,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = resolve_model_path(MODEL, None, WarmStartConfig(steps=0))
    import vllm

    result: dict[str, Any] = {}
    for n in args.agents:
        result[f"n{n}"] = await generation(n, path, args)
        print(json.dumps({f"n{n}": result[f"n{n}"]}), flush=True)
    return result | {
        "model": MODEL,
        "lora_rank": RANK,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "kv_cache_gib_per_engine": os.environ["VLLM_CPU_KVCACHE_SPACE"],
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_lora.json"))
    parser.add_argument("--agents", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
