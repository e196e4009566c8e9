"""The math team as an async workflow: Solver answers, Verifier approves or rejects.

One episode, for loop = 1..max_loops:
    Solver answers (final answer in \\boxed{});
    on the last loop stop, else the Verifier reads the team context and answers
    <verify>yes</verify> (stop) or anything else (the rejection stays in the context and
    the Solver tries again). A Verifier reply without a verdict counts as a rejection.
Reward: 1.0 if the last Solver answer grades correct, else 0.0.

Every agent call is one protocol Step. Each model has its own engine and tokenizer:
agents that share a model share both, and a prompt is always tokenised with the
tokenizer of the model that will read it.

Episodes only await the engines, so the G episodes of a group run concurrently
(`run_group`) and the engine batches their calls. Grading runs on the loop thread, where
math_verify can bound its work (see drmas/tasks/grading.py); for plain numeric answers it
is a microsecond string parse.

Default instructions: `TINY_INSTRUCTIONS` for the plain style (what the tiny
character-level model is warm-started on) and `INSTRUCTIONS` for the chat style; entries
of `WorkflowConfig.instructions` override them per agent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from drmas.actors.config import WorkflowConfig
from drmas.actors.engines.base import Engine, GenerateRequest
from drmas.actors.workflows.math_prompts import (
    INSTRUCTIONS,
    SOLVER,
    TINY_INSTRUCTIONS,
    VERIFIER,
    chat_messages,
    parse_boxed,
    parse_verdict,
    plain_prompt,
)
from drmas.protocol.arrays import pack_ids, pack_logprobs
from drmas.protocol.messages import Episode, SamplingParams, Step, Task
from drmas.tasks.grading import grade

AGENTS = (SOLVER, VERIFIER)
DEFAULT_INSTRUCTIONS = {"plain": TINY_INSTRUCTIONS, "chat": INSTRUCTIONS}


class MathWorkflow:
    """Solver <-> Verifier episodes over per-model engines and tokenizers."""

    def __init__(
        self,
        cfg: WorkflowConfig,
        agent_models: dict[str, str],
        engines: dict[str, Engine],
        tokenizers: dict[str, Any],
    ) -> None:
        if cfg.max_loops < 1:
            raise ValueError(f"workflow.max_loops must be >= 1, got {cfg.max_loops}")
        if cfg.prompt_style not in DEFAULT_INSTRUCTIONS:
            raise ValueError(
                f"workflow.prompt_style must be one of {sorted(DEFAULT_INSTRUCTIONS)}, "
                f"got {cfg.prompt_style!r}"
            )
        if set(agent_models) != set(AGENTS):
            raise ValueError(
                f"the math workflow has agents {list(AGENTS)}; agent_models names "
                f"{sorted(agent_models)}"
            )
        for agent, model in agent_models.items():
            if model not in engines or model not in tokenizers:
                raise ValueError(
                    f"agent {agent!r} is bound to model {model!r}, but engines serve "
                    f"{sorted(engines)} and tokenizers are for {sorted(tokenizers)}"
                )
        overrides = cfg.instructions or {}
        unknown = sorted(set(overrides) - set(AGENTS))
        if unknown:
            raise ValueError(f"workflow.instructions names unknown agents {unknown}")
        self.cfg = cfg
        self.agent_models = dict(agent_models)
        self.engines = engines
        self.tokenizers = tokenizers
        self.instructions = {**DEFAULT_INSTRUCTIONS[cfg.prompt_style], **overrides}

    async def run_group(
        self, task: Task, sampling: SamplingParams, group_size: int
    ) -> list[Episode]:
        """`group_size` episodes of one task, run concurrently so the engines batch them."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        return list(
            await asyncio.gather(*(self.run_episode(task, sampling) for _ in range(group_size)))
        )

    async def run_episode(self, task: Task, sampling: SamplingParams) -> Episode:
        turns: list[tuple[str, str]] = []
        steps: list[Step] = []
        answer: str | None = None
        for loop in range(self.cfg.max_loops):
            text, step = await self._call(SOLVER, task, turns, sampling)
            answer = parse_boxed(text)
            step.valid = answer is not None
            steps.append(step)
            turns.append((SOLVER, text))
            if loop == self.cfg.max_loops - 1:
                break
            text, step = await self._call(VERIFIER, task, turns, sampling)
            verdict = parse_verdict(text)
            step.valid = verdict is not None
            steps.append(step)
            turns.append((VERIFIER, text))
            if verdict:
                break
        reward = 1.0 if grade(answer, task.answer) else 0.0
        return Episode(steps=steps, reward=reward)

    async def _call(
        self, agent: str, task: Task, turns: Sequence[tuple[str, str]], sampling: SamplingParams
    ) -> tuple[str, Step]:
        """One agent call: its prompt, the engine's answer, the decoded text and the step
        (valid=False until the caller has parsed the action)."""
        model = self.agent_models[agent]
        tokenizer = self.tokenizers[model]
        prompt_ids = self._prompt_ids(agent, task, turns, tokenizer)
        result = await self.engines[model].generate(
            GenerateRequest(
                prompt_ids=prompt_ids,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_new_tokens=sampling.max_new_tokens,
            )
        )
        if not result.token_ids:
            raise RuntimeError(
                f"engine of model {model!r} returned no tokens for agent {agent!r}; "
                "a step needs at least one response token"
            )
        if len(result.logprobs) != len(result.token_ids):
            raise RuntimeError(
                f"engine of model {model!r} returned {len(result.logprobs)} log-probs for "
                f"{len(result.token_ids)} tokens"
            )
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        step = Step(
            agent=agent,
            model=model,
            prompt_ids=pack_ids(prompt_ids),
            response_ids=pack_ids(result.token_ids),
            logprobs=pack_logprobs(result.logprobs),
            version=result.version,
            valid=False,
            finish_reason=result.finish_reason,
        )
        return text, step

    def _prompt_ids(
        self, agent: str, task: Task, turns: Sequence[tuple[str, str]], tokenizer: Any
    ) -> list[int]:
        instruction = self.instructions[agent]
        if self.cfg.prompt_style == "plain":
            text = plain_prompt(agent, task.question, turns, instruction)
            return list(tokenizer(text, add_special_tokens=False).input_ids)
        messages = chat_messages(agent, task.question, turns, instruction)
        return _as_ids(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        )


def _as_ids(encoded: Any) -> list[int]:
    """apply_chat_template returns a list of ids, or (newer transformers) a BatchEncoding;
    either may be batched ([[...]]) or a tensor."""
    if isinstance(encoded, Mapping):  # BatchEncoding is a UserDict
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    ids = list(encoded)
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise ValueError(f"chat template returned a batch of {len(ids)} prompts, expected one")
        ids = list(ids[0])
    return [int(i) for i in ids]
