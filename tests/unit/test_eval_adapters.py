"""`drmas eval` on a LoRA base: which adapter folders it chooses (a run's final adapters,
or `--model AGENT=DIR`), and that an engine then generates with exactly those tensors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from drmas.actors.engines.hf import HFEngine
from drmas.config import load_config
from drmas.config.actor import EngineConfig
from drmas.config.model import LoraConfig, WarmStartConfig
from drmas.launch.evaluate import EvalError, _load_adapters, adapter_tensors, choose_adapters
from drmas.models.builtin import resolve_model_path
from drmas.models.lora import adapter_param_names, add_adapters, save_adapter_folder
from drmas.transports.digest import digest_of

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
