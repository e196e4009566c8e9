"""A Proposer and a Critic: a complete drmas team in one file, trained with
`drmas train --config examples/proposer_critic/config.yaml`.

The Proposer adds two numbers from 0..24 (a third of the questions go beyond the 0..19 the
builtin tiny models were warm-started on); the Critic approves the sum or rejects it. An
approved answer is the team's answer, a rejected one makes the team abstain. Reward: 1
right, 0 wrong, 0.3 for abstaining (`workflow.options.abstain`), so the Critic gains by
learning when its Proposer can be trusted.
"""

import random

from drmas.protocol.messages import Episode, SamplingParams, Task
from drmas.teams import Team, TeamLayout
from drmas.teams.math.grading import grade
from drmas.teams.math.prompts import parse_boxed, parse_verdict


class ProposerCritic(Team):
    name = "proposer_critic"
    agents = ("proposer", "critic")
    # The builtin tiny models only know the math team's plain format, so the plain style
    # reuses its labels and words; with real checkpoints use prompt_style=chat.
    layout = TeamLayout({"proposer": "Solver", "critic": "Verifier"})
    default_instructions = {
        "plain": {"proposer": "Solve.", "critic": "Check."},
        "chat": {
            "proposer": "Add the two numbers. Put the result in \\boxed{}.",
            "critic": "Is the proposed sum right? Reply <verify>yes</verify> or <verify>no</verify>.",
        },
    }

    async def run_episode(self, task: Task, sampling: SamplingParams) -> Episode:
        turns: list[tuple[str, str]] = []
        text, proposal = await self.call("proposer", task, turns, sampling)
        answer = parse_boxed(text)
        proposal.valid = answer is not None  # an unparseable step is penalised
        turns.append(("proposer", text))
        text, review = await self.call("critic", task, turns, sampling)
        approved = parse_verdict(text)
        review.valid = approved is not None
        right = grade(answer, task.answer)
        metrics = {"approved": float(bool(approved)), "proposer_right": float(right)}
        final = answer if approved else None
        return Episode([proposal, review], self.reward(task, final), metrics=metrics)

    def score(self, task: Task, answer: str | None) -> float:
        if answer is None:
            return float(self.cfg.options.get("abstain", 0.3))
        return 1.0 if grade(answer, task.answer) else 0.0


def tasks(cfg):  # task.name=team.py:tasks: (TaskConfig) -> (train, val)
    lo, hi = cfg.options.get("lo", 0), cfg.options.get("hi", 24)
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    random.Random(cfg.seed).shuffle(pairs)
    items = [{"question": f"{a}+{b}", "answer": str(a + b)} for a, b in pairs]
    return items[cfg.num_val :], items[: cfg.num_val]
