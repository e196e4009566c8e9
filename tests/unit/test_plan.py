"""`drmas plan`: the two paper recipes' placement and memory budget on a faked 8-GPU node
(placement.gpus=8), with their models absent, then with only a config.json in a Hugging
Face cache. Parameter counts are checked against transformers' own models built on the
meta device (no memory, no download)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drmas.config import load_config
from drmas.launch.placement import plan_placement
from drmas.launch.plan import GIB, budget, model_size, parameter_count

REPO = Path(__file__).resolve().parents[2]
MATH = ["experiment=math", "task.train_path=data/math_train.jsonl", "placement.gpus=8"]
SEARCH = ["experiment=search", "task.train_path=data/search_train.jsonl", "placement.gpus=8"]
QWEN3_4B = {  # Qwen/Qwen3-4B's config.json, the fields a count needs
    "model_type": "qwen3",
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}
QWEN25_3B = {  # Qwen/Qwen2.5-3B-Instruct's
    "model_type": "qwen2",
    "hidden_size": 2048,
    "num_hidden_layers": 36,
    "intermediate_size": 11008,
    "vocab_size": 151936,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def meta_numel(config: dict) -> int:
    """Parameters of the transformers model itself, built without memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "config",
    [
        QWEN3_4B,
        QWEN25_3B,
        {**QWEN25_3B, "tie_word_embeddings": False, "num_hidden_layers": 2},
        {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "vocab_size": 1000,
         "intermediate_size": 688, "num_attention_heads": 8, "num_key_value_heads": 4},
    ],
    ids=["qwen3-4b", "qwen2.5-3b", "qwen2-untied", "llama"],
)  # fmt: skip
def test_parameter_count_matches_transformers(config: dict) -> None:
    assert parameter_count(config) == meta_numel(config)


def test_mixture_of_experts_is_not_sized() -> None:
    assert parameter_count({**QWEN3_4B, "num_experts": 128}) is None


def fake_hub_cache(root: Path, repo: str, config: dict) -> None:
    """The layout huggingface_hub writes: refs/main names the snapshot holding the file."""
    folder = root / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "snapshots" / commit / "config.json").write_text(json.dumps(config))


def test_math_recipe_budget_from_a_cached_config_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    fake_hub_cache(tmp_path, "Qwen/Qwen3-4B", QWEN3_4B)
    assert model_size("Qwen/Qwen3-4B").params == meta_numel(QWEN3_4B)
    cfg = load_config(MATH)
    placement = plan_placement(cfg, 8)
    assert placement is not None
    text = budget(cfg, placement, gpu_gib=80)
    n = meta_numel(QWEN3_4B)
    # bf16-mixed: fp32 master + fp32 grad + two fp32 AdamW moments = 16 bytes a parameter
    learner = f"{n * 16 / GIB:.1f} GiB of weights, grads, AdamW (bf16-mixed), 1/1 shard"
    assert f"learner solver rank 0: {learner}; may use 1 of the GPU = 80.0 GiB of 80: fits" in text
    engine = f"{n * 2 / GIB:.1f} GiB of bfloat16 weights; may use 0.42 of the GPU"
    assert f"vllm verifier: {engine} = 33.6 GiB of 80: fits" in text
    # at 40 GiB the learner's 60 GiB of state does not fit
    assert "DOES NOT FIT" in budget(cfg, placement, gpu_gib=40)


def test_two_learner_ranks_halve_the_state(tmp_path: Path) -> None:
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN25_3B))
    paths = [f"models.{m}.path={folder}" for m in ("verifier", "searcher", "answerer")]
    cfg = load_config([*SEARCH, *paths, "learner.world_size=2", "actor.num_actors=2"])
    placement = plan_placement(cfg, 8)
    assert placement is not None
    n = meta_numel(QWEN25_3B)
    text = budget(cfg, placement)
    assert f"learner searcher rank 1: {n * 8 / GIB:.1f} GiB of weights, grads" in text
    assert f"{folder}/config.json" in text


@pytest.mark.parametrize(
    ("recipe", "models", "share"),
    [(MATH, ("solver", "verifier"), "0.42"), (SEARCH, ("answerer", "searcher", "verifier"), "0.28")],
    ids=["math", "search"],
)  # fmt: skip
def test_plan_command_prints_a_recipe_without_its_models(
    tmp_path: Path, recipe: list[str], models: tuple[str, ...], share: str
) -> None:
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "drmas.launch.cli", "plan", *recipe],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "placement on 8 GPU(s):" in out.stdout
    for gpu, model in enumerate(sorted(models)):  # one GPU per learner rank, sorted by model
        assert f"learner {model} rank 0: GPU {gpu}" in out.stdout
        assert f"`hf download {load_config(recipe).models[model].path} config.json`" in out.stdout
    assert f"may use {share} of the GPU" in out.stdout
    actors = 8 - len(models)  # the recipe's own num_actors: the rest of the node's GPUs
    assert load_config(recipe).actor.num_actors == actors  # not deploy=local's default
    for gpu in range(len(models), 8):
        assert f"  GPU {gpu}:\n    actor-{gpu - len(models)} vllm" in out.stdout
    assert f"actor-{actors} " not in out.stdout
    assert not list(tmp_path.iterdir())  # nothing was downloaded into the cache
