"""The math team as an async workflow: Solver answers, Verifier approves or rejects.

One episode, for loop = 1..max_loops:
    Solver answers (final answer in \\boxed{});
    on the last loop stop, else the Verifier reads the team context and answers
    <verify>yes</verify> (stop) or anything else (the rejection stays in the context and
    the Solver tries again). A Verifier reply without a verdict counts as a rejection.
Reward: 1.0 if the last Solver answer grades correct, else 0.0 (`score`; the config's
`workflow.reward` may replace it). That is the episode's (team) reward: with
`workflow.rewards=team` (the default) every step is scored with it, and it is always what
validation counts as solved.

Role rewards (`workflow.rewards=role`): each step carries its own `Step.reward`, and the
broker scores the step with it (minus algorithm.invalid_action_penalty when the step is
invalid):
    Solver step     1.0 if the answer of this very step grades correct, else 0.0 (an
                    earlier right answer is paid even if a later one is wrong);
    Verifier step   1.0 if its verdict matches whether the Solver answer it judged (the
                    one just before it) grades correct: yes for a right answer, no for a
                    wrong or unparseable one; 0.0 for a wrong verdict and for a reply
                    without a verdict (routed as a rejection, but no verdict is not a
                    right one).
"Correct" is the team's own grading (`grade`), so role rewards and `workflow.reward`
exclude each other (check_settings refuses both).

Every agent call is one protocol Step (drmas/teams/base.py: bindings, prompt
styles, calls). Grading runs on the loop thread, where math_verify can bound its work
(see drmas/teams/math/grading.py); for plain numeric answers it is a microsecond string parse.

Default instructions: `TINY_INSTRUCTIONS` for the plain style (what the tiny
character-level model is warm-started on) and `INSTRUCTIONS` for the chat style; entries
of `WorkflowConfig.instructions` override them per agent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

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
        if cfg.rewards == "role" and cfg.reward:
            raise ValueError(
                f"workflow.rewards=role pays the math team's agents by its own grading, so "
                f"workflow.reward={cfg.reward!r} would not train anything: unset "
                "workflow.reward, or keep workflow.rewards=team to train with it"
            )

    @classmethod
    def check_config(cls, cfg: DrmasConfig) -> None:
        """check_settings as a ConfigError, where the run's config is checked against its team
        (drmas/teams/resolve.py), before any episode runs."""
        from drmas.config import ConfigError

        try:
            cls.check_settings(cfg.workflow)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    async def run_episode(self, task: Task, sampling: SamplingParams) -> Episode:
        turns: list[tuple[str, str]] = []
        steps: list[Step] = []
        answer: str | None = None
        role = self.cfg.rewards == "role"
        for loop in range(self.cfg.max_loops):
            text, step = await self.call(SOLVER, task, turns, sampling)
            answer = parse_boxed(text)
            step.valid = answer is not None
            right = role and grade(answer, task.answer)
            if role:
                step.reward = 1.0 if right else 0.0
            steps.append(step)
            turns.append((SOLVER, text))
            if loop == self.cfg.max_loops - 1:
                break
            text, step = await self.call(VERIFIER, task, turns, sampling)
            verdict = parse_verdict(text)
            step.valid = verdict is not None
            if role:
                step.reward = verdict_reward(verdict, right)
            steps.append(step)
            turns.append((VERIFIER, text))
            if verdict:
                break
        return Episode(steps=steps, reward=self.reward(task, answer))

    def score(self, task: Task, answer: str | None) -> float:
        return 1.0 if grade(answer, task.answer) else 0.0


def verdict_reward(verdict: bool | None, answer_right: bool) -> float:
    """The Verifier's role reward: 1.0 for a verdict (True = approve) that matches whether
    the answer it judged is right; 0.0 for a wrong verdict or none at all."""
    return 1.0 if verdict is not None and verdict == answer_right else 0.0
