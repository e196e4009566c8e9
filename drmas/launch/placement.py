"""Which GPUs each process of `drmas train` gets on this node.

    drmas train ── plan_placement(cfg, gpus) ──> Placement
                ── env_learner / env_actor ──> CUDA_VISIBLE_DEVICES of each child

Every learner rank gets one GPU of its own (FSDP/NCCL ranks cannot share a device).
Actors get the GPUs their engines need (the largest tensor_parallel_size of their pools;
all of an actor's engines share those GPUs). With enough GPUs the automatic plan gives
actors GPUs no learner uses ("exclusive"); with too few it puts them on the learners' GPUs
("shared": the learner and the engines split the memory, and weights then travel through
host memory over gloo, since NCCL cannot connect two ranks on one device). Explicit lists
in `placement.learners` / `placement.actors` replace the automatic choice. A plan that
oversubscribes a GPU is refused before anything starts, saying what to change.

Inside a placed process the visible GPUs start at cuda:0, so learners run with
LOCAL_RANK=0 whatever their rank.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from drmas.config import DrmasConfig
    from drmas.config.model import LoraConfig

_ENGINES_WITH_MEMORY = ("vllm", "sglang")  # engines that reserve a fraction of the GPU


class PlacementError(ValueError):
    """A plan that cannot work; the message says what to change."""


@dataclass(frozen=True)
class Placement:
    """GPU indices (of this node) per learner rank and per actor."""

    gpus: int
    learners: dict[str, tuple[int, ...]]
    """model -> GPU of each rank."""
    actors: tuple[tuple[int, ...], ...]
    """actor index -> its GPUs."""
    weights_backend: str
    """What weights.backend resolves to under this plan (gloo when a publisher shares its
    GPU with a receiver)."""
    colocated: tuple[str, ...] = ()
    """Models whose weight group has two members on one GPU."""

    @property
    def shared(self) -> list[int]:
        """GPUs used by more than one process."""
        users: dict[int, int] = defaultdict(int)
        for ranks in self.learners.values():
            for g in ranks:
                users[g] += 1
        for gpus in self.actors:
            for g in gpus:
                users[g] += 1
        return sorted(g for g, n in users.items() if n > 1)

    def env_learner(self, model: str, rank: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": str(self.learners[model][rank]), "LOCAL_RANK": "0"}

    def env_actor(self, index: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.actors[index]))}

    def describe(self) -> str:
        lines = [f"placement on {self.gpus} GPU(s):"]
        for model, ranks in sorted(self.learners.items()):
            lines += [f"  learner {model} rank {r}: GPU {g}" for r, g in enumerate(ranks)]
        lines += [f"  actor-{i}: GPU {','.join(map(str, g))}" for i, g in enumerate(self.actors)]
        shared = self.shared
        lines.append(
            f"  shared GPUs: {', '.join(map(str, shared))}" if shared else "  every GPU exclusive"
        )
        why = ""
        if self.colocated:
            why = (
                f" through host memory (the weight group of {', '.join(self.colocated)} has "
                "two members on one GPU, which NCCL cannot connect)"
            )
        lines.append(f"  weights: {self.weights_backend}{why}")
        return "\n".join(lines)


# A Linux machine with a GPU that torch can use has one of these: NVIDIA's control device,
# ROCm's kernel driver, or WSL2's GPU paravirtualisation.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def visible_gpus(cfg: DrmasConfig) -> int:
    """How many GPUs to plan over (0: a CPU run)."""
    engines = [cfg.actor.engine_of(m) for m in cfg.models]
    if cfg.learner.device == "cpu" and all(e.device == "cpu" for e in engines):
        return 0
    if cfg.placement.gpus >= 0:
        return cfg.placement.gpus
    if sys.platform.startswith("linux") and not any(Path(f).exists() for f in GPU_DEVICE_FILES):
        return 0  # no GPU driver: skip importing torch (3 s of CPU at every launch)
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_placement(cfg: DrmasConfig, gpus: int) -> Placement | None:
    """The plan for `gpus` GPUs (None: a CPU run). Raises PlacementError."""
    if gpus <= 0:
        return None
    learners = _learner_gpus(cfg, gpus)
    actors = _actor_gpus(cfg, gpus, learners)
    _check_memory(cfg, learners, actors)
    colocated = _colocated(cfg, learners, actors)
    return Placement(gpus, learners, actors, _weights_backend(cfg, colocated), colocated)


def _learner_gpus(cfg: DrmasConfig, gpus: int) -> dict[str, tuple[int, ...]]:
    """One GPU per rank; the ranks of one model always on different GPUs. Learners of
    different models share GPUs only when there are fewer GPUs than ranks (and share is
    not exclusive)."""
    pc = cfg.placement
    out: dict[str, tuple[int, ...]] = {}
    taken = {g for m, gs in pc.learners.items() if m in cfg.models for g in gs}
    order = [g for g in range(gpus) if g not in taken] or list(range(gpus))
    total = sum(cfg.world_size_of(m) for m in cfg.models)
    cursor = 0
    for model in sorted(cfg.models):
        world = cfg.world_size_of(model)
        explicit = pc.learners.get(model)
        if explicit is not None:
            ranks = tuple(int(g) for g in explicit)
            if len(ranks) != world:
                raise PlacementError(
                    f"placement.learners.{model} lists {len(ranks)} GPU(s) for {world} "
                    f"learner rank(s): give one GPU per rank"
                )
        else:
            if world > len(order):
                raise PlacementError(
                    f"learner {model} has {world} ranks but only {len(order)} GPU(s) are free "
                    "for it: its ranks need a GPU each (lower its world_size, or add GPUs)"
                )
            ranks = tuple(order[(cursor + k) % len(order)] for k in range(world))
            cursor += world
        _in_range(ranks, gpus, f"placement.learners.{model}")
        if len(set(ranks)) != len(ranks):
            raise PlacementError(
                f"placement.learners.{model}={list(ranks)}: the ranks of one learner group "
                "need different GPUs (NCCL cannot put two ranks on one device)"
            )
        out[model] = ranks
    if pc.share == "exclusive":
        used: dict[int, str] = {}
        for model, ranks in out.items():
            for r, g in enumerate(ranks):
                if g in used:
                    raise PlacementError(
                        f"placement.share=exclusive, but GPU {g} is given to learner {used[g]} "
                        f"and to learner {model} rank {r} ({total} learner ranks, {gpus} "
                        "GPUs): list other GPUs in placement.learners, or use share=auto"
                    )
                used[g] = f"{model} rank {r}"
    return out


def _actor_gpus(
    cfg: DrmasConfig, gpus: int, learners: dict[str, tuple[int, ...]]
) -> tuple[tuple[int, ...], ...]:
    pc = cfg.placement
    count = cfg.actor.num_actors
    served = cfg.actor.models or sorted(cfg.models)
    width = max(cfg.actor.engine_of(m).tensor_parallel_size for m in served)
    if width > gpus:
        raise PlacementError(
            f"an actor's engines need {width} GPUs (tensor_parallel_size) but this node has {gpus}"
        )
    learner_gpus = sorted({g for ranks in learners.values() for g in ranks})
    spare = [g for g in range(gpus) if g not in learner_gpus]
    exclusive = len(spare) >= count * width
    if pc.share == "exclusive" and not exclusive and len(pc.actors) < count:
        raise PlacementError(
            f"placement.share=exclusive: {count} actor(s) x {width} GPU(s) do not fit in the "
            f"{len(spare)} GPU(s) left after the learners; use placement.share=auto, fewer "
            "actors (actor.num_actors) or more GPUs"
        )
    out: list[tuple[int, ...]] = []
    for i in range(count):
        explicit = pc.actors.get(str(i))
        if explicit is not None:
            chosen = tuple(int(g) for g in explicit)
            if len(chosen) != width or len(set(chosen)) != width:
                raise PlacementError(
                    f"placement.actors.{i}={list(chosen)}: the actor's engines need {width} "
                    "different GPU(s) (the largest tensor_parallel_size of its pools)"
                )
            _in_range(chosen, gpus, f"placement.actors.{i}")
        elif exclusive and pc.share != "shared":
            chosen = tuple(spare[i * width : (i + 1) * width])
        else:  # on the learners' GPUs first, round-robin over the node
            order = learner_gpus + spare
            chosen = tuple(order[(i * width + k) % gpus] for k in range(width))
        if pc.share == "exclusive" and set(chosen) & set(learner_gpus):
            raise PlacementError(
                f"placement.share=exclusive but actor-{i} is on a learner's GPU {list(chosen)}"
            )
        out.append(chosen)
    return tuple(out)


def _check_memory(
    cfg: DrmasConfig, learners: dict[str, tuple[int, ...]], actors: tuple[tuple[int, ...], ...]
) -> None:
    """Engines that reserve a fraction of their GPU must fit beside each other and beside a
    learner rank on the same GPU."""
    served = cfg.actor.models or sorted(cfg.models)
    reserved: dict[int, list[str]] = defaultdict(list)
    total: dict[int, float] = defaultdict(float)
    for i, gs in enumerate(actors):
        for model in served:
            engine = cfg.actor.engine_of(model)
            if engine.name in _ENGINES_WITH_MEMORY:
                for g in gs:
                    total[g] += engine.gpu_memory_utilization
                    reserved[g].append(f"actor-{i} {model} {engine.gpu_memory_utilization:g}")
    learners_on: dict[int, int] = defaultdict(int)
    for ranks in learners.values():
        for g in ranks:
            learners_on[g] += 1
    keep = cfg.placement.learner_memory
    for g, used in total.items():
        room = 1.0 - keep * learners_on[g]
        if used > room + 1e-9:
            beside = (
                f" beside {learners_on[g]} learner rank(s) (placement.learner_memory={keep:g} each)"
            )
            raise PlacementError(
                f"GPU {g} is oversubscribed: engines reserve {used:.2f} of its memory "
                f"({'; '.join(reserved[g])}) but may take {max(room, 0.0):.2f}"
                f"{beside if learners_on[g] else ''}; lower the engines' "
                "gpu_memory_utilization (actor.engine / actor.pools.<model>), or give the "
                "actors GPUs of their own"
            )


def _colocated(
    cfg: DrmasConfig, learners: dict[str, tuple[int, ...]], actors: tuple[tuple[int, ...], ...]
) -> tuple[str, ...]:
    """Models whose weight group (publishing rank 0, every actor receiving) has two members
    on one GPU."""
    served = set(cfg.actor.models or cfg.models)
    out = []
    for model, ranks in sorted(learners.items()):
        members = [(ranks[0],), *actors] if model in served else []
        seen = [g for gs in members for g in gs]
        if len(seen) != len(set(seen)):
            out.append(model)
    return tuple(out)


def _weights_backend(cfg: DrmasConfig, colocated: tuple[str, ...]) -> str:
    """gloo (through host memory) when a weight group has two members on one GPU; else
    what weights.backend says (auto: nccl on GPUs). One backend for the whole run."""
    if not colocated:
        return "nccl" if cfg.weights.backend == "auto" else cfg.weights.backend
    if cfg.weights.backend == "nccl":
        raise PlacementError(
            f"weights.backend=nccl, but the weight group of {', '.join(colocated)} has two "
            "members on one GPU and NCCL cannot connect two ranks on one device: use "
            "weights.backend=auto (gloo through host memory) or give the actors own GPUs"
        )
    return "gloo"


def _in_range(gpus: tuple[int, ...], count: int, key: str) -> None:
    bad = [g for g in gpus if not 0 <= g < count]
    if bad:
        raise PlacementError(
            f"{key}: GPU {bad[0]} does not exist (this node has {count}: 0..{count - 1})"
        )


def adapter_plan(cfg: DrmasConfig) -> str:
    """What each LoRA base holds: its adapters (and the agents on each), one learner group
    for all of them, and the adapter slots the engine serving it keeps. "" when no model
    has adapters."""
    lines = []
    for model in cfg.models:
        if not cfg.has_adapters(model):
            continue
        adapters = cfg.adapters_of(model)
        rank = cfg.models[model].lora.rank
        users = {a: [n for n in cfg.agents_of(model) if cfg.adapter_of(n) == a] for a in adapters}
        bound = ", ".join(f"{a} ({'+'.join(users[a])})" for a in adapters)
        lines.append(
            f"model {model}: {len(adapters)} LoRA adapters of rank {rank} on one frozen base "
            f"[{bound}]; one learner group trains them all; "
            + _engine_slots(cfg.actor.engine_of(model).name, cfg.models[model].lora, adapters)
        )
    return "\n".join(lines)


def _engine_slots(engine: str, lora: LoraConfig, adapters: list[str]) -> str:
    """The adapter slots an engine keeps for `adapters` (engines/vllm_lora.py,
    engines/sglang_server.py decide them; said here before anything starts)."""
    n = len(adapters)
    if engine == "vllm":
        from drmas.actors.engines.vllm_lora import lora_engine_args

        args = lora_engine_args(lora, adapters)
        return (
            f"vLLM holds max_loras={args['max_loras']} (one more on CPU, where the base is "
            f"served by an all-zero adapter), max_lora_rank={args['max_lora_rank']}"
        )
    if engine == "sglang":
        return f"SGLang holds max_loras_per_batch={2 * n + 1}, max_lora_rank={lora.rank}"
    return f"the {engine} engine holds one copy of the base and {n} adapters"
