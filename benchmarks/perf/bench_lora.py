"""LoRA adapters per agent on one base against one full model per agent: memory, weight
sync and generation, each as a ratio lora / full measured in the same run.

    .venv/bin/python benchmarks/perf/bench_lora.py [--only train generate engine_memory]
        [--agents 2 4] [--cache DIR] [--out benchmarks/results/lora.json]

Training: for N = 2 (the math team: solver, verifier) and N = 4 (the fixture team
tests/fixtures/four_agents.py: proposer, checker, critic, finisher), two short `drmas train`
runs on builtin:tiny-qwen2 with the same settings:
- full: N models, one per agent: N learner processes, and the actor's hf engines hold N
  models;
- lora: one model `base` with lora.rank 8 and every agent bound to it: one learner
  process, and one engine holding the base and N adapters.
Every child of the run (broker, learner-<model>-<rank>, actor-<i>, each with whatever it
starts) has its resident memory sampled every 0.25 s with psutil; reported: the peak of
the learners' sum and the actor's peak. Weight sync, per publish and per version (every
model's publish of one training step): seconds from metrics.jsonl (weight_sync_s/<model>),
bytes from the learner logs ("published ...: X MB", rounded to 0.1 MB) and exactly from
the exported tensors (model.safetensors, or the adapters' adapter_model.safetensors: a
publish carries the same tensors in the same dtype).

Generation (in-process, like bench_hf_engine.py; EOS off so every row decodes
--new-tokens): the same --batch requests, request j from agent j % N, served by one hf
engine holding one base and N adapters (each request names its agent's adapter), against N
hf engines, one per agent, in one event loop, as an actor holds one engine per model;
also one engine without adapters serving them all (what the adapters themselves cost).
Rounds alternate the three after a warm-up; medians of --reps rounds. The adapters' values
(B is zero at the start) do not change the work a forward does.

Engine memory on a real model: on the tiny model a process's own footprint (~450 MB)
hides its 4 MB of weights, so each of N = 2, 4 also starts, in a fresh process, either N
hf engines of builtin:smollm2-135m (135 M parameters, ~540 MB in fp32) or one with N
adapters, generates one request per agent, and reports the process's peak RSS.

The machine's load average is recorded before and after each part.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.provenance import git_state  # noqa: E402

MODEL = "builtin:tiny-qwen2"
SMOL = "builtin:smollm2-135m"  # the engine-memory part: a real model's weights
WARMSTART_STEPS = 60  # enough to write parseable answers; the build takes seconds
RANK = 8
TEAMS = {
    2: ("", ["solver", "verifier"]),
    4: ("tests.fixtures.four_agents:FourAgents", ["proposer", "checker", "critic", "finisher"]),
}
"""N -> (workflow.target, its agents)."""
OVERRIDES = [
    "train.steps=3", "group_size=4", "batch_groups=2", "val.every=0", "val.at_start=false",
    "sampling.max_new_tokens=24", "algorithm.loss.max_response_len=24",
    "actor.engine.name=hf", "run.samples_every=0", "train.progress=false",
]  # fmt: skip
PUBLISHED = re.compile(r"published (\S+): ([\d.]+) MB in (\d+) buckets .* in ([\d.]+)s")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def team_config(n: int, lora: bool) -> str:
    """The run's --config: N agents on N full models, or on one LoRA base."""
    target, agents = TEAMS[n]
    model = f"{{path: '{MODEL}', lr: 1e-4, warmstart: {{steps: {WARMSTART_STEPS}}}"
    if lora:
        models = f"  base: {model}, lora: {{rank: {RANK}}}}}\n"
        bindings = {agent: "base" for agent in agents}
    else:
        models = "".join(f"  {agent}: {model}}}\n" for agent in agents)
        bindings = {agent: agent for agent in agents}
    text = f"workflow: {{target: '{target}'}}\n" if target else ""
    text += "models:\n" + models
    text += "agents: {" + ", ".join(f"{a}: {{model: {m}}}" for a, m in bindings.items()) + "}\n"
    return text


def role_of(proc: psutil.Process) -> str:
    """learner-<model>-like name of a `drmas train` child from its command line ("" for a
    process that is not one of the run's roles)."""
    argv = proc.cmdline()
    if "drmas.launch.cli" not in argv:
        return ""
    words = argv[argv.index("drmas.launch.cli") + 1 :]
    role = words[0] if words else "?"
    for flag in ("--model", "--id"):
        if flag in words:
            role += f"-{words[words.index(flag) + 1]}"
    return f"{role}-{proc.pid}"


def sample_children(parent: psutil.Process) -> dict[str, int]:
    """RSS of each direct child of `parent`, with everything it started, by role name."""
    out: dict[str, int] = {}
    with contextlib.suppress(psutil.Error):
        for child in parent.children():
            with contextlib.suppress(psutil.Error):
                total = child.memory_info().rss
                for sub in child.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        total += sub.memory_info().rss
                role = role_of(child)
                if role:
                    out[role] = total
    return out


def run_train(n: int, lora: bool, cache: str) -> dict[str, Any]:
    """One `drmas train` of N agents (full or lora): peak memory by role, weight sync."""
    work = Path(tempfile.mkdtemp(prefix="drmas-bench-lora-"))
    config = work / "team.yaml"
    config.write_text(team_config(n, lora))
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "drmas.launch.cli", "train", "--config", str(config),
           *OVERRIDES, f"run.dir={run_dir}", f"run.cache_dir={cache}"]  # fmt: skip
    before = load()
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    parent = psutil.Process(proc.pid)
    peaks: dict[str, int] = {}
    peak_learners = peak_actors = 0
    while proc.poll() is None:
        rss = sample_children(parent)
        for name, value in rss.items():
            peaks[name] = max(peaks.get(name, 0), value)
        peak_learners = max(
            peak_learners, sum(v for k, v in rss.items() if k.startswith("learner"))
        )
        peak_actors = max(peak_actors, sum(v for k, v in rss.items() if k.startswith("actor")))
        time.sleep(0.25)
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-3000:]}")
    return {
        "config": team_config(n, lora),
        "wall_s": round(time.monotonic() - start, 1),
        "load_before_after": [before, load()],
        "learner_processes": sum(k.startswith("learner") for k in peaks),
        "peak_rss_mb": {k.rsplit("-", 1)[0]: round(v / 1e6) for k, v in sorted(peaks.items())},
        "learners_peak_rss_mb": round(peak_learners / 1e6),
        "actor_peak_rss_mb": round(peak_actors / 1e6),
        **weight_sync(run_dir),
    }


def weight_sync(run_dir: Path) -> dict[str, Any]:
    """Seconds and bytes per publish and per version, from the run's own records."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    per_version: dict[int, list[float]] = {}
    for line in lines:
        for key, value in line.items():
            if key.startswith("weight_sync_s/"):
                per_version.setdefault(line["step"], []).append(value)
    seconds = [s for v in per_version.values() for s in v]
    train_s: dict[int, float] = {}
    for line in lines:
        for key, value in line.items():
            if key.startswith("train_s/"):
                train_s[line["step"]] = train_s.get(line["step"], 0.0) + value
    logged = []
    for log in sorted((run_dir / "logs").glob("learner-*.log")):
        logged += [float(m.group(2)) for m in PUBLISHED.finditer(log.read_text(errors="replace"))]
    exact = exported_bytes(run_dir / "models")
    models = len(exact)
    return {
        "publishes": len(seconds),
        "publish_s_mean": round(statistics.mean(seconds), 4),
        "publish_s_median": round(statistics.median(seconds), 4),
        "version_s_mean": round(statistics.mean(sum(v) for v in per_version.values()), 4),
        "publish_mb_logged": sorted(set(logged)),
        "publish_bytes_exact": round(statistics.mean(exact.values())),
        "version_bytes_exact": sum(exact.values()),
        "models": models,
        "train_s_per_version": round(statistics.mean(train_s.values()), 3),
    }


def exported_bytes(models_dir: Path) -> dict[str, int]:
    """Per model: bytes of what one publish carries (the whole model, or every adapter)."""
    from safetensors import safe_open

    out: dict[str, int] = {}
    for folder in sorted(p for p in models_dir.iterdir() if p.is_dir()):
        adapters = folder / "adapters"
        files = sorted(adapters.glob("*/adapter_model.safetensors")) if adapters.is_dir() else []
        files = files or sorted(folder.glob("*.safetensors"))
        total = 0
        for file in files:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    t = f.get_tensor(key)
                    total += t.numel() * t.element_size()
        out[folder.name] = total
    return out


def train_part(agents: Sequence[int], cache: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for n in agents:
        full, lora = run_train(n, False, cache), run_train(n, True, cache)
        result[f"n{n}"] = {
            "full": full,
            "lora": lora,
            "learners_rss_ratio": round(
                lora["learners_peak_rss_mb"] / full["learners_peak_rss_mb"], 3
            ),
            "actor_rss_ratio": round(lora["actor_peak_rss_mb"] / full["actor_peak_rss_mb"], 3),
            "publish_bytes_ratio": round(
                lora["publish_bytes_exact"] / full["publish_bytes_exact"], 4
            ),
            "version_bytes_ratio": round(
                lora["version_bytes_exact"] / full["version_bytes_exact"], 4
            ),
            "publish_s_ratio": round(lora["publish_s_median"] / full["publish_s_median"], 3),
            "version_s_ratio": round(lora["version_s_mean"] / full["version_s_mean"], 3),
            "train_s_ratio": round(lora["train_s_per_version"] / full["train_s_per_version"], 3),
        }
        print(json.dumps({k: v for k, v in result[f"n{n}"].items() if "ratio" in k}), flush=True)
    return result


# ------------------------------------------------------------------ generation


async def tokens_per_s(jobs: list[tuple[Any, Any]], new: int) -> float:
    """Submit every (engine, request) at once, as an actor's episodes do; tokens/s."""
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(request) for engine, request in jobs))
    seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == len(jobs) * new, "a row stopped early"
    return tokens / seconds


async def generation(n: int, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One engine with N adapters against N engines, and one engine without adapters."""
    from drmas.actors.engines.base import GenerateRequest
    from drmas.actors.engines.hf import HFEngine
    from drmas.config.actor import EngineConfig
    from drmas.config.model import LoraConfig

    names = [f"agent{i}" for i in range(n)]
    cfg = EngineConfig(device="cpu", max_batch=args.batch)
    lora_engine = HFEngine("base", path, cfg, lora=LoraConfig(rank=RANK), adapters=names)
    full_engines = [HFEngine(name, path, cfg) for name in names]
    plain = HFEngine("plain", path, cfg)
    engines = [lora_engine, *full_engines, plain]
    for engine in engines:
        await engine.start()
        engine.eos_token_ids = set()  # every row runs to --new-tokens
    prompt_ids = prompts(lora_engine.tokenizer, args.batch)
    new = args.new_tokens
    ways = {
        "lora": [(lora_engine, GenerateRequest(p, 1.0, 1.0, new, adapter=names[j % n]))
                 for j, p in enumerate(prompt_ids)],
        "full": [(full_engines[j % n], GenerateRequest(p, 1.0, 1.0, new))
                 for j, p in enumerate(prompt_ids)],
        "one_plain_engine": [(plain, GenerateRequest(p, 1.0, 1.0, new)) for p in prompt_ids],
    }  # fmt: skip
    try:
        return await compare_ways(ways, new, args.reps)
    finally:
        for engine in engines:
            await engine.close()


async def compare_ways(
    ways: dict[str, list[tuple[Any, Any]]], new: int, reps: int
) -> dict[str, Any]:
    """Tokens/s of the ways `lora`, `full` and `one_plain_engine`: a warm-up round of each,
    then `reps` rounds alternating between them (the same background load); medians and
    the ratios of lora to the others."""
    runs: dict[str, list[float]] = {way: [] for way in ways}
    for jobs in ways.values():  # warm-up
        await tokens_per_s(jobs, new)
    for _ in range(reps):
        for way, jobs in ways.items():
            runs[way].append(round(await tokens_per_s(jobs, new), 1))
    median = {way: statistics.median(r) for way, r in runs.items()}
    return {
        "tokens_per_s": median,
        "ratio_lora_vs_full": round(median["lora"] / median["full"], 3),
        "ratio_lora_vs_one_plain_engine": round(median["lora"] / median["one_plain_engine"], 3),
        "runs": runs,
    }


def prompts(tokenizer: Any, batch: int) -> list[list[int]]:
    import random

    from drmas.teams.math.transcripts import ARITHMETIC, transcript

    rng = random.Random(0)
    texts = [transcript(rng, ARITHMETIC, i % 3)[0] for i in range(batch)]
    return [list(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]


def generate_part(agents: Sequence[int], path: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    before = load()
    result: dict[str, Any] = {f"n{n}": asyncio.run(generation(n, path, args)) for n in agents}
    result.update(
        batch=args.batch, new_tokens=args.new_tokens, reps=args.reps,
        torch_threads=torch.get_num_threads(), load_before_after=[before, load()],
    )  # fmt: skip
    return result


# ------------------------------------------------------------ engine memory, real model


def engine_memory_child(n: int, lora: bool, path: str) -> None:
    """In a fresh process: the N engines (or one with N adapters) started, one request per
    agent generated; prints the process's peak RSS in MB."""
    import resource

    import torch

    from drmas.actors.engines.base import GenerateRequest
    from drmas.actors.engines.hf import HFEngine
    from drmas.config.actor import EngineConfig
    from drmas.config.model import LoraConfig

    torch.set_num_threads(1)
    names = [f"agent{i}" for i in range(n)]
    cfg = EngineConfig(device="cpu", max_batch=n)

    async def run() -> None:
        if lora:
            engine = HFEngine("base", path, cfg, lora=LoraConfig(rank=RANK), adapters=names)
            jobs = [(engine, name) for name in names]
            engines = [engine]
        else:
            engines = [HFEngine(name, path, cfg) for name in names]
            jobs = [(engine, "") for engine in engines]
        for engine in engines:
            await engine.start()
        ids = list(engines[0].tokenizer("Question: 2+3\n", add_special_tokens=False).input_ids)
        await asyncio.gather(
            *(e.generate(GenerateRequest(ids, 1.0, 1.0, 8, adapter=a)) for e, a in jobs)
        )
        for engine in engines:
            await engine.close()

    asyncio.run(run())
    print(
        json.dumps({"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3)})
    )


def engine_memory_part(agents: Sequence[int], cache: str) -> dict[str, Any]:
    """Peak RSS of an actor-like process holding N whole copies of builtin:smollm2-135m
    against one copy with N adapters (each in its own process, one after the other)."""
    from drmas.models.builtin import resolve_model_path

    path = str(resolve_model_path(SMOL, cache))
    result: dict[str, Any] = {"model": SMOL, "load_before": load()}
    for n in agents:
        rss = {}
        for way in ("full", "lora"):
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--engine-memory-child",
                str(n),
                way,
                path,
            ]
            out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-3000:]}"
                )
            rss[way] = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]
        result[f"n{n}"] = {"peak_rss_mb": rss, "ratio": round(rss["lora"] / rss["full"], 3)}
        print(json.dumps({f"engine_memory_n{n}": result[f"n{n}"]}), flush=True)
    result["load_after"] = load()
    return result


def adapter_sizes(path: Path) -> dict[str, int]:
    """Parameters of the base and of one rank-RANK adapter (counted on the model)."""
    from transformers import AutoModelForCausalLM

    from drmas.config.model import LoraConfig
    from drmas.models.lora import adapter_param_names, add_adapters

    model = AutoModelForCausalLM.from_pretrained(path)
    base = sum(p.numel() for p in model.parameters())
    peft_model = add_adapters(model, LoraConfig(rank=RANK), ["a"])
    params = dict(peft_model.named_parameters())
    return {
        "base_params": base,
        "adapter_params": sum(params[n].numel() for n in adapter_param_names(peft_model)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", default=["train", "generate", "engine_memory"],
        choices=["train", "generate", "engine_memory"],
    )  # fmt: skip
    parser.add_argument("--engine-memory-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--agents", nargs="+", type=int, default=[2, 4], choices=sorted(TEAMS))
    parser.add_argument("--cache", default="", help="builtin model cache (default: a fresh one)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lora.json"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.engine_memory_child:
        n, way, path = args.engine_memory_child
        engine_memory_child(int(n), way == "lora", path)
        return

    from drmas.config.model import WarmStartConfig
    from drmas.models.builtin import resolve_model_path

    cache = args.cache or tempfile.mkdtemp(prefix="drmas-bench-cache-")
    path = resolve_model_path(MODEL, cache, WarmStartConfig(steps=WARMSTART_STEPS))
    result: dict[str, Any] = {
        "model": MODEL, "lora_rank": RANK, **adapter_sizes(path),
        **git_state(), "cpus": os.cpu_count(), "load_at_start": load(),
    }  # fmt: skip
    if "train" in args.only:
        result["train"] = train_part(args.agents, cache)
    if "generate" in args.only:
        result["generate"] = generate_part(args.agents, path, args)
    if "engine_memory" in args.only:
        result["engine_memory"] = engine_memory_part(args.agents, cache)
    result["load_at_end"] = load()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
