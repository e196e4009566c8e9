"""A learner never publishes non-finite weights: after every optimizer step it looks for NaN
or inf in what it trains (Trainer.non_finite, a collective, so every rank agrees) and, if
any, stops with an error naming the model, the step and the parameters, before the
publish. In process: the builtin tiny model (not warm-started), a one-rank gloo group."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from drmas.config import AgentConfig, DrmasConfig
from drmas.config.model import LoraConfig, ModelConfig, WarmStartConfig
from drmas.learners.main import Learner
from drmas.learners.trainer import NonFiniteWeights
from drmas.models.builtin import resolve_model_path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


def config(model_path: Path, lora_rank: int = 0) -> DrmasConfig:
    return DrmasConfig(
        models={
            "policy": ModelConfig(
                path=str(model_path), precision="fp32", lora=LoraConfig(rank=lora_rank)
            )
        },
        agents={"solver": AgentConfig(model="policy"), "verifier": AgentConfig(model="policy")},
    )


def poison(trainer: Any, pick: str, value: float) -> str:
    """Write `value` into the first element of the first parameter whose name has `pick`."""
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if pick in n)
    with torch.no_grad():
        local = param.to_local() if hasattr(param, "to_local") else param
        local.view(-1)[0] = value
    return cast(str, name)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_named(model_path: Path, group: None, value: float) -> None:
    from drmas.learners.trainer import Trainer

    trainer = Trainer(config(model_path), "policy", 0, 1, "cpu")
    assert trainer.non_finite() == []
    name = poison(trainer, "layers.1.mlp", value)
    assert trainer.non_finite() == [name]


def test_on_a_lora_base_only_the_adapters_are_checked(model_path: Path, group: None) -> None:
    """The frozen base is neither trained nor published: only the adapters count."""
    from drmas.learners.trainer import Trainer

    trainer = Trainer(config(model_path, lora_rank=4), "policy", 0, 1, "cpu")
    poison(trainer, "base_layer", float("nan"))
    assert trainer.non_finite() == []
    adapter = poison(trainer, "lora_B.verifier", float("inf"))
    assert trainer.non_finite() == [adapter]


def test_the_message_names_model_step_and_parameters(model_path: Path, group: None) -> None:
    from drmas.learners.trainer import Trainer

    trainer = Trainer(config(model_path), "policy", 0, 1, "cpu")
    trainer.refuse_non_finite(7)  # finite: nothing to say
    name = poison(trainer, "layers.0.mlp.up_proj", float("nan"))
    with pytest.raises(NonFiniteWeights) as err:
        trainer.refuse_non_finite(7)
    text = str(err.value)
    assert f"policy: step 7 left NaN or inf in 1 parameter(s) ({name})" in text
    assert "keep serving v6" in text and "models.policy.lr" in text


def test_the_learner_stops_before_reporting_or_publishing() -> None:
    """Learner.step checks before it reports the step: the publish that follows it never
    runs, so the actors keep the last finite version."""
    reports: list[Any] = []
    checked: list[int] = []

    def refuse(step: int) -> None:
        checked.append(step)
        raise NonFiniteWeights("stop")

    learner = Learner.__new__(Learner)
    learner.model, learner.version, learner.rank = "policy", 6, 0
    learner.trainer = cast(Any, SimpleNamespace(
        step=lambda shard, tick: {"loss/policy": 0.1}, refuse_non_finite=refuse,
    ))  # fmt: skip
    learner.beat = cast(Any, SimpleNamespace(maybe_send=lambda: None, version=6))
    learner._client = cast(Any, SimpleNamespace(send=reports.append))
    with pytest.raises(NonFiniteWeights):
        learner.step(cast(Any, None), waited_s=0.0)
    assert checked == [7] and learner.version == 6 and reports == []  # no StepReport


def test_every_publish_checks_the_weights_it_sends(model_path: Path, group: None) -> None:
    """Republishes included: the stream a publish sends is checked when it is asked for."""
    from drmas.learners.trainer import Trainer

    trainer = Trainer(config(model_path), "policy", 0, 1, "cpu")
    assert [n for n, _ in trainer.weights_out("cpu", 3)]  # finite: the stream comes
    name = poison(trainer, "layers.1.self_attn", float("nan"))
    with pytest.raises(NonFiniteWeights) as err:
        trainer.weights_out("cpu", 3)
    assert f"v3 holds NaN or inf, about to be published, in 1 parameter(s) ({name})" in str(
        err.value
    )
    assert "not sent to the actors" in str(err.value)


def test_a_model_folder_with_nan_is_refused_before_anything_trains(
    model_path: Path, group: None, tmp_path: Path
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from drmas.learners.trainer import Trainer

    folder = tmp_path / "model"
    shutil.copytree(model_path, folder)
    weights = next(folder.glob("*.safetensors"))
    state = load_file(str(weights))
    name = next(k for k in state if "layers.0.mlp" in k)
    state[name].view(-1)[0] = float("inf")
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeights) as err:
        Trainer(config(folder), "policy", 0, 1, "cpu")
    assert f"the weights in {folder} hold NaN or inf" in str(err.value)
    assert "fix or replace that model folder" in str(err.value)
