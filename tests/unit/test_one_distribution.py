"""Training samples come from the distribution the learner scores them under: the config
refuses a nucleus (sampling.top_p < 1) for training, saying why and what to set, while
validation keeps its own top_p. (That every SGLang sampling field is pinned is checked in
test_sglang_contract.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from drmas.config import ConfigError, load_config


@pytest.mark.parametrize("top_p", ["0.95", "0.5", "0.999"])
def test_training_top_p_below_one_is_refused_with_why_and_what_to_set(top_p: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([f"sampling.top_p={top_p}"])
    message = str(info.value)
    assert f"sampling.top_p={float(top_p)} < 1 is refused for training" in message
    assert "full tempered distribution" in message  # why: what the learner scores under
    assert "vLLM renormalises over the nucleus" in message  # why: the engines disagree
    assert "Set sampling.top_p=1" in message  # what to do
    assert "val.top_p" in message  # and that validation is not affected


def test_top_p_one_trains_and_validation_keeps_its_nucleus() -> None:
    cfg = load_config(["sampling.top_p=1.0", "val.top_p=0.9"])
    assert cfg.sampling.top_p == 1.0 and cfg.val.top_p == 0.9
    assert load_config([]).val.top_p == 0.95  # the default validation nucleus is accepted


EXPERIMENTS = sorted(
    p.stem for p in (Path(__file__).parents[2] / "configs/experiment").glob("*.yaml")
)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_shipped_experiments_train_without_a_nucleus(experiment: str) -> None:
    # the file-based tasks (math, search) need a path to load; nothing reads it here
    cfg = load_config([f"experiment={experiment}", "task.train_path=unread.jsonl"])
    assert cfg.sampling.top_p == 1.0
