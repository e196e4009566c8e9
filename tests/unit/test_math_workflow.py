"""The math workflow against scripted engines and a character tokenizer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest

from drmas.actors.engines.base import Engine, GenerateRequest, GenerateResult
from drmas.config.actor import WorkflowConfig
from drmas.protocol.arrays import unpack_ids, unpack_logprobs
from drmas.protocol.messages import Episode, SamplingParams, Task
from drmas.protocol.validate import Limits, check_step
from drmas.teams.math.prompts import INSTRUCTIONS, TINY_INSTRUCTIONS
from drmas.teams.math.workflow import MathTeam
from tests.fixtures.engines import ScriptedEngine

TASK = Task(task_id="arithmetic:train:0", question="2+3", answer="5", source="arithmetic")
SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=32)
EOS = 3  # chr(3): a "special" token the tokenizer drops when skip_special_tokens=True


@dataclass
class Encoding:
    input_ids: list[int]


class CharTokenizer:
    """One token per character: ord(c) % 256, shifted by `offset` so that two models'
    tokenizers produce different ids for the same text."""

    def __init__(self, offset: int = 0, chat_returns: str = "list") -> None:
        self.offset = offset
        self.vocab_size = 256 + offset
        self.eos_token_id = EOS + offset
        self.chat_returns = chat_returns
        self.encoded: list[str] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        assert add_special_tokens is False
        self.encoded.append(text)
        return Encoding([ord(c) % 256 + self.offset for c in text])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = [i - self.offset for i in ids]
        if skip_special_tokens:
            out = [i for i in out if i != EOS]
        return "".join(chr(i) for i in out)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool
    ) -> Any:
        assert add_generation_prompt and tokenize
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        ids = self(text, add_special_tokens=False).input_ids
        return {"list": ids, "batch_encoding": {"input_ids": ids}, "batched": [ids]}[
            self.chat_returns
        ]


def _agent(prompt: str) -> str:
    """Whose turn a prompt ends on: the Verifier's label (plain) or its chat cue."""
    verifier = prompt.endswith("Verifier:") or "You are the Verifier. Respond now." in prompt
    return "verifier" if verifier else "solver"


def _workflow(
    cfg: WorkflowConfig,
    agent_models: dict[str, str],
    engines: dict[str, Any],
    tokenizers: dict[str, CharTokenizer],
) -> MathTeam:
    """The fakes implement only `generate`, all a workflow calls."""
    return MathTeam(cfg, agent_models, cast(dict[str, Engine], engines), dict(tokenizers))


def _shared(script: dict[str, list[Any]], **cfg: Any) -> tuple[MathTeam, ScriptedEngine]:
    tok = CharTokenizer()
    engine = ScriptedEngine(script, tok, _agent)
    workflow = _workflow(
        WorkflowConfig(**cfg),
        {"solver": "m", "verifier": "m"},
        {"m": engine},
        {"m": tok},
    )
    return workflow, engine


def _run(workflow: MathTeam) -> Episode:
    return asyncio.run(workflow.run_episode(TASK, SAMPLING))


def _agents(episode: Episode) -> list[str]:
    return [s.agent for s in episode.steps]


def _response(step: Any, tok: CharTokenizer) -> str:
    return tok.decode(unpack_ids(step.response_ids).tolist(), skip_special_tokens=True)


# ------------------------------------------------------------------ control flow
def test_approval_stops_early() -> None:
    workflow, engine = _shared(
        {"solver": [" \\boxed{5}"], "verifier": [" <verify>yes</verify>"]}, max_loops=3
    )
    episode = _run(workflow)
    assert _agents(episode) == ["solver", "verifier"]
    assert [s.valid for s in episode.steps] == [True, True]
    assert episode.reward == 1.0
    # the verifier read the solver's answer
    assert engine.calls[1].prompt.endswith("Solver: \\boxed{5}\nVerifier:")


def test_rejection_loops_and_verifier_skipped_on_last_loop() -> None:
    workflow, engine = _shared(
        {
            "solver": [" \\boxed{4}", " \\boxed{5}"],
            "verifier": [" <verify>no</verify>"],
        },
        max_loops=2,
    )
    episode = _run(workflow)
    assert _agents(episode) == ["solver", "verifier", "solver"]
    assert episode.reward == 1.0
    # the rejection is in the second solver prompt
    assert engine.calls[2].prompt == (
        "Solve.\nQuestion: 2+3\nSolver: \\boxed{4}\nVerifier: <verify>no</verify>\nSolver:"
    )


def test_max_loops_bounds_the_episode() -> None:
    workflow, _ = _shared(
        {"solver": [" \\boxed{4}"] * 3, "verifier": [" <verify>no</verify>"] * 3}, max_loops=3
    )
    episode = _run(workflow)
    assert _agents(episode) == ["solver", "verifier"] * 2 + ["solver"]
    assert episode.reward == 0.0


def test_single_loop_has_no_verifier() -> None:
    workflow, engine = _shared({"solver": [" \\boxed{5}"], "verifier": []}, max_loops=1)
    episode = _run(workflow)
    assert _agents(episode) == ["solver"]
    assert episode.reward == 1.0
    assert engine.calls[0].prompt == "Solve.\nQuestion: 2+3\nSolver:"


def test_invalid_verdict_is_invalid_and_a_rejection() -> None:
    workflow, _ = _shared(
        {"solver": [" \\boxed{5}", " \\boxed{5}"], "verifier": [" looks right to me"]},
        max_loops=2,
    )
    episode = _run(workflow)
    assert _agents(episode) == ["solver", "verifier", "solver"]
    assert [s.valid for s in episode.steps] == [True, False, True]


def test_reward_grades_the_last_solver_answer() -> None:
    # a correct first answer does not count when the last one has no \boxed{}
    workflow, _ = _shared(
        {"solver": [" \\boxed{5}", " five"], "verifier": [" <verify>no</verify>"]}, max_loops=2
    )
    episode = _run(workflow)
    assert [s.valid for s in episode.steps] == [True, True, False]
    assert episode.reward == 0.0


def test_step_contents_and_versions_come_from_the_engine() -> None:
    workflow, engine = _shared(
        {"solver": [" \\boxed{4}", (" \\boxed{5", "length")], "verifier": [" <verify>no</verify>"]},
        max_loops=2,
    )
    engine.version = 7  # what the engine holds now is not what generated the steps
    episode = _run(workflow)
    assert [s.version for s in episode.steps] == [100, 101, 102]
    assert [s.finish_reason for s in episode.steps] == ["stop", "stop", "length"]
    assert episode.steps[2].valid is False and episode.reward == 0.0
    tok = engine.tokenizer
    for step, call in zip(episode.steps, engine.calls):
        assert unpack_ids(step.prompt_ids).tolist() == call.request.prompt_ids
        response = unpack_ids(step.response_ids)
        np.testing.assert_array_equal(unpack_logprobs(step.logprobs), np.full(len(response), -0.25))
        assert call.request.temperature == 1.0 and call.request.top_p == 0.9
        assert call.request.max_new_tokens == 32 and call.request.stop == ()
    assert response[-1] != EOS  # "length" ended without EOS
    assert _response(episode.steps[0], tok) == " \\boxed{4}"
    assert unpack_ids(episode.steps[0].response_ids)[-1] == EOS
    limits = Limits(agent_models={"solver": "m", "verifier": "m"}, vocab_sizes={"m": 256})
    for step in episode.steps:
        check_step(step, limits)


def test_empty_response_is_a_clear_error() -> None:
    class Empty(ScriptedEngine):
        async def generate(self, request: GenerateRequest) -> GenerateResult:
            return GenerateResult([], [], "stop", 0)

    tok = CharTokenizer()
    workflow = _workflow(
        WorkflowConfig(),
        {"solver": "m", "verifier": "m"},
        {"m": Empty({}, tok)},
        {"m": tok},
    )
    with pytest.raises(RuntimeError, match="no tokens for agent 'solver'"):
        _run(workflow)


# ---------------------------------------------------------------------- routing
def test_non_shared_models_use_their_own_engine_and_tokenizer() -> None:
    tok_a, tok_b = CharTokenizer(0), CharTokenizer(256)
    engine_a = ScriptedEngine({"solver": [" \\boxed{4}", " \\boxed{5}"]}, tok_a, _agent, "a")
    engine_b = ScriptedEngine({"verifier": [" <verify>no</verify>"]}, tok_b, _agent, "b")
    workflow = _workflow(
        WorkflowConfig(max_loops=2),
        {"solver": "a", "verifier": "b"},
        {"a": engine_a, "b": engine_b},
        {"a": tok_a, "b": tok_b},
    )
    episode = _run(workflow)
    assert [c.agent for c in engine_a.calls] == ["solver", "solver"]
    assert [c.agent for c in engine_b.calls] == ["verifier"]
    assert [(s.agent, s.model) for s in episode.steps] == [
        ("solver", "a"),
        ("verifier", "b"),
        ("solver", "a"),
    ]
    # each prompt was tokenised by its own model's tokenizer
    verifier_prompt = unpack_ids(episode.steps[1].prompt_ids)
    assert verifier_prompt.min() >= 256
    assert unpack_ids(episode.steps[0].prompt_ids).max() < 256
    assert engine_b.calls[0].prompt.endswith("Solver: \\boxed{4}\nVerifier:")
    assert engine_a.calls[1].prompt.endswith("Verifier: <verify>no</verify>\nSolver:")
    assert episode.reward == 1.0
    limits = Limits(agent_models={"solver": "a", "verifier": "b"}, vocab_sizes={"a": 256, "b": 512})
    for step in episode.steps:
        check_step(step, limits)
    # and a limit that mixes them up refuses the steps
    swapped = Limits(
        agent_models={"solver": "a", "verifier": "b"}, vocab_sizes={"a": 256, "b": 256}
    )
    with pytest.raises(ValueError, match="vocabulary"):
        check_step(episode.steps[1], swapped)


def test_shared_model_routes_every_agent_to_one_engine() -> None:
    workflow, engine = _shared(
        {"solver": [" \\boxed{4}", " \\boxed{5}"], "verifier": [" <verify>no</verify>"]},
        max_loops=2,
    )
    episode = _run(workflow)
    assert [c.agent for c in engine.calls] == ["solver", "verifier", "solver"]
    assert {s.model for s in episode.steps} == {"m"}


def test_bad_wiring_is_refused() -> None:
    tok = CharTokenizer()
    engine = ScriptedEngine({}, tok, _agent)
    with pytest.raises(ValueError, match="bound to model 'x'"):
        _workflow(WorkflowConfig(), {"solver": "m", "verifier": "x"}, {"m": engine}, {"m": tok})
    with pytest.raises(ValueError, match="agents"):
        _workflow(WorkflowConfig(), {"solver": "m"}, {"m": engine}, {"m": tok})
    with pytest.raises(ValueError, match="prompt_style"):
        _workflow(
            WorkflowConfig(prompt_style="fancy"),
            {"solver": "m", "verifier": "m"},
            {"m": engine},
            {"m": tok},
        )
    with pytest.raises(ValueError, match="max_loops"):
        _workflow(
            WorkflowConfig(max_loops=0), {"solver": "m", "verifier": "m"}, {"m": engine}, {"m": tok}
        )


# ----------------------------------------------------------------- prompt styles
@pytest.mark.parametrize("chat_returns", ["list", "batch_encoding", "batched"])
def test_chat_style_uses_the_template_and_full_instructions(chat_returns: str) -> None:
    tok = CharTokenizer(chat_returns=chat_returns)
    engine = ScriptedEngine(
        {"solver": [" \\boxed{5}"], "verifier": [" <verify>yes</verify>"]}, tok, _agent
    )
    workflow = _workflow(
        WorkflowConfig(prompt_style="chat"),
        {"solver": "m", "verifier": "m"},
        {"m": engine},
        {"m": tok},
    )
    episode = _run(workflow)
    assert _agents(episode) == ["solver", "verifier"]
    assert engine.calls[0].prompt.startswith(
        f"<system>{INSTRUCTIONS['solver']}\n<user>Question: 3+4\n\nYou are the Solver. "
        "Respond now.\n<assistant>3+4 = 7. \\boxed{7}\n<user>Question: 2+3\n"
    )  # the worked example (prompts.EXAMPLES), then the question
    assert engine.calls[1].prompt.startswith(f"<system>{INSTRUCTIONS['verifier']}\n")
    assert "Solver: \\boxed{5}" in engine.calls[1].prompt
    assert all(isinstance(i, int) for i in engine.calls[0].request.prompt_ids)


def test_plain_defaults_and_instruction_overrides() -> None:
    workflow, engine = _shared({"solver": [" \\boxed{5}"], "verifier": [" <verify>yes</verify>"]})
    _run(workflow)
    assert engine.calls[0].prompt.startswith(TINY_INSTRUCTIONS["solver"] + "\n")
    assert engine.calls[1].prompt.startswith(TINY_INSTRUCTIONS["verifier"] + "\n")

    workflow, engine = _shared(
        {"solver": [" \\boxed{5}"], "verifier": [" <verify>yes</verify>"]},
        instructions={"verifier": "Judge."},
    )
    _run(workflow)
    assert engine.calls[0].prompt.startswith("Solve.\n")
    assert engine.calls[1].prompt.startswith("Judge.\n")


# ------------------------------------------------------------------ concurrency
class BatchingEngine:
    """Holds every request until `batch` of them are pending, then answers all: a group
    whose episodes ran one after another would never fill a batch."""

    def __init__(self, tokenizer: CharTokenizer, batch: int) -> None:
        self.model_name = "m"
        self.version = 0
        self.tokenizer = tokenizer
        self.batch = batch
        self.pending: list[tuple[GenerateRequest, asyncio.Future[GenerateResult]]] = []
        self.batches: list[int] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        future: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        self.pending.append((request, future))
        if len(self.pending) == self.batch:
            self.batches.append(len(self.pending))
            for req, fut in self.pending:
                prompt = self.tokenizer.decode(req.prompt_ids)
                text = " <verify>yes</verify>" if prompt.endswith("Verifier:") else " \\boxed{5}"
                ids = [*self.tokenizer(text, add_special_tokens=False).input_ids, EOS]
                fut.set_result(GenerateResult(ids, [-1.0] * len(ids), "stop", self.version))
            self.pending = []
        return await future


def test_run_group_runs_episodes_concurrently() -> None:
    tok = CharTokenizer()
    engine = BatchingEngine(tok, batch=4)
    workflow = _workflow(
        WorkflowConfig(),
        {"solver": "m", "verifier": "m"},
        {"m": engine},
        {"m": tok},
    )

    async def main() -> list[Episode]:
        return await asyncio.wait_for(workflow.run_group(TASK, SAMPLING, 4), timeout=10)

    episodes = asyncio.run(main())
    assert len(episodes) == 4
    assert engine.batches == [4, 4]  # solver calls batched, then verifier calls
    assert all(e.reward == 1.0 and _agents(e) == ["solver", "verifier"] for e in episodes)
