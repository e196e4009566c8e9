"""`drmas eval`: the team on held-out tasks with frozen weights, scored per data source.

    drmas eval RUN_DIR                       the run's final weights (RUN_DIR/models/<m>)
    drmas eval RUN_DIR --step 20             its learner checkpoints at version 20 (on a
                                             LoRA base: the base and the checkpoint's adapters)
    drmas eval --model solver=DIR ...        model folders (by model or agent name) on the
                                             configured team (overrides as for train)
      [--data FILE ...] [--tasks N] [--k 16] [--n N] [--temperature 0.6] [--top-p 0.95]
      [--seed S] [--out FILE]

One process, no broker: the actor's engines (actor.engine: hf on CPU, vllm/sglang on GPU)
load each model's folder, the team (workflow.name / workflow.target) runs n episodes per
task, and a task counts as solved by an episode whose reward is >= 1. Reported per data
source and over all tasks: avg@k, pass@k (the unbiased estimator from n >= k samples) and
pass@1, each with its standard error over tasks, the team's own episode metrics, and
beside them each agent's mean step reward and the team's mean reward (its own pay where a
team sets Step.reward: drmas/launch/eval_rewards.py).
Writes JSON (RUN_DIR/eval.json by default; `per_task` keeps each task's successes of n,
so two reports on the same tasks can be compared task by task) and prints a table. The
defaults are the paper's evaluation settings: temperature 0.6, top-p 0.95, k = 16.

A learner checkpoint (safetensors shards and JSON, read without pickle) is first exported to a
Hugging Face folder next to it (step-N/hf), built on the run's starting model folder; on a
LoRA base the checkpoint holds only the adapters, exported as PEFT folders
(step-N/adapters/<adapter>/) which the engines load onto the run's base, as a run's final
adapters are (RUN_DIR/models/<m>/adapters/). A merged folder
(RUN_DIR/models/<m>/merged/<adapter>/, models.<m>.lora.export_merged) is a whole model:
evaluate it with models.<m>.lora.rank=0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drmas.broker.evaluation import EvalRound
from drmas.broker.sampling import lease_sampling
from drmas.config import DrmasConfig
from drmas.launch.eval_rewards import (
    TEAM_KEY,
    TaskResult,
    episode_rewards,
    format_rewards,
    reward_columns,
)
from drmas.protocol.messages import Task

log = logging.getLogger("drmas.eval")


class EvalError(ValueError):
    """An evaluation that cannot run; the message says what to pass instead."""


@dataclass(frozen=True)
class EvalSettings:
    k: int = 16
    n: int = 0
    """Samples per task; 0 = k."""
    temperature: float = 0.6
    top_p: float = 0.95
    tasks: int = 0
    """The first N tasks of every data file / of the validation split; 0 = all."""
    seed: int = 0

    @property
    def samples(self) -> int:
        return self.n or self.k


# ------------------------------------------------------------------------ weights
def choose_weights(
    cfg: DrmasConfig, run_dir: Path | None, step: int | None, folders: dict[str, str]
) -> dict[str, tuple[Path, str]]:
    """model -> (HF folder, where it came from). `folders` keys are model or agent names.
    On a LoRA base with `step`, the folder is the base the run started from (it never
    changes); the checkpoint's adapters are choose_adapters'."""
    given = _given_folders(cfg, folders)
    chosen: dict[str, tuple[Path, str]] = {}
    for model in sorted(cfg.models):
        if model in given:
            chosen[model] = (given[model], "folder")
        elif step is not None and cfg.has_adapters(model):
            find_checkpoint(cfg, run_dir, model, step)  # refused now if absent, before any load
            chosen[model] = (_initial(cfg, model), f"base; adapters of checkpoint step {step}")
        elif step is not None:
            ckpt = find_checkpoint(cfg, run_dir, model, step)
            chosen[model] = (export_checkpoint(cfg, model, ckpt), f"checkpoint step {step}")
        elif run_dir is not None and (run_dir / "models" / model / "config.json").is_file():
            chosen[model] = (run_dir / "models" / model, "final")
        else:
            chosen[model] = (_initial(cfg, model), "initial")
            log.warning(
                "model %s: no trained weights given, evaluating %s", model, chosen[model][0]
            )
    return chosen


def _given_folders(cfg: DrmasConfig, folders: dict[str, str]) -> dict[str, Path]:
    """model -> the whole-model folder `--model NAME=DIR` gives it (adapter folders are
    choose_adapters')."""
    from drmas.models.lora import MERGED_MARKER

    given: dict[str, Path] = {}
    for name, folder in folders.items():
        model = name if name in cfg.models else cfg.agents[name].model if name in cfg.agents else ""
        if not model:
            raise EvalError(
                f"--model {name}=...: {name!r} is neither a model {sorted(cfg.models)} nor an "
                f"agent {sorted(cfg.agents)}"
            )
        path = Path(folder).expanduser().resolve()
        if (path / "adapter_config.json").is_file() and cfg.has_adapters(model):
            continue  # an agent's adapter: choose_adapters takes it
        if not (path / "config.json").is_file():
            raise EvalError(f"--model {name}={folder}: no Hugging Face folder (config.json) there")
        if (path / MERGED_MARKER).is_file() and cfg.has_adapters(model):
            raise EvalError(
                f"--model {name}={folder} is a base with an adapter merged in, and model "
                f"{model!r} is a LoRA base whose engine would add the adapters again: evaluate "
                f"it as a whole model, with models.{model}.lora.rank=0 and --model "
                f"{model}={folder} (every agent of {model!r} then runs it)"
            )
        given[model] = path
    return given


def _initial(cfg: DrmasConfig, model: str) -> Path:
    """The model's folder as a run resolves it (a builtin is built into the cache once)."""
    from drmas.models.builtin import resolve_model_path

    m = cfg.models[model]
    return resolve_model_path(m.path, cfg.run.cache_dir or None, m.warmstart, m.revision)


def find_checkpoint(cfg: DrmasConfig, run_dir: Path | None, model: str, step: int) -> Path:
    """The folder of `model`'s complete learner checkpoint at version `step`."""
    from drmas.checkpoints import store

    if run_dir is None and not cfg.checkpoint.dir:
        raise EvalError("--step needs a run folder (or checkpoint.dir=FOLDER)")
    root = store.root_for(run_dir or "", cfg.checkpoint.dir)
    ckpt = store.find(root / model, step)
    if ckpt is None:
        have = [c.version for c in store.complete(root / model)]
        raise EvalError(f"model {model!r} has no checkpoint at step {step} (has {have})")
    return ckpt.path


def choose_adapters(
    cfg: DrmasConfig, run_dir: Path | None, folders: dict[str, str], step: int | None = None
) -> dict[str, dict[str, Path]]:
    """LoRA bases: model -> adapter -> PEFT folder (adapter_config.json and
    adapter_model.safetensors). `--model AGENT=DIR` names one agent's adapter; otherwise
    the learner checkpoint's at `step` (exported to its adapters/ folder), or a run's final
    adapters (RUN_DIR/models/<m>/adapters/<a>); an adapter with none of these starts as
    the base model (as its training did)."""
    from drmas.models.lora import ADAPTERS_FOLDER

    chosen: dict[str, dict[str, Path]] = {}
    for model in sorted(m for m in cfg.models if cfg.has_adapters(m)):
        if step is not None:
            ckpt = find_checkpoint(cfg, run_dir, model, step)
            chosen[model] = export_checkpoint_adapters(cfg, model, ckpt)
            continue
        found = {}
        for adapter in cfg.adapters_of(model):
            final = run_dir / "models" / model / ADAPTERS_FOLDER / adapter if run_dir else None
            if final is not None and (final / "adapter_config.json").is_file():
                found[adapter] = final
        chosen[model] = found
    for name, folder in folders.items():
        path = Path(folder).expanduser().resolve()
        if name in cfg.agents and (path / "adapter_config.json").is_file():
            model = cfg.model_of(name)
            if not cfg.has_adapters(model):
                raise EvalError(
                    f"--model {name}={folder} is a LoRA adapter, but model {model!r} has no "
                    f"adapters (models.{model}.lora.rank is 0)"
                )
            chosen[model][cfg.adapter_of(name)] = path
    return chosen


def adapter_tensors(folder: Path, adapter: str) -> list[tuple[str, Any]]:
    """A PEFT folder's tensors under the names the engines' adapters have."""
    from safetensors.torch import load_file

    from drmas.models.lora import name_from_saved

    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise EvalError(f"{folder}: no adapter_model.safetensors (a PEFT adapter folder?)")
    return sorted((name_from_saved(k, adapter), t) for k, t in load_file(str(file)).items())


def export_checkpoint(cfg: DrmasConfig, model: str, checkpoint: Path) -> Path:
    """A learner checkpoint as a Hugging Face folder (checkpoint/hf): the run's starting
    model with the checkpoint's weights (the optimizer state is not read). The checkpoint's
    files are safetensors and JSON (drmas/checkpoints/tensors.py); nothing is unpickled."""
    out = checkpoint / "hf"
    if (out / "config.json").is_file():
        return _exported(out, "*.safetensors")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drmas.checkpoints.tensors import full_tensors

    base = cfg.models[model].path
    if base.startswith("builtin:") or not Path(base).is_dir():
        raise EvalError(
            f"model {model!r}: the run's config names {base!r} as its starting folder, which "
            "is not a folder here; pass --model with a folder instead"
        )
    net = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    state = net.state_dict()
    saved = full_tensors(checkpoint, lambda key: key.startswith("model/"))
    missing = sorted(name for name in state if f"model/{name}" not in saved)
    if missing:
        raise EvalError(
            f"checkpoint {checkpoint} lacks {missing[:3]} of model {model!r} (a LoRA "
            "checkpoint, or another model's?): evaluate it with the run's own config"
        )
    net.load_state_dict({name: saved[f"model/{name}"] for name in state})
    tmp = checkpoint / ".hf-tmp"
    net.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    tmp.rename(out)
    return out


def _exported(folder: Path, weights: str) -> Path:
    """An export written earlier into a checkpoint folder, used again only when its weights
    are safetensors and no file in it is of a format read with pickle (a folder planted
    there must not run code in the engine that loads it)."""
    from drmas.checkpoints.store import PICKLED_SUFFIXES

    pickled = sorted(p.name for p in folder.rglob("*") if p.name.endswith(PICKLED_SUFFIXES))
    if pickled or not any(folder.glob(weights)):
        raise EvalError(
            f"{folder} holds {pickled or 'no safetensors weights'}: drmas writes its exports "
            f"as safetensors only, so it was not written by drmas; delete {folder} and run "
            "drmas eval again to export the checkpoint anew"
        )
    return folder


def export_checkpoint_adapters(cfg: DrmasConfig, model: str, checkpoint: Path) -> dict[str, Path]:
    """The adapters of a LoRA base's learner checkpoint as PEFT folders
    (checkpoint/adapters/<adapter>/, written once), by adapter, for those the config names.
    The checkpoint holds only what trains (the adapters and their AdamW state); the
    optimizer state is not read."""
    from drmas.models.lora import (
        ADAPTERS_FOLDER,
        adapter_of_param,
        peft_config,
        write_adapter_folder,
    )

    out = checkpoint / ADAPTERS_FOLDER
    if not out.is_dir():
        by_adapter: dict[str, list[tuple[str, Any]]] = {}
        for name, tensor in checkpoint_adapter_tensors(checkpoint).items():
            by_adapter.setdefault(adapter_of_param(name), []).append((name, tensor))
        config, base = peft_config(cfg.models[model].lora), str(_initial(cfg, model))
        tmp = checkpoint / f".{ADAPTERS_FOLDER}-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for adapter, tensors in sorted(by_adapter.items()):
            write_adapter_folder(config, adapter, tensors, tmp / adapter, base)
        tmp.rename(out)
    have = sorted(p.name for p in out.iterdir() if (p / "adapter_config.json").is_file())
    for adapter in have:
        _exported(out / adapter, "adapter_model.safetensors")
    missing = [a for a in cfg.adapters_of(model) if a not in have]
    if missing:
        raise EvalError(
            f"checkpoint {checkpoint} holds adapters {have}, not {missing} of model {model!r}: "
            "evaluate it with the run's own config (RUN_DIR/config.yaml)"
        )
    return {adapter: out / adapter for adapter in cfg.adapters_of(model)}


def checkpoint_adapter_tensors(checkpoint: Path) -> dict[str, Any]:
    """Every adapter tensor of a LoRA base's learner checkpoint (full tensors, in the
    dtype saved, under their PeftModel parameter names), read without a process group
    and without unpickling (safetensors and JSON: drmas/checkpoints/tensors.py)."""
    from drmas.checkpoints.tensors import full_tensors
    from drmas.learners.model_io import hf_name
    from drmas.models.lora import is_adapter_param

    state = full_tensors(
        checkpoint, lambda key: key.startswith("model/") and is_adapter_param(key)
    )  # not the optimizer's ("optim/...")
    if not state:
        raise EvalError(
            f"checkpoint {checkpoint} holds no LoRA adapters (a whole model's checkpoint?)"
        )
    return {hf_name(key.removeprefix("model/")): tensor for key, tensor in state.items()}


# -------------------------------------------------------------------------- tasks
def choose_tasks(cfg: DrmasConfig, data: Sequence[str], limit: int) -> list[Task]:
    """The tasks of each data file (the first `limit` of each), else the validation split."""
    from drmas.tasks.source import TaskSource, load_file

    if data:
        tasks: list[Task] = []
        for file in data:
            loaded = load_file(file, "eval", cfg.task.question_key, cfg.task.answer_key)
            tasks += loaded[:limit] if limit else loaded
        return tasks
    val = TaskSource(cfg.task).val_tasks(limit or None)
    if not val:
        raise EvalError(
            f"task source {cfg.task.name!r} has no held-out tasks: pass --data FILE.jsonl "
            "(or set task.val_path)"
        )
    return val


# ---------------------------------------------------------------------- evaluating
async def _load_adapters(engine: Any, folders: dict[str, Path]) -> None:
    """The chosen adapters into a started engine (before any request)."""
    named = [
        pair for adapter, folder in folders.items() for pair in adapter_tensors(folder, adapter)
    ]
    from drmas.actors.engines import LoadsAdapters

    await engine.pause()
    try:
        if isinstance(engine, LoadsAdapters):  # vLLM: new adapter folders for its workers
            await engine.load_adapters(named, 0)
        else:
            engine.load_weights(named, 0)
    finally:
        await engine.resume()


async def sample(
    cfg: DrmasConfig,
    weights: dict[str, tuple[Path, str]],
    tasks: list[Task],
    s: EvalSettings,
    adapters: dict[str, dict[str, Path]] | None = None,
) -> list[TaskResult]:
    """n episodes of every task by the team over engines holding `weights` (and, on a LoRA
    base, the `adapters` chosen for it)."""
    adapters = adapters or {}
    from drmas.actors.engines import make_engine
    from drmas.actors.main import engine_adapters, make_workflow

    engines = {}
    try:
        for model in sorted(cfg.models):
            pool = cfg.actor.engine_of(model)
            pool = dataclasses.replace(pool, seed=pool.seed + s.seed)
            lora = engine_adapters(cfg, model)
            engines[model] = make_engine(model, str(weights[model][0]), pool, **lora)
            await engines[model].start()
            if adapters.get(model):
                await _load_adapters(engines[model], adapters[model])
        team = make_workflow(
            cfg,
            {a: cfg.model_of(a) for a in cfg.agents},
            dict(engines),
            {m: e.tokenizer for m, e in engines.items()},
        )
        # --temperature/--top-p for every agent; each agent's length cap and stop strings
        sampling = lease_sampling(cfg, validation=True, temperature=s.temperature, top_p=s.top_p)
        limit = asyncio.Semaphore(max(1, cfg.actor.max_groups))
        done = 0
        start = time.monotonic()

        async def one(task: Task) -> TaskResult:
            nonlocal done
            async with limit:
                episodes = await team.run_group(task, sampling, s.samples)
            done += 1
            if done % max(1, -(-len(tasks) // 10)) == 0:
                log.info("%d/%d tasks (%.0fs)", done, len(tasks), time.monotonic() - start)
            return TaskResult(
                task,
                [e.reward for e in episodes],
                [dict(e.metrics) for e in episodes],
                [episode_rewards(e) for e in episodes],
            )

        try:
            return list(await asyncio.gather(*(one(t) for t in tasks)))
        finally:
            await team.close()
    finally:
        for engine in engines.values():
            await engine.close()


def score(results: Sequence[tuple[Any, ...]], s: EvalSettings) -> dict[str, Any]:
    """Over all tasks and per data source: avg@k, pass@k, pass@1 (± standard error over
    tasks), the team's episode metrics, and each agent's mean step reward beside the
    team's mean reward (`reward/<agent>`, `team_reward`), and `per_task`: each task's
    successes of n. `results`: TaskResults, or (task, rewards, metrics) triples."""
    rows = [TaskResult(*row) for row in results]
    sources = {r.task.source or "default" for r in rows}

    def table(part: list[TaskResult]) -> dict[str, float]:
        round_ = EvalRound(0, [r.task for r in part], s.samples, s.k)
        for r in part:
            round_.record(r.task, r.rewards, r.metrics)
        per_source = tuple(f"val/{src}/" for src in sources)  # reported separately
        metrics = {
            key.removeprefix("val/"): value
            for key, value in round_.metrics().items()
            if not key.startswith(per_source)
        }
        return metrics | reward_columns(part)

    by_source: dict[str, list[TaskResult]] = {}
    for row in rows:
        by_source.setdefault(row.task.source or "default", []).append(row)
    return {
        "overall": table(rows),
        "sources": {src: table(rows) for src, rows in sorted(by_source.items())},
        "per_task": {r.task.task_id: sum(x >= 1.0 for x in r.rewards) for r in rows},
    }


def format_table(report: dict[str, Any]) -> str:
    k = report["settings"]["k"]
    keys = (f"avg@{k}", f"pass@{k}", "pass@1")
    lines = ["| source | tasks | " + " | ".join(keys) + " |", "|---|---:|" + "---:|" * len(keys)]
    rows = [*report["sources"].items()]
    if len(rows) > 1:
        rows.append(("all", report["overall"]))
    for source, m in rows:
        cells = [f"{m[key]:.3f} ± {m[key + '/se']:.3f}" for key in keys]
        lines.append(f"| {source} | {int(m['tasks'])} | " + " | ".join(cells) + " |")
    o = report["overall"]
    extra = sorted(
        key for key in o if "@" not in key and "/" not in key and key not in ("tasks", TEAM_KEY)
    )
    if extra:
        lines.append("")
        lines.append("team metrics: " + ", ".join(f"{key} {o[key]:.3f}" for key in extra))
    rewards = format_rewards(o)
    if rewards:
        lines += ["", rewards]
    return "\n".join(lines)


def run_eval(
    cfg: DrmasConfig,
    run_dir: Path | None,
    settings: EvalSettings,
    *,
    step: int | None = None,
    folders: dict[str, str] | None = None,
    data: Sequence[str] = (),
    out: Path | None = None,
) -> dict[str, Any]:
    if settings.k < 1 or settings.samples < settings.k:
        raise EvalError(f"--k must be >= 1 and --n >= k, got k={settings.k}, n={settings.n}")
    if not (0 < settings.top_p <= 1) or settings.temperature < 0:
        raise EvalError("--top-p must be in (0, 1] and --temperature >= 0")
    weights = choose_weights(cfg, run_dir, step, folders or {})
    adapters = choose_adapters(cfg, run_dir, folders or {}, step)
    tasks = choose_tasks(cfg, data, settings.tasks)
    log.info(
        "evaluating %s on %d tasks x %d samples", {m: w[1] for m, w in weights.items()},
        len(tasks), settings.samples,
    )  # fmt: skip
    start = time.monotonic()
    results = asyncio.run(sample(cfg, weights, tasks, settings, adapters))
    report = {
        "run": str(run_dir) if run_dir else None,
        "team": cfg.workflow.name,
        "weights": {m: {"path": str(p), "from": how} for m, (p, how) in weights.items()},
        "adapters": {m: {a: str(p) for a, p in found.items()} for m, found in adapters.items()},
        "data": list(data) or f"{cfg.task.name} validation split",
        "settings": dataclasses.asdict(settings) | {"n": settings.samples},
        **score(results, settings),
        "wall_s": time.monotonic() - start,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return report
