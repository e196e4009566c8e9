"""What every team shares: agent -> model bindings, prompts in the plain or chat style,
one agent call = one protocol Step, tool calls, and the reward hook.

A team is one class (drmas/teams/math, drmas/teams/search, or your own file, loaded by
drmas/plugins.py from `workflow.name` / `workflow.target`). It declares

    name, agents            its agent names (the config's `agents` must name the same)
    default_instructions    prompt style -> agent -> role instruction
    layout                  how prompts are rendered (drmas/teams/layout.py)
    tools                   tool name -> plain async function (argument text -> result text)
    run_episode             the episode logic: awaits `call` / `tool_step`, returns an Episode
    score                   its reward of a final answer (`workflow.reward` may replace it)

Who calls it: the actor process (drmas/actors/main.py) builds the team once with
`Team.build` and runs leased groups through `run_group`; `drmas probe` and `drmas eval` do
the same in one process. Each model has its own engine and tokenizer: agents that share a
model share both (on a LoRA model each call names its agent's adapter), and a prompt is
always tokenised with the tokenizer of the model that will read it. Episodes only await
the engines, so the G episodes of a group run concurrently and the engine batches their
calls.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from drmas.config.actor import WorkflowConfig
from drmas.plugins import load_object
from drmas.protocol.arrays import pack_ids, pack_logprobs
from drmas.protocol.engine import Engine, GenerateRequest
from drmas.protocol.messages import Episode, SamplingParams, Step, Task
from drmas.teams.layout import TeamLayout

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

log = logging.getLogger("drmas.team")

Turns = Sequence[tuple[str, str]]
"""Team context so far: (agent name, tool name or other label key, text)."""

Tool = Callable[[str], Awaitable[Any]]
"""A tool: `async def tool(argument: str) -> str` (anything else is shown with str()). It
may have a `close()` that the team calls when the actor stops."""

Reward = Callable[[Task, "str | None"], float]
"""`workflow.reward`: (task, the team's final answer or None) -> reward."""

MAX_TOOL_ARGUMENT_CHARS = 256
"""A longer tool argument is an invalid action (a runaway generation, not a call)."""


@dataclass
class ToolStep:
    """One agent call that may call a tool: what the agent wrote, its protocol Step
    (valid = a tool call parsed), and the call and its result when there was one."""

    text: str
    step: Step
    tool: str | None = None
    argument: str | None = None
    result: str | None = None


class Team:
    """Base of every team: checks the bindings, makes agent calls and tool calls."""

    name: ClassVar[str]
    agents: ClassVar[tuple[str, ...]]
    default_instructions: ClassVar[dict[str, dict[str, str]]]
    """prompt style -> agent -> role instruction."""
    layout: ClassVar[TeamLayout]
    """How prompts are rendered (labels of the agents, tools and other context entries)."""
    tools: ClassVar[Mapping[str, Tool]] = {}
    """Tools every instance has; `workflow.tools` adds or replaces entries."""
    result_keys: ClassVar[Mapping[str, str]] = {}
    """Tool name -> the team-context key its results join under (default: the tool's name;
    the layout labels the key)."""

    def __init__(
        self,
        cfg: WorkflowConfig,
        agent_models: dict[str, str],
        engines: Mapping[str, Engine],
        tokenizers: Mapping[str, Any],
        tools: Mapping[str, Tool] | None = None,
        reward: Reward | None = None,
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        self.check_settings(cfg)
        if cfg.prompt_style not in self.default_instructions:
            raise ValueError(
                f"workflow.prompt_style must be one of {sorted(self.default_instructions)}, "
                f"got {cfg.prompt_style!r}"
            )
        if set(agent_models) != set(self.agents):
            raise ValueError(
                f"the {self.name} team has agents {list(self.agents)}; agent_models names "
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
        self.agent_adapters = {a: (adapters or {}).get(a, "") for a in agent_models}
        """agent -> the LoRA adapter its calls generate with ("" = its model itself)."""
        self.engines = engines
        self.tokenizers = tokenizers
        self.instructions = {**self.default_instructions[cfg.prompt_style], **overrides}
        self.tool_fns: dict[str, Tool] = {**self.tools, **(tools or {})}
        self._reward = reward
        self.warned_unpaid: set[str] = set()
        """Agents already named in the role-reward warning (warn_unpaid_steps)."""
        self.check_tools()

    @classmethod
    def check_settings(cls, cfg: WorkflowConfig) -> None:
        """The team's own `workflow.*` settings (raise ValueError saying what to fix)."""

    def check_tools(self) -> None:
        """The tools the team needs are there (raise ValueError naming the missing one)."""

    # ------------------------------------------------------------- construction
    @classmethod
    def build(
        cls,
        cfg: DrmasConfig,
        agent_models: dict[str, str],
        engines: Mapping[str, Engine],
        tokenizers: Mapping[str, Any],
    ) -> Team:
        """The team of a run: its tools (`make_tools`), `workflow.reward`, if set, and each
        agent's adapter (models.<m>.lora)."""
        reward = (
            load_object(cfg.workflow.reward, "workflow.reward") if cfg.workflow.reward else None
        )
        if reward is not None and not callable(reward):
            raise TypeError(f"workflow.reward={cfg.workflow.reward!r} is not a function")
        adapters = {agent: cfg.adapter_of(agent) for agent in agent_models}
        return cls(
            cfg.workflow,
            agent_models,
            engines,
            tokenizers,
            cls.make_tools(cfg),
            reward,
            adapters=adapters,
        )

    @classmethod
    def make_tools(cls, cfg: DrmasConfig) -> dict[str, Tool]:
        """`workflow.tools` (tool name -> target of an async function), loaded and checked.
        A team with tools that need the run's settings (the search team's retriever)
        extends this."""
        tools: dict[str, Tool] = {}
        for name, target in cfg.workflow.tools.items():
            fn = load_object(target, f"workflow.tools.{name}")
            call = getattr(fn, "__call__", None)  # noqa: B004 - an instance may be the tool
            if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)):
                raise TypeError(
                    f"workflow.tools.{name}={target!r} must be an async function "
                    "(async def tool(argument: str) -> str)"
                )
            tools[name] = fn
        return tools

    @classmethod
    def check_config(cls, cfg: DrmasConfig) -> None:
        """Team-specific rules on the whole config (raise ConfigError saying what to fix)."""

    @classmethod
    def prepare(cls, cfg: DrmasConfig) -> DrmasConfig:
        """Run once by `drmas train` / `drmas prepare` before any process starts (the search
        team builds its retrieval index here); returns the config the processes read."""
        return cfg

    @classmethod
    def max_steps_per_episode(cls, cfg: WorkflowConfig) -> int:
        """A bound on agent calls per episode: the broker refuses a runaway episode."""
        return 4 * max(cfg.max_loops, cfg.max_turns) + 4

    # ------------------------------------------------------------------ episodes
    async def run_group(
        self, task: Task, sampling: SamplingParams, group_size: int
    ) -> list[Episode]:
        """`group_size` episodes of one task, run concurrently so the engines batch them."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        episodes = list(
            await asyncio.gather(*(self.run_episode(task, sampling) for _ in range(group_size)))
        )
        if self.cfg.rewards == "role":
            self.warn_unpaid_steps(episodes)
        return episodes

    def warn_unpaid_steps(self, episodes: Sequence[Episode]) -> None:
        """With `workflow.rewards=role` a step without its own `Step.reward` is scored with
        the team reward. A team of your own that never sets it would train on team rewards
        while the config says role: say so, once per agent (a team may mean it: an agent
        that shares the team reward beside role-paid ones)."""
        unpaid = {s.agent for e in episodes for s in e.steps if s.reward is None}
        for agent in sorted(unpaid - self.warned_unpaid):
            self.warned_unpaid.add(agent)
            log.warning(
                "workflow.rewards=role, but the %s team left Step.reward unset on a step of "
                "agent %r: its steps are scored with the team reward. Fine if %r is meant "
                "to share it; otherwise set step.reward in run_episode (docs/own-team.md)",
                self.name,
                agent,
                agent,
            )

    async def run_episode(self, task: Task, sampling: SamplingParams) -> Episode:
        raise NotImplementedError

    async def close(self) -> None:
        """Release what the team holds beyond the engines: its tools' `close()`."""
        for tool in self.tool_fns.values():
            close = getattr(tool, "close", None)
            if close is not None:
                done = close()
                if inspect.isawaitable(done):
                    await done

    async def call(
        self, agent: str, task: Task, turns: Turns, sampling: SamplingParams
    ) -> tuple[str, Step]:
        """One agent call: its prompt, the engine's answer, the decoded text and the step
        (valid=False until the caller has parsed the action)."""
        model = self.agent_models[agent]
        tokenizer = self.tokenizers[model]
        prompt_ids = self.prompt_ids(agent, task, turns, tokenizer)
        own = sampling.for_agent(agent)  # agents.<name>.sampling over the run's
        result = await self.engines[model].generate(
            GenerateRequest(
                prompt_ids=prompt_ids,
                temperature=own.temperature,
                top_p=own.top_p,
                max_new_tokens=own.max_new_tokens,
                stop=tuple(own.stop),
                adapter=self.agent_adapters[agent],
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

    # --------------------------------------------------------------------- tools
    async def tool_step(
        self,
        agent: str,
        task: Task,
        turns: list[tuple[str, str]],
        sampling: SamplingParams,
        parse: Callable[[str], tuple[str, str] | None] | None = None,
    ) -> ToolStep:
        """One agent call that may call a tool. The agent's text joins `turns`; a call
        (`parse`, by default the last complete `<tool>argument</tool>` of a known tool) is
        awaited and its result joins `turns` under the tool's `result_keys` entry or name
        (labelled by the layout). The step is valid when a call parsed."""
        text, step = await self.call(agent, task, turns, sampling)
        found = (parse or self.parse_tool_call)(text)
        step.valid = found is not None
        turns.append((agent, text))
        if found is None:
            return ToolStep(text, step)
        tool, argument = found
        if tool not in self.tool_fns:
            raise RuntimeError(f"{self.name} team parsed a call of tool {tool!r}, which it lacks")
        try:
            result = await self.tool_fns[tool](argument)
        except Exception as exc:  # the actor counts it as the team's failure: say which tool
            exc.add_note(f"raised by the {self.name} team's tool {tool!r}, argument {argument!r}")
            raise
        shown = result if isinstance(result, str) else str(result)
        turns.append((self.result_keys.get(tool, tool), shown))
        return ToolStep(text, step, tool, argument, shown)

    def parse_tool_call(self, text: str) -> tuple[str, str] | None:
        """The last complete `<name>argument</name>` of one of the team's tools (whitespace
        folded), or None: no call, an empty one, or one over MAX_TOOL_ARGUMENT_CHARS."""
        if not self.tool_fns:
            return None
        names = "|".join(re.escape(n) for n in self.tool_fns)
        found = re.findall(rf"<({names})>(.*?)</\1>", text, re.DOTALL)
        if not found:
            return None
        tool, raw = found[-1]
        argument = " ".join(raw.split())
        return (tool, argument) if 0 < len(argument) <= MAX_TOOL_ARGUMENT_CHARS else None

    # -------------------------------------------------------------------- reward
    def reward(self, task: Task, answer: str | None) -> float:
        """The episode's reward: `workflow.reward` when set, else the team's `score`."""
        if self._reward is not None:
            try:
                value = float(self._reward(task, answer))
            except Exception as exc:  # the actor counts it as the team's failure: say whose
                exc.add_note(f"raised by workflow.reward={self.cfg.reward}")
                raise
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"workflow.reward returned {value} for task {task.task_id}")
            return value
        return self.score(task, answer)

    def score(self, task: Task, answer: str | None) -> float:
        """The team's own reward of a final answer."""
        raise NotImplementedError(f"the {self.name} team defines no score(); set workflow.reward")


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
