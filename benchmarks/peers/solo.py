"""The single-agent job drmas and TRL's GRPOTrainer both run in bench_trl.py: one agent
answers "What is a+b?" (a chat prompt, the model's own chat template, nothing else), and
earns 1 when the last number of its reply is the sum.

Used by both sides, so the prompts, the held-out split and the grading are one code:
- drmas: `workflow.target=benchmarks/peers/solo.py:Solo task.name=benchmarks/peers/solo.py:tasks`;
- TRL: `messages(question)` for its conversational dataset and `reward(text, answer)` in its
  reward function; the held-out evaluation of both (bench_trl.py) grades with `reward`.

The tasks: every a+b with a, b in 0..max (task.options.max, default 19): 400 questions,
`task.num_val` of them held out. The split is fixed by task.seed (not by the run's seed), so
every run of a comparison is scored on the same held-out questions; task.order_seed
varies the training order.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from drmas.protocol.messages import Episode, SamplingParams, Task
from drmas.teams import Team, TeamLayout
from drmas.teams.base import Turns, as_ids

_LAST_NUMBER = re.compile(r"-?\d+")


def messages(question: str) -> list[dict[str, str]]:
    """The chat prompt of one task: the question as the only user message."""
    return [{"role": "user", "content": question}]


def answer_of(text: str) -> str | None:
    """The reply's answer: its last integer (None: no number at all)."""
    found = _LAST_NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def reward(text: str, answer: str) -> float:
    """1.0 when the reply's last integer is the gold answer, else 0.0."""
    return 1.0 if answer_of(text) == answer.strip() else 0.0


class Solo(Team):
    """One agent, one call per episode: GRPO's setting, for comparing with TRL."""

    name = "solo"
    agents = ("solver",)
    layout = TeamLayout({"solver": "Solver"})
    default_instructions: ClassVar[dict[str, dict[str, str]]] = {
        "plain": {"solver": ""},
        "chat": {"solver": ""},
    }

    def prompt_ids(self, agent: str, task: Task, turns: Turns, tokenizer: Any) -> list[int]:
        encoded = tokenizer.apply_chat_template(
            messages(task.question), add_generation_prompt=True, tokenize=True
        )
        return as_ids(encoded)

    async def run_episode(self, task: Task, sampling: SamplingParams) -> Episode:
        text, step = await self.call("solver", task, [], sampling)
        step.valid = True  # any reply is an answer: no format penalty, as in the TRL job
        return Episode([step], reward(text, task.answer), metrics={})


def tasks(cfg: Any) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """task.name=benchmarks/peers/solo.py:tasks: (TaskConfig) -> (train, held-out)."""
    top = int(cfg.options.get("max", 19))
    pairs = [(a, b) for a in range(top + 1) for b in range(top + 1)]
    random.Random(f"solo:{cfg.seed}").shuffle(pairs)
    items = [{"question": f"What is {a}+{b}?", "answer": str(a + b)} for a, b in pairs]
    return items[cfg.num_val :], items[: cfg.num_val]
