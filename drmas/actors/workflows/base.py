"""What every team workflow shares: agent -> model bindings, prompts in the plain or chat
style, and one agent call = one protocol Step.

Each model has its own engine and tokenizer: agents that share a model share both, and a
prompt is always tokenised with the tokenizer of the model that will read it. Episodes
only await the engines, so the G episodes of a group run concurrently (`run_group`) and
the engine batches their calls.

A workflow module (math.py, search.py) subclasses `TeamWorkflow` with its agents, its
default instructions and its prompt layout (drmas/actors/workflows/layout.py), and writes
`run_episode`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from drmas.actors.config import WorkflowConfig
from drmas.actors.engines.base import Engine, GenerateRequest
from drmas.actors.workflows.layout import TeamLayout
from drmas.protocol.arrays import pack_ids, pack_logprobs
from drmas.protocol.messages import Episode, SamplingParams, Step, Task

Turns = Sequence[tuple[str, str]]
"""Team context so far: (agent name or other label key, text)."""


class TeamWorkflow:
    """Base of the team workflows: checks the bindings, makes agent calls."""

    name: ClassVar[str]
    agents: ClassVar[tuple[str, ...]]
    default_instructions: ClassVar[dict[str, dict[str, str]]]
    """prompt style -> agent -> role instruction."""
    layout: ClassVar[TeamLayout]
    """How prompts are rendered (labels of the agents and other context entries)."""

    def __init__(
        self,
        cfg: WorkflowConfig,
        agent_models: dict[str, str],
        engines: dict[str, Engine],
        tokenizers: dict[str, Any],
    ) -> None:
        if cfg.prompt_style not in self.default_instructions:
            raise ValueError(
                f"workflow.prompt_style must be one of {sorted(self.default_instructions)}, "
                f"got {cfg.prompt_style!r}"
            )
        if set(agent_models) != set(self.agents):
            raise ValueError(
                f"the {self.name} workflow has agents {list(self.agents)}; agent_models names "
                f"{sorted(agent_models)}"
            )
        for agent, model in agent_models.items():
            if model not in engines or model not in tokenizers:
                raise ValueError(
                    f"agent {agent!r} is bound to model {model!r}, but engines serve "
                    f"{sorted(engines)} and tokenizers are for {sorted(tokenizers)}"
                )
        overrides = cfg.instructions or {}
        unknown = sorted(set(overrides) - set(self.agents))
        if unknown:
            raise ValueError(f"workflow.instructions names unknown agents {unknown}")
        self.cfg = cfg
        self.agent_models = dict(agent_models)
        self.engines = engines
        self.tokenizers = tokenizers
        self.instructions = {**self.default_instructions[cfg.prompt_style], **overrides}

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
        raise NotImplementedError

    async def close(self) -> None:
        """Release what the workflow holds beyond the engines (e.g. a retriever)."""

    async def call(
        self, agent: str, task: Task, turns: Turns, sampling: SamplingParams
    ) -> tuple[str, Step]:
        """One agent call: its prompt, the engine's answer, the decoded text and the step
        (valid=False until the caller has parsed the action)."""
        model = self.agent_models[agent]
        tokenizer = self.tokenizers[model]
        prompt_ids = self.prompt_ids(agent, task, turns, tokenizer)
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

    def prompt_ids(self, agent: str, task: Task, turns: Turns, tokenizer: Any) -> list[int]:
        instruction = self.instructions[agent]
        if self.cfg.prompt_style == "plain":
            text = self.layout.plain_prompt(agent, task.question, turns, instruction)
            return list(tokenizer(text, add_special_tokens=False).input_ids)
        messages = self.layout.chat_messages(agent, task.question, turns, instruction)
        return as_ids(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        )


def as_ids(encoded: Any) -> list[int]:
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
