"""The config schema (drmas/config): field constraints declared once and checked while
converting, rules across fields, no plug-in imported by building a config, and the
documented command-line forms."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from drmas.config import ConfigError, load_config, to_yaml
from drmas.config.model import ModelConfig
from drmas.config.root import AgentConfig
from drmas.teams.resolve import resolve, team_name

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "proposer_critic" / "team.py"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # choices (Literal fields), at any depth, in mappings with the entry's own name
        (
            "algorithm.advantage.mode=agnet",
            r"algorithm\.advantage\.mode='agnet' is not one of \['global', 'agent'",
        ),
        (
            "algorithm.advantage.std=sample",
            r"algorithm\.advantage\.std='sample' is not one of \['unbiased', 'population'\]",
        ),
        ("algorithm.loss.agg=sum", r"algorithm\.loss\.agg='sum' is not one of"),
        ("learner.device=tpu", r"learner\.device='tpu' is not one of \['auto', 'cpu', 'cuda'\]"),
        ("weights.backend=mpi", r"weights\.backend='mpi' is not one of \['auto', 'gloo', 'nccl'\]"),
        (
            "models.solver.precision=fp16",
            r"models\.solver\.precision='fp16' is not one of \['fp32', 'bf16-mixed', 'bf16-pure'\]",
        ),
        (
            "+actor.pools={verifier: {dtype: int8}}",
            r"actor\.pools\.verifier\.dtype='int8' is not one of",
        ),
        ("placement.share=sometimes", r"placement\.share='sometimes' is not one of"),
        (
            "retriever.name=google",
            r"retriever\.name='google' is not one of \['bm25', 'dense', 'http'\]",
        ),
        ("logger=[jsonl,neptune]", r"logger\[1\]='neptune' is not one of"),
        # ranges (Annotated fields)
        ("group_size=0", r"group_size=0: expected int >= 1"),
        ("train.steps=-3", r"train\.steps=-3: expected int >= 1"),
        ("algorithm.max_staleness=-1", r"algorithm\.max_staleness=-1: expected int >= 0"),
        ("sampling.top_p=0", r"sampling\.top_p=0: expected float > 0"),
        (
            "actor.engine.sim_stop_prob=1.5",
            r"actor\.engine\.sim_stop_prob=1\.5: expected float <= 1",
        ),
        ("models.verifier.world_size=0", r"models\.verifier\.world_size=0: expected int >= 1"),
        ("probe.baselines=[]", r"probe\.baselines=\[\]: expected array of length >= 1"),
        (
            "+probe.rewards={solver: [0.5]}",
            r"probe\.rewards\.solver=\[0\.5\]: expected array of length >= 2",
        ),
        # what one group message can carry, and timeouts that end
        ("group_size=5000", r"group_size=5000: expected int <= 4096"),
        ("val.n=5000", r"val\.n=5000: expected int <= 4096"),
        ("probe.group_size=4097", r"probe\.group_size=4097: expected int <= 4096"),
        ("broker.lease_timeout_s=inf", r"broker\.lease_timeout_s=inf: expected float <= 2592000"),
        ("weights.timeout_s=1e12", r"weights\.timeout_s=1000000000000\.0: expected float <= "),
        ("broker.heartbeat_timeout_s=nan", r"broker\.heartbeat_timeout_s=nan: expected float > 0"),
        # types
        ("learner.timeout_s=soon", r"learner\.timeout_s='soon': expected float, got str"),
    ],
)
def test_each_field_constraint_is_refused_with_key_value_and_what_is_allowed(
    override: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config([override])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agents.verifier.model=critic"], r"agents\.verifier\.model='critic' is not in models"),
        (["agents.solver.lr=1e-4", "agents.verifier.lr=2e-4", "agents.verifier.model=solver"],
         r"share model 'solver' but set different lr"),
        (["val.n=2", "val.k=4"], r"val\.n \(2\) must be >= val\.k \(4\)"),
        (["group_size=1"], r"group_size must be >= 2 for group-relative advantages"),
        (["weights.host=0.0.0.0"], r"weights\.host='0\.0\.0\.0' is a wildcard: .* Set the address"),
        (["weights.host=::"], r"weights\.host='::' is a wildcard"),
        (["algorithm.skip_zero_variance=true", "algorithm.zero_variance_by=model",
          "algorithm.advantage.mode=step_global"], r"zero_variance_by=model .* Under mode=step_global"),
        (["algorithm.skip_zero_variance=true", "algorithm.zero_variance_by=model",
          "algorithm.advantage.mode=global"], r"safe only where such a slice's advantages are all zero"),
        (["experiment=tiny_math_shared", "algorithm.skip_zero_variance=true",
          "algorithm.zero_variance_by=model", "algorithm.advantage.scope=batch"],
         r"\(scope=batch\)"),
        (["+probe.rewards={solver: [0.5, 0.2], verifier: [0.5, 0.2]}",
          "+workflow.reward_scale.verifier=0.1"], r"probe\.rewards draws synthetic scores and does not apply workflow\.reward_scale"),
        (["task.name=jsonl"], r"task\.name=jsonl needs task\.train_path=FILE"),
        (["+actor.pools={critic: {name: sim}}"], r"actor\.pools names \['critic'\]"),
        (["models.solver.dtype=bfloat16"], r"models\.solver\.dtype='bfloat16' was replaced by models\.solver\.precision"),
        (["models.solver.warmstart.workflow=poetry"], r"warmstart\.workflow='poetry': expected one of"),
        (["+probe.rewards={solver: [0, 1]}"], r"probe\.rewards must give \[mean, std\] for every agent"),
        (["+probe.rewards={solver: [0, -1], verifier: [0, 1]}"], r"probe\.rewards\.solver must be \[mean, std >= 0\]"),
    ],
)  # fmt: skip
def test_rules_across_fields(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_a_number_given_for_text_is_text() -> None:
    cfg = load_config(["run.project=2024", "actor.id=7"])
    assert cfg.run.project == "2024" and cfg.actor.id == "7"


def test_models_no_agent_uses_are_dropped() -> None:
    cfg = load_config(["agents.verifier.model=solver"])
    assert list(cfg.models) == ["solver"]


def test_a_typo_in_a_config_file_is_refused_with_the_nearest_key(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text(
        "models: {m: {path: builtin:tiny-qwen2, lrr: 1e-4}}\n"
        "agents: {solver: {model: m}, verifier: {model: m}}\n"
    )
    with pytest.raises(ConfigError, match=r"models\.m\.lrr is not a config key; did you mean"):
        load_config([], str(file))


def test_building_a_config_imports_no_plugin(tmp_path: Path) -> None:
    """Teams, tools and rewards are the roles' to load (drmas.teams.resolve): a config
    naming them builds on any node, and imports none of them."""
    (tmp_path / "never_imported.py").write_text("raise RuntimeError('imported!')\n")
    cfg = load_config(
        [
            f"workflow.reward={tmp_path / 'never_imported.py'}:reward",
            f"+workflow.tools={{calc: '{tmp_path / 'never_imported.py'}:calc'}}",
            "logger=[jsonl,wandb,mlflow]",
        ]
    )
    assert cfg.workflow.reward.endswith("never_imported.py:reward")
    assert not [m for m in sys.modules if "never_imported" in m]
    assert resolve(cfg, "learner") is None  # a learner loads none of them
    with pytest.raises(RuntimeError, match="imported!"):
        resolve(cfg, "actor")  # the actor does, when it starts


def test_the_documented_way_to_give_your_own_team_its_agents() -> None:
    """README's form: replace the agents (and models) mappings on the command line."""
    cfg = load_config(
        [
            f"workflow.target={EXAMPLE}:ProposerCritic",
            "~agents",
            "+agents={proposer: {model: solver}, critic: {model: verifier}}",
            "~models",
            "+models={solver: {path: 'builtin:tiny-qwen2', lr: 3e-5}, verifier: {}}",
        ]
    )
    assert cfg.agents == {
        "proposer": AgentConfig(model="solver"),
        "critic": AgentConfig(model="verifier"),
    }
    assert cfg.models["solver"] == ModelConfig(lr=3e-5)
    assert isinstance(cfg.models["verifier"], ModelConfig)
    assert resolve(cfg, "run").__name__ == "ProposerCritic"
    assert team_name(cfg) == "proposer_critic"


def test_the_run_config_reads_back_as_written(tmp_path: Path) -> None:
    cfg = load_config(["experiment=tiny_math_hetero", "+actor.pools={verifier: {name: sim}}"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert load_config([], str(tmp_path / "config.yaml")) == cfg


def test_overrides_on_a_run_config_set_and_delete(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(to_yaml(load_config([])))
    cfg = load_config(
        [
            "train.steps=3",
            "~agents",
            "+agents={solver: {model: solver}, verifier: {model: solver}}",
        ],
        str(tmp_path / "config.yaml"),
    )
    assert cfg.train.steps == 3 and list(cfg.models) == ["solver"]


def test_adapters_per_agent_on_a_lora_base() -> None:
    """Each agent trains its own adapter unless agents name one; learning rates per adapter."""
    cfg = load_config(
        [
            "models.solver.lora.rank=8",
            "agents.verifier.model=solver",
            "agents.verifier.lr=1e-3",
        ]
    )
    assert cfg.has_adapters("solver") and list(cfg.models) == ["solver"]
    assert cfg.adapters_of("solver") == ["solver", "verifier"]
    assert cfg.lr_of("solver", "verifier") == 1e-3
    assert cfg.lr_of("solver", "solver") == cfg.models["solver"].lr
    shared = load_config(
        [
            "models.solver.lora.rank=8",
            "agents.verifier.model=solver",
            "agents.verifier.adapter=solver",
        ]
    )
    assert shared.adapters_of("solver") == ["solver"]
    assert load_config([]).adapter_of("solver") == ""  # rank 0: full fine-tuning


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agents.verifier.adapter=v"], r"agents\.verifier\.adapter='v' but model 'verifier' has no adapters: set models\.verifier\.lora\.rank"),
        (["models.solver.lora.rank=8", "agents.verifier.model=solver", "agents.verifier.adapter=solver",
          "agents.solver.lr=1e-4", "agents.verifier.lr=2e-4"], r"share adapter 'solver' of model 'solver' but set different lr"),
        (["models.solver.lora.dropout=1.5"], r"models\.solver\.lora\.dropout=1\.5: expected float <= 1"),
        (["models.solver.lora.rank=-1"], r"models\.solver\.lora\.rank=-1: expected int >= 0"),
    ],
)  # fmt: skip
def test_adapter_rules(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        (["algorithm.advantage.agent_std_pool=batch", "algorithm.advantage.mode=global"],
         r"only modes agent and agent_std divide by .* mode=global"),
        (["algorithm.advantage.agent_std_pool=batch", "algorithm.advantage.norm_by_std=false"],
         r"agent_std_pool=batch .* norm_by_std=False"),
        (["algorithm.advantage.std_floor=0.3", "algorithm.advantage.norm_by_std=false"],
         r"std_floor=0.3 floors .* norm_by_std=false divides by none"),
    ],
)  # fmt: skip
def test_sigma_options_where_they_would_do_nothing_are_refused(
    overrides: list[str], refusal: str
) -> None:
    with pytest.raises(ConfigError, match=refusal):
        load_config(overrides)
    load_config([o for o in overrides if "mode=" not in o and "norm_by_std" not in o])


def test_the_config_bound_on_a_group_is_what_the_wire_carries() -> None:
    from drmas.config import types
    from drmas.protocol import wire_limits

    assert types.MAX_GROUP_EPISODES == wire_limits.MAX_GROUP_EPISODES


@pytest.mark.parametrize("mode", ["agent", "agent_turn", "agent_mean"])
def test_zero_variance_by_model_is_accepted_where_a_tied_slice_has_zero_advantages(
    mode: str,
) -> None:
    cfg = load_config(
        ["algorithm.skip_zero_variance=true", "algorithm.zero_variance_by=model",
         f"algorithm.advantage.mode={mode}"]
    )  # fmt: skip
    assert cfg.algorithm.zero_variance_by == "model"
