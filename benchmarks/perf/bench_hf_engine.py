"""HFEngine sampling throughput vs transformers' own `generate` on the same model and batch.

Both sample the same 64 math-team prompts (different lengths, left-padded) at
temperature 1, top-p 1, for exactly `--new-tokens` tokens each: EOS is switched off on
both sides (the engine's eos set is emptied; `generate` gets a config without EOS), so
both do the same number of decode steps. The engine gets all requests at once, the way
the actor's episodes submit them, and runs them through its scheduler (prefill, KV-cached
decode, per-row sampling and log-probs, finish checks). After a warm-up of each, rounds
alternate the two so both see the same background load; the median of `--reps` rounds
is reported. ratio = engine / generate tokens per second (target >= 0.8).

The model is `builtin:tiny-qwen2` without warm start (same shape and cost, no 90 s build),
or any Hugging Face folder given with --model.

    .venv/bin/python benchmarks/perf/bench_hf_engine.py [--out PATH] [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.provenance import git_state  # noqa: E402
from drmas.actors.engines.base import GenerateRequest  # noqa: E402
from drmas.actors.engines.hf import HFEngine  # noqa: E402
from drmas.config.actor import EngineConfig  # noqa: E402
from drmas.config.model import WarmStartConfig  # noqa: E402
from drmas.models.builtin import resolve_model_path  # noqa: E402
from drmas.teams.math.transcripts import ARITHMETIC, transcript  # noqa: E402


def prompts(batch: int) -> list[str]:
    rng = random.Random(0)
    return [transcript(rng, ARITHMETIC, i % 3)[0] for i in range(batch)]


async def engine_tokens_per_s(engine: HFEngine, prompt_ids: list[list[int]], new: int) -> float:
    requests = [GenerateRequest(p, 1.0, 1.0, new) for p in prompt_ids]
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == len(requests) * new, "a row stopped early"
    return tokens / seconds


def generate_tokens_per_s(model: torch.nn.Module, batch: dict, new: int, config: object) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, generation_config=config)  # type: ignore[operator]
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    assert tokens == out.shape[0] * new, "a row stopped early"
    return tokens / seconds


async def main(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = args.model or resolve_model_path(
        "builtin:tiny-qwen2", tempfile.gettempdir() + "/drmas-bench", WarmStartConfig(steps=0)
    )
    engine = HFEngine("bench", path, EngineConfig(device="cpu", max_batch=args.batch))
    await engine.start()
    engine.eos_token_ids = set()  # every row runs to --new-tokens, like generate below
    tokenizer = engine.tokenizer
    texts = prompts(args.batch)
    prompt_ids = [list(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=None,
    )

    await engine_tokens_per_s(engine, prompt_ids, args.new_tokens)  # warm-up
    generate_tokens_per_s(model, batch, args.new_tokens, config)
    engine_runs, generate_runs = [], []
    for _ in range(args.reps):
        engine_runs.append(await engine_tokens_per_s(engine, prompt_ids, args.new_tokens))
        generate_runs.append(generate_tokens_per_s(model, batch, args.new_tokens, config))
    await engine.close()
    engine_tps, generate_tps = statistics.median(engine_runs), statistics.median(generate_runs)
    return {
        "engine_tokens_per_s": round(engine_tps, 1),
        "generate_tokens_per_s": round(generate_tps, 1),
        "ratio": round(engine_tps / generate_tps, 3),
        "batch": args.batch,
        "max_new_tokens": args.new_tokens,
        "torch_threads": torch.get_num_threads(),
        "reps": args.reps,
        "engine_runs": [round(x, 1) for x in engine_runs],
        "generate_runs": [round(x, 1) for x in generate_runs],
        "model": str(path),
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hf_engine.json"))
    parser.add_argument("--model", default="", help="HF folder (default: random tiny-qwen2)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    result = {**asyncio.run(main(args)), **git_state(), "load_at_start": load_at_start}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
