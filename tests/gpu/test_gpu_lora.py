"""LoRA adapters on a shared base on the GPU (marker `gpu`; run by scripts/gpu_check.sh):
the four agents of the fixture team each train their own adapter on one frozen builtin
base (tests/integration/test_lora_train.py's team and checks), the learner in
bf16-mixed on CUDA and the hf engine serving all four adapters from one bf16 copy of the
base on the same GPU, weights over gloo. Checked: one learner group trains them all,
every adapter load matches the published digest, the exported adapters load onto the
base with peft, and the base stayed frozen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.conftest import drmas, read_summary
from tests.integration.test_lora_train import AGENTS, check_exported_adapters, write_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(240),
]
STEPS = 3
BATCH_GROUPS = 2


def test_adapters_train_on_a_shared_base_on_the_gpu(tmp_path: Path) -> None:
    config = tmp_path / "four.yaml"
    write_config(config)
    run_dir = tmp_path / "run"
    out = drmas(
        "train", "--config", str(config),
        f"train.steps={STEPS}", "group_size=4", f"batch_groups={BATCH_GROUPS}",
        "val.every=0", "val.at_start=false",
        "sampling.max_new_tokens=12", "algorithm.loss.max_response_len=12",
        "models.base.precision=bf16-mixed",
        "learner.device=cuda",
        "actor.engine.name=hf", "actor.engine.device=cuda", "actor.engine.dtype=bfloat16",
        f"run.dir={run_dir}", f"run.cache_dir={tmp_path / 'cache'}",
        timeout=210,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "shared GPUs: 0" in out.stdout and "weights: gloo" in out.stdout
    summary = read_summary(run_dir)
    assert summary["trained_groups"] == {"base": STEPS * BATCH_GROUPS}
    c = summary["counters"]
    assert c["weight_digest_match"] == c["weight_loads"] > 0
    assert c.get("weight_digest_mismatch", 0) == 0
    assert sorted(p.name for p in (run_dir / "logs").glob("learner-*.log")) == [
        "learner-base-0.log"
    ]
    exported = check_exported_adapters(run_dir / "models" / "base")
    assert set(exported) == set(AGENTS)
    import yaml

    source = yaml.safe_load((run_dir / "config.yaml").read_text())["models"]["base"]["path"]
    before = load_file(str(Path(source) / "model.safetensors"))
    after = load_file(str(run_dir / "models" / "base" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base stayed frozen
    print(f"\nLoRA on GPU: {len(AGENTS)} adapters, counters {c}")
