"""`drmas eval` on a LoRA base: which adapter folders it chooses (a run's final adapters,
a learner checkpoint's with `--step`, or `--model AGENT=DIR`), that an engine then
generates with exactly those tensors, and that a merged folder is evaluated as the whole
model it is (models.<m>.lora.rank=0), not with the adapters added again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from drmas.actors.engines.hf import HFEngine
from drmas.config import DrmasConfig, load_config
from drmas.config.actor import EngineConfig
from drmas.config.load import to_yaml
from drmas.config.model import LoraConfig, WarmStartConfig
from drmas.launch.cli import main as cli
from drmas.launch.evaluate import (
    EvalError,
    _load_adapters,
    adapter_tensors,
    choose_adapters,
    choose_weights,
)
from drmas.models.builtin import resolve_model_path
from drmas.models.lora import (
    MERGED_MARKER,
    adapter_of_param,
    adapter_param_names,
    add_adapters,
    save_adapter_folder,
    write_merged,
)
from drmas.transports.digest import digest_of
from tests.rendezvous import gloo_init

LORA = LoraConfig(rank=4)
ADAPTERS = ["solver", "verifier"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


def trained_folders(model_path: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Both adapters moved away from their start and saved as PEFT folders under `out`;
    returns what was saved, by parameter name."""
    from transformers import AutoModelForCausalLM

    peft_model = add_adapters(AutoModelForCausalLM.from_pretrained(model_path), LORA, ADAPTERS)
    params = dict(peft_model.named_parameters())
    saved: dict[str, dict[str, torch.Tensor]] = {a: {} for a in ADAPTERS}
    with torch.no_grad():
        for i, name in enumerate(adapter_param_names(peft_model)):
            params[name].add_(
                0.05 * torch.randn(params[name].shape, generator=torch.Generator().manual_seed(i))
            )
            saved[name.split(".lora_")[1].split(".")[1]][name] = params[name].detach().clone()
    for adapter in ADAPTERS:
        save_adapter_folder(peft_model, adapter, saved[adapter].items(), out / adapter)
    return saved


def test_a_runs_final_adapters_and_an_agents_own_folder(model_path: Path, tmp_path: Path) -> None:
    cfg = load_config(["models.solver.lora.rank=4", "agents.verifier.model=solver"])
    run_dir = tmp_path / "run"
    trained_folders(model_path, run_dir / "models" / "solver" / "adapters")
    other = tmp_path / "other"
    trained_folders(model_path, other)
    chosen = choose_adapters(cfg, run_dir, {})
    assert chosen == {
        "solver": {a: run_dir / "models" / "solver" / "adapters" / a for a in ADAPTERS}
    }
    chosen = choose_adapters(cfg, run_dir, {"verifier": str(other / "verifier")})
    assert chosen["solver"]["verifier"] == other / "verifier"
    assert chosen["solver"]["solver"] == run_dir / "models" / "solver" / "adapters" / "solver"
    assert choose_adapters(cfg, None, {}) == {"solver": {}}  # none: the adapters start as the base
    full = load_config([])
    with pytest.raises(EvalError, match=r"model 'verifier' has no adapters"):
        choose_adapters(full, None, {"verifier": str(other / "verifier")})


def test_the_engine_generates_with_the_chosen_adapter_tensors(
    model_path: Path, tmp_path: Path
) -> None:
    saved = trained_folders(model_path, tmp_path)
    expected = sorted(pair for adapter in ADAPTERS for pair in saved[adapter].items())
    assert [n for n, _ in adapter_tensors(tmp_path / "verifier", "verifier")] == sorted(
        saved["verifier"]
    )

    async def main() -> tuple[str, str]:
        engine = HFEngine("solver", model_path, EngineConfig(device="cpu"), LORA, ADAPTERS)
        await engine.start()
        try:
            before = engine.weights_digest()
            await _load_adapters(engine, {a: tmp_path / a for a in ADAPTERS})
            return before, engine.weights_digest()
        finally:
            await engine.close()

    before, after = asyncio.run(main())
    assert after == digest_of(expected) != before


# ------------------------------------------------------------- --step on a LoRA base
STEP = 3


def lora_run_config(model_path: Path, run_dir: Path, *extra: str) -> DrmasConfig:
    return load_config(
        [
            f"models.solver.path={model_path}",
            "models.solver.lora.rank=4",
            "agents.verifier.model=solver",
            "sampling.max_new_tokens=4",
            f"run.dir={run_dir}",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def checkpointed(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[DrmasConfig, Path, dict[str, torch.Tensor]]]:
    """A run folder (config.yaml) with the learner's checkpoint at STEP, written as the
    learner writes one (drmas/learners/checkpoint.py) from adapters moved off their start;
    and those adapters' tensors as the learner publishes them (their PeftModel names)."""
    import torch.distributed as dist

    from drmas.checkpoints import store
    from drmas.learners import checkpoint
    from drmas.learners.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("run")
    cfg = lora_run_config(model_path, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=gloo_init(), rank=0, world_size=1)
    try:
        trainer = Trainer(cfg, "solver", 0, 1, "cpu")
        with torch.no_grad():
            for i, (name, param) in enumerate(trainer.model.named_parameters()):
                if "lora_" in name:
                    local = param.to_local() if hasattr(param, "to_local") else param
                    noise = torch.randn(local.shape, generator=torch.Generator().manual_seed(i))
                    local.add_(0.05 * noise)
        checkpoint.save(trainer, store.root_for(run_dir) / "solver", STEP, keep=2)
        published = {name: t.clone() for name, t in trainer.full_state_dict_iter()}
    finally:
        dist.destroy_process_group()
    yield cfg, run_dir, published


def test_a_checkpoints_adapters_are_what_eval_loads_onto_the_base(
    model_path: Path, checkpointed: tuple[DrmasConfig, Path, dict[str, torch.Tensor]]
) -> None:
    cfg, run_dir, published = checkpointed
    assert {adapter_of_param(n) for n in published} == set(ADAPTERS)
    assert all(t.abs().max() > 0 for n, t in published.items() if "lora_B" in n)
    weights = choose_weights(cfg, run_dir, STEP, {})
    assert weights == {"solver": (model_path, f"base; adapters of checkpoint step {STEP}")}
    chosen = choose_adapters(cfg, run_dir, {}, STEP)
    exported = run_dir / "checkpoints" / "solver" / f"step-{STEP:06d}" / "adapters"
    assert chosen == {"solver": {a: exported / a for a in ADAPTERS}}
    for adapter in ADAPTERS:
        mine = sorted((n, t) for n, t in published.items() if adapter_of_param(n) == adapter)
        loaded = adapter_tensors(exported / adapter, adapter)
        assert [n for n, _ in loaded] == [n for n, _ in mine]
        for (name, tensor), (_, expected) in zip(loaded, mine, strict=True):
            assert torch.equal(tensor, expected), name
        settings = json.loads((exported / adapter / "adapter_config.json").read_text())
        assert (settings["r"], settings["base_model_name_or_path"]) == (4, str(model_path))
    # chosen again: the exported folders as they are; an agent's own folder still wins
    trained_folders(model_path, run_dir / "other")
    again = choose_adapters(cfg, run_dir, {"verifier": str(run_dir / "other" / "verifier")}, STEP)
    assert again["solver"] == {"solver": exported / "solver", "verifier": run_dir / "other" / "verifier"}  # fmt: skip

    async def main() -> str:
        engine = HFEngine("solver", model_path, EngineConfig(device="cpu"), LORA, ADAPTERS)
        await engine.start()
        try:
            await _load_adapters(engine, chosen["solver"])
            return engine.weights_digest()
        finally:
            await engine.close()

    assert asyncio.run(main()) == digest_of(sorted(published.items()))


def test_a_step_without_its_checkpoint_or_adapters_is_refused(
    model_path: Path, checkpointed: tuple[DrmasConfig, Path, dict[str, torch.Tensor]]
) -> None:
    cfg, run_dir, _ = checkpointed
    with pytest.raises(EvalError, match=rf"no checkpoint at step 4 \(has \[{STEP}\]\)"):
        choose_weights(cfg, run_dir, 4, {})
    with pytest.raises(EvalError, match=r"no checkpoint at step 4"):
        choose_adapters(cfg, run_dir, {}, 4)
    with pytest.raises(EvalError, match="--step needs a run folder"):
        choose_weights(cfg, None, STEP, {})
    renamed = lora_run_config(model_path, run_dir, "agents.verifier.adapter=checker")
    with pytest.raises(
        EvalError, match=r"holds adapters \['solver', 'verifier'\], not \['checker'\]"
    ):
        choose_adapters(renamed, run_dir, {}, STEP)


def test_drmas_eval_step_on_a_lora_run(
    checkpointed: tuple[DrmasConfig, Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    _, run_dir, _ = checkpointed
    out = tmp_path / "eval.json"
    argv = ["eval", str(run_dir), "--step", str(STEP), "--tasks", "2", "--k", "1", "--out", str(out)]  # fmt: skip
    assert cli(argv) == 0
    report = json.loads(out.read_text())
    assert report["weights"]["solver"]["from"] == f"base; adapters of checkpoint step {STEP}"
    exported = run_dir / "checkpoints" / "solver" / f"step-{STEP:06d}" / "adapters"
    assert report["adapters"] == {"solver": {a: str(exported / a) for a in ADAPTERS}}
    assert report["overall"]["tasks"] == 2


# -------------------------------------------------------------------- merged folders
def test_a_merged_folder_is_evaluated_as_a_whole_model(
    model_path: Path,
    checkpointed: tuple[DrmasConfig, Path, dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    _, run_dir, _ = checkpointed
    trained_folders(model_path, tmp_path / "adapters")
    merged = write_merged(model_path, tmp_path / "adapters" / "solver", tmp_path / "merged")
    assert (merged / MERGED_MARKER).is_file()
    lora = lora_run_config(model_path, run_dir)
    for name in ("solver", "verifier"):  # by model or by agent: the adapters would go on top
        with pytest.raises(EvalError, match=r"with models.solver.lora.rank=0 and --model solver="):
            choose_weights(lora, run_dir, None, {name: str(merged)})
    whole = lora_run_config(model_path, run_dir, "models.solver.lora.rank=0")
    assert choose_weights(whole, run_dir, None, {"solver": str(merged)}) == {
        "solver": (merged, "folder")
    }
    assert choose_adapters(whole, run_dir, {}) == {}

    out = tmp_path / "eval.json"
    argv = ["eval", str(run_dir), "models.solver.lora.rank=0", "--model", f"solver={merged}", "--tasks", "2", "--k", "1", "--out", str(out)]  # fmt: skip
    assert cli(argv) == 0
    report = json.loads(out.read_text())
    assert report["weights"] == {"solver": {"path": str(merged), "from": "folder"}}
    assert report["adapters"] == {}
