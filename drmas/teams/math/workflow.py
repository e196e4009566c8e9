"""The math team as an async workflow: Solver answers, Verifier approves or rejects.

One episode, for loop = 1..max_loops:
    Solver answers (final answer in \\boxed{});
    on the last loop stop, else the Verifier reads the team context and answers
    <verify>yes</verify> (stop) or anything else (the rejection stays in the context and
    the Solver tries again). A Verifier reply without a verdict counts as a rejection.
Reward: 1.0 if the last Solver answer grades correct, else 0.0 (`score`; the config's
`workflow.reward` may replace it).

Every agent call is one protocol Step (drmas/teams/base.py: bindings, prompt
styles, calls). Grading runs on the loop thread, where math_verify can bound its work
(see drmas/teams/math/grading.py); for plain numeric answers it is a microsecond string parse.

Default instructions: `TINY_INSTRUCTIONS` for the plain style (what the tiny
character-level model is warm-started on) and `INSTRUCTIONS` for the chat style; entries
of `WorkflowConfig.instructions` override them per agent.
"""

from __future__ import annotations

from drmas.config.actor import WorkflowConfig
from drmas.protocol.messages import Episode, SamplingParams, Step, Task
from drmas.teams.base import Team
from drmas.teams.math import prompts as math_prompts
from drmas.teams.math.grading import grade
from drmas.teams.math.prompts import (
    INSTRUCTIONS,
    SOLVER,
    TINY_INSTRUCTIONS,
    VERIFIER,
    parse_boxed,
    parse_verdict,
)

AGENTS = (SOLVER, VERIFIER)
DEFAULT_INSTRUCTIONS = {"plain": TINY_INSTRUCTIONS, "chat": INSTRUCTIONS}


class MathTeam(Team):
    """Solver <-> Verifier episodes over per-model engines and tokenizers."""

    name = "math"
    agents = AGENTS
    default_instructions = DEFAULT_INSTRUCTIONS
    layout = math_prompts.LAYOUT

    @classmethod
    def check_settings(cls, cfg: WorkflowConfig) -> None:
        if cfg.max_loops < 1:
            raise ValueError(f"workflow.max_loops must be >= 1, got {cfg.max_loops}")

    async def run_episode(self, task: Task, sampling: SamplingParams) -> Episode:
        turns: list[tuple[str, str]] = []
        steps: list[Step] = []
        answer: str | None = None
        for loop in range(self.cfg.max_loops):
            text, step = await self.call(SOLVER, task, turns, sampling)
            answer = parse_boxed(text)
            step.valid = answer is not None
            steps.append(step)
            turns.append((SOLVER, text))
            if loop == self.cfg.max_loops - 1:
                break
            text, step = await self.call(VERIFIER, task, turns, sampling)
            verdict = parse_verdict(text)
            step.valid = verdict is not None
            steps.append(step)
            turns.append((VERIFIER, text))
            if verdict:
                break
        return Episode(steps=steps, reward=self.reward(task, answer))

    def score(self, task: Task, answer: str | None) -> float:
        return 1.0 if grade(answer, task.answer) else 0.0
