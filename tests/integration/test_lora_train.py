"""`drmas train` of four agents on one LoRA base: one frozen builtin tiny model `base`, the
four agents of the fixture team (tests/fixtures/four_agents.py) bound to it, each training
its own adapter in one learner group, the hf engine serving all four adapters from one
copy of the base; every publish carries the adapters only and its digest matches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.fixtures.four_agents import FourAgents
from tests.integration.conftest import drmas, read_metrics, read_summary

pytestmark = pytest.mark.slow

AGENTS = FourAgents.agents
STEPS = 3
BATCH_GROUPS = 2
LAYERS = 4  # builtin:tiny-qwen2's decoder layers, each with q, k, v and o projections


def write_config(path: Path) -> None:
    bindings = ", ".join(f"{agent}: {{model: base}}" for agent in AGENTS)
    path.write_text(
        "workflow: {target: 'tests.fixtures.four_agents:FourAgents'}\n"
        "models:\n"
        "  base:\n"
        "    path: builtin:tiny-qwen2\n"
        "    lr: 1e-3\n"
        "    warmstart: {steps: 60}\n"
        "    lora: {rank: 4}\n"
        f"agents: {{{bindings}}}\n"
    )


def train_run(config: Path, run_dir: Path, model_cache: Path) -> None:
    """`drmas train --config config` for STEPS short steps on the hf engine, no validation."""
    out = drmas(
        "train", "--config", str(config),
        f"train.steps={STEPS}", "group_size=4", f"batch_groups={BATCH_GROUPS}",
        "val.every=0", "val.at_start=false",
        "sampling.max_new_tokens=12", "algorithm.loss.max_response_len=12",
        "actor.engine.name=hf",
        "broker.heartbeat_timeout_s=10", "weights.timeout_s=10",
        f"run.dir={run_dir}", f"run.cache_dir={model_cache}",
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_four_agents_train_their_own_adapters_on_one_base(
    tmp_path: Path, model_cache: Path
) -> None:
    config = tmp_path / "four.yaml"
    write_config(config)
    run_dir = tmp_path / "run"
    train_run(config, run_dir, model_cache)

    train = [x for x in read_metrics(run_dir) if "val/tasks" not in x]
    assert [x["step"] for x in train] == list(range(1, STEPS + 1))
    for line in train:
        for agent in AGENTS:
            assert f"reward/{agent}/mean" in line
        assert "loss/base" in line  # one model, one learner group
        assert not [k for k in line if k.startswith("loss/") and k != "loss/base"]

    summary = read_summary(run_dir)
    assert summary["trained_groups"] == {"base": STEPS * BATCH_GROUPS}
    c = summary["counters"]
    assert c["weight_digest_match"] == c["weight_loads"] > 0  # every load: what was sent
    assert c.get("weight_digest_mismatch", 0) == 0
    learners = sorted(p.name for p in (run_dir / "logs").glob("learner-*.log"))
    assert learners == ["learner-base-0.log"]  # one group (of one rank) trains all four

    exported = check_exported_adapters(run_dir / "models" / "base")
    source = yaml.safe_load((run_dir / "config.yaml").read_text())["models"]["base"]["path"]
    before = load_file(str(Path(source) / "model.safetensors"))
    after = load_file(str(run_dir / "models" / "base" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base stayed frozen
    for agent in AGENTS:
        # lora_B starts at zero and only the agent's own steps move it: it moved exactly
        # when its agent's steps gave a gradient (an inactive adapter gets none)
        learned = any(line[f"agent_grad_norm/{agent}"] > 0 for line in train)
        moved = any(t.abs().max() > 0 for k, t in exported[agent].items() if "lora_B" in k)
        assert moved == learned, agent

    # drmas eval on the run: the base and every agent's exported adapter, one agent's
    # adapter given as its own folder
    report_file = tmp_path / "eval.json"
    adapters = run_dir / "models" / "base" / "adapters"
    out = drmas(
        "eval", str(run_dir), "--tasks", "4", "--k", "1", "--n", "1",
        "--model", f"{AGENTS[0]}={adapters / AGENTS[0]}", "--out", str(report_file),
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report["adapters"] == {"base": {a: str(adapters / a) for a in AGENTS}}
    assert report["weights"]["base"]["from"] == "final"


def check_exported_adapters(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The base as a Hugging Face folder, and beside it one PEFT folder per agent that peft
    loads onto that base, every tensor as saved; returns each agent's saved tensors."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from drmas.models.lora import adapter_of_param, adapter_param_names, peft_saved_name

    assert (folder / "config.json").exists()
    adapters = folder / "adapters"
    assert sorted(p.name for p in adapters.iterdir()) == sorted(AGENTS)
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for agent in AGENTS:
        settings = json.loads((adapters / agent / "adapter_config.json").read_text())
        assert settings["peft_type"] == "LORA" and settings["r"] == 4
        saved[agent] = load_file(str(adapters / agent / "adapter_model.safetensors"))
        assert len(saved[agent]) == LAYERS * 4 * 2  # lora_A and lora_B of each projection
    base = AutoModelForCausalLM.from_pretrained(folder)
    model = PeftModel.from_pretrained(base, adapters / AGENTS[0], adapter_name=AGENTS[0])
    for agent in AGENTS[1:]:
        model.load_adapter(adapters / agent, adapter_name=agent)
    params = dict(model.named_parameters())
    names = adapter_param_names(model)
    assert len(names) == len(AGENTS) * LAYERS * 4 * 2
    for name in names:
        agent = adapter_of_param(name)
        key = peft_saved_name(name, agent)
        assert torch.equal(params[name].detach(), saved[agent][key].to(params[name].dtype)), name
    return saved


def test_an_adapter_no_step_trains_is_never_published_yet_held_bit_for_bit(
    tmp_path: Path, model_cache: Path
) -> None:
    """The critic of QuietCritic speaks only on subtractions; trained on additions only it
    has no step in any batch. Its adapter version stays 0, so no publish carries it (each
    carries the three others: 3/4 of the adapter bytes), and yet every actor's digest over
    all four adapters matches the learner's: the engine's critic is still the seeded
    initial adapter the learner holds."""
    rows = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(8) for b in range(8)]
    data = tmp_path / "additions.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "quiet.yaml"
    write_config(config)
    config.write_text(
        config.read_text().replace("FourAgents", "QuietCritic")
        + f"task: {{name: jsonl, train_path: '{data}'}}\n"
    )
    run_dir = tmp_path / "run"
    train_run(config, run_dir, model_cache)

    train = [x for x in read_metrics(run_dir) if "val/tasks" not in x]
    assert [x["step"] for x in train] == list(range(1, STEPS + 1))
    for line in train:
        assert line["adapter_version/critic"] == 0
        for agent in ("proposer", "checker", "finisher"):  # a step in every batch
            assert line[f"adapter_version/{agent}"] == line["step"]
        assert line["staleness/max"] <= 1  # algorithm.max_staleness, in the agent's adapter

    summary = read_summary(run_dir)
    c = summary["counters"]
    assert c["weight_digest_match"] == c["weight_loads"] > 0
    assert c.get("weight_digest_mismatch", 0) == 0

    exported = check_exported_adapters(run_dir / "models" / "base")
    critic_b = [t for k, t in exported["critic"].items() if "lora_B" in k]
    assert all(not t.any() for t in critic_b)  # never trained: B is still zero

    # the publishes that reached the actor (all but the last step's, which nobody needs
    # with validation off) carried the three trained adapters, never the critic
    one_adapter = sum(t.numel() for t in exported["proposer"].values())
    reached = [x for x in train if x["publish_adapters/base"] > 0]
    assert [x["step"] for x in reached] == list(range(1, STEPS))
    for line in reached:
        assert line["publish_adapters/base"] == 3
        per_element = line["weight_sync_bytes/base"] / (3 * one_adapter)
        assert per_element in (2, 4), per_element  # bf16 or fp32 on the wire
