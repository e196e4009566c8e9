"""Sampling per agent: `agents.<name>.sampling` (training) and `agents.<name>.val`
(validation) over the run's `sampling` and `val`, resolved by the broker into every lease
(drmas/broker/sampling.py), carried on the wire, and reaching the engine in each of that
agent's calls (drmas/teams/base.py). The learner side (each agent's samples scored at its
own temperature) is tests/unit/test_behaviour_logprobs.py."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from drmas.actors.engines.base import Engine
from drmas.broker.sampling import lease_sampling
from drmas.config import ConfigError, load_config
from drmas.protocol import decode_from_broker, encode
from drmas.protocol.messages import Lease, Leases, Task
from drmas.protocol.sampling import AgentSampling, SamplingParams
from drmas.teams.resolve import team_class
from tests.fixtures.engines import CharTokenizer, ScriptedEngine

OWN = [
    "agents.verifier.sampling.temperature=0.7",
    "agents.verifier.sampling.max_new_tokens=8",
    "agents.verifier.sampling.stop=['</verify>']",
    "agents.solver.val.temperature=0.2",
]


def test_each_agents_own_settings_override_the_runs_in_training_and_validation() -> None:
    cfg = load_config(OWN)
    train = lease_sampling(cfg, validation=False)
    run_len = cfg.sampling.max_new_tokens
    assert (train.temperature, train.top_p, train.max_new_tokens, train.stop) == (
        1.0, 1.0, run_len, [],
    )  # fmt: skip
    # only the agent that differs is listed; the other samples as the run does
    assert train.agents == {"verifier": AgentSampling(0.7, 1.0, 8, ["</verify>"])}
    assert train.for_agent("solver") == AgentSampling(1.0, 1.0, run_len, [])
    val = lease_sampling(cfg, validation=True)
    assert (val.temperature, val.top_p) == (cfg.val.temperature, cfg.val.top_p)
    # validation: its own temperature where set, the length cap and stop strings of training
    assert val.for_agent("solver") == AgentSampling(0.2, cfg.val.top_p, run_len, [])
    assert val.for_agent("verifier") == AgentSampling(
        cfg.val.temperature, cfg.val.top_p, 8, ["</verify>"]
    )
    # drmas eval's --temperature/--top-p hold for every agent
    evaluated = lease_sampling(cfg, validation=True, temperature=0.9, top_p=1.0)
    assert {evaluated.for_agent(a).temperature for a in cfg.agents} == {0.9}
    assert evaluated.for_agent("verifier").stop == ["</verify>"]
    # nothing set: no per-agent entries at all
    assert lease_sampling(load_config([]), validation=False).agents == {}


def test_each_agents_sampling_reaches_the_engine_in_its_calls() -> None:
    """The math team (Solver, then Verifier, one shared scripted engine): every call
    samples with its agent's settings."""
    cfg = load_config(["experiment=tiny_math_shared", *OWN])
    engine = ScriptedEngine(
        {"solver": ["\\boxed{7}"], "verifier": ["<verify>yes</verify>"]},
        CharTokenizer(),
        agent_of=lambda prompt: "verifier" if prompt.rstrip().endswith("Verifier:") else "solver",
    )
    engines = cast(dict[str, Engine], {"policy": engine})
    agents = {a: cfg.model_of(a) for a in cfg.agents}
    team = team_class(cfg.workflow).build(cfg, agents, engines, {"policy": engine.tokenizer})
    sampling = lease_sampling(cfg, validation=False)
    asyncio.run(team.run_episode(Task("t:0", "3+4", "7", "t"), sampling))
    by_agent = {c.agent: c.request for c in engine.calls}
    assert set(by_agent) == {"solver", "verifier"}
    solver, verifier = by_agent["solver"], by_agent["verifier"]
    assert (solver.temperature, solver.max_new_tokens, solver.stop) == (
        1.0, cfg.sampling.max_new_tokens, (),
    )  # fmt: skip
    assert (verifier.temperature, verifier.max_new_tokens, verifier.stop) == (
        0.7, 8, ("</verify>",),
    )  # fmt: skip


def test_per_agent_sampling_travels_in_a_lease() -> None:
    sampling = SamplingParams(
        1.0, 1.0, 64, ["\n\n"], {"critic": AgentSampling(0.5, 1.0, 16, ["."])}
    )
    lease = Lease(1, 2, Task("t:0", "q", "a", "t"), 4, False, sampling, 60.0)
    (back,) = cast(Leases, decode_from_broker(encode(Leases([lease])))).leases
    assert back.sampling == sampling
    assert back.sampling.for_agent("critic").max_new_tokens == 16
    assert back.sampling.for_agent("writer") == AgentSampling(1.0, 1.0, 64, ["\n\n"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("agents.verifier.sampling.top_p=0.9", r"agents\.verifier\.sampling\.top_p=0\.9 < 1"),
        ("agents.solver.sampling.temperature=0", r"agents\.solver\.sampling\.temperature=0"),
        ("sampling.temperature=0", r"sampling\.temperature=0 \(greedy\)"),
        ("agents.verifier.sampling.stop=['']", r"stop"),
        ("agents.verifier.sampling.colour=red", r"colour"),
    ],
)
def test_sampling_the_learner_cannot_score_is_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config([override])


def test_validation_may_sample_narrower_per_agent() -> None:
    """top_p < 1 is refused for training only: validation trains nothing."""
    cfg = load_config(["agents.verifier.val.top_p=0.5"])
    assert lease_sampling(cfg, validation=True).for_agent("verifier").top_p == 0.5
