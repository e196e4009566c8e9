"""models.<m>.precision: the three documented values, and a guided error for the old dtype."""

from __future__ import annotations

import pytest

from drmas.config import ConfigError, load_config
from drmas.config.model import weights_dtype
from drmas.learners.sharding import precision_plan


def test_default_is_fp32_and_search_recipe_trains_fp32_masters() -> None:
    assert load_config([]).models["solver"].precision == "fp32"
    search = load_config(["experiment=search", "task.train_path=x.parquet"])
    assert {m.precision for m in search.models.values()} == {"bf16-mixed"}


def test_old_dtype_key_says_what_to_set() -> None:
    with pytest.raises(ConfigError, match=r"models\.solver\.precision: bf16-mixed"):
        load_config(["models.solver.dtype=bfloat16"])


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"precision='fp16'.*bf16-mixed"):
        load_config(["models.solver.precision=fp16"])


def test_plans() -> None:
    import torch

    master, policy = precision_plan("bf16-mixed")
    assert master == torch.float32 and policy is not None
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert precision_plan("fp32") == (torch.float32, None)
    assert precision_plan("bf16-pure") == (torch.bfloat16, None)
    assert [weights_dtype(p) for p in ("fp32", "bf16-mixed", "bf16-pure")] == [
        "float32",
        "bfloat16",
        "bfloat16",
    ]


@pytest.mark.parametrize("experiment", ["math", "search"])
def test_paper_recipes_load_with_their_settings(experiment: str) -> None:
    cfg = load_config([f"experiment={experiment}", "task.train_path=train.jsonl"])
    assert all(m.precision == "bf16-mixed" for m in cfg.models.values())
    assert all(m.lr == 1e-6 and m.weight_decay == 0.01 for m in cfg.models.values())
    assert cfg.learner.pack and cfg.learner.micro_batch_tokens > 0
    assert cfg.val.n == cfg.val.k == 16 and cfg.val.temperature == 0.6
    if experiment == "math":
        assert (cfg.group_size, cfg.batch_groups, cfg.learner.ppo_minibatches) == (8, 32, 1)
        assert cfg.algorithm.invalid_action_penalty == 0.1
        assert cfg.algorithm.loss.entropy_coef == 0.0
        assert {m.path for m in cfg.models.values()} == {"Qwen/Qwen3-4B"}
    else:
        assert (cfg.group_size, cfg.batch_groups, cfg.learner.ppo_minibatches) == (5, 128, 5)
        assert cfg.algorithm.invalid_action_penalty == 0.01
