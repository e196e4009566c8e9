"""The search team as an async workflow: Verifier routes, Search Agent queries the
retriever, Answer Agent answers.

One episode, for turn = 1..max_turns:
    on the last turn the Answer Agent answers (`<answer>...</answer>`) and the episode ends;
    otherwise the Verifier reads the team context and says whether the information
    gathered is enough (`<verify>yes</verify>`): yes -> the Answer Agent answers, end;
    no -> the Search Agent writes `<search>query</search>`, the retriever's top-k
    passages join the team context as an `Info:` entry, and the next turn starts.
An action that does not parse (no verdict, no query) is a penalised step
(algorithm.invalid_action_penalty, applied by the broker from Step.valid); the episode
then continues (routed like "no") or ends unanswered, as workflow.on_invalid says.

Reward: exact match of the final answer against any gold answer after the usual QA
normalisation (drmas/tasks/qa.py). Episode metrics (averaged by the broker into
rollout/<name> and val/<name>): em, f1, answered, search_calls, turns, invalid_actions.

Retrieval goes through a BatchingRetriever (drmas/retrieval/batching.py): the searches of
every episode in flight on this actor that arrive together become one retriever call,
run in a worker thread so the engines keep generating meanwhile.
"""

from __future__ import annotations

from typing import Any, Protocol

from drmas.actors.config import WorkflowConfig
from drmas.actors.engines.base import Engine
from drmas.actors.workflows import search_prompts
from drmas.actors.workflows.base import TeamWorkflow
from drmas.actors.workflows.search_prompts import (
    AGENTS,
    ANSWERER,
    INFO,
    INSTRUCTIONS,
    SEARCHER,
    TINY_INSTRUCTIONS,
    VERIFIER,
    HasText,
    parse_answer,
    parse_search,
    parse_verdict,
    render_passages,
)
from drmas.protocol.messages import Episode, SamplingParams, Step, Task
from drmas.tasks.qa import exact_match, f1_score

DEFAULT_INSTRUCTIONS = {"plain": TINY_INSTRUCTIONS, "chat": INSTRUCTIONS}


class SearchBackend(Protocol):
    """What the workflow needs of a retriever: one query in, its top-k passages out
    (drmas.retrieval.batching.BatchingRetriever batches concurrent calls)."""

    async def search(self, query: str) -> list[Any]: ...

    def close(self) -> None: ...


class SearchWorkflow(TeamWorkflow):
    """Verifier -> Search Agent | Answer Agent episodes over per-model engines."""

    name = "search"
    agents = AGENTS
    default_instructions = DEFAULT_INSTRUCTIONS
    layout = search_prompts.LAYOUT

    def __init__(
        self,
        cfg: WorkflowConfig,
        agent_models: dict[str, str],
        engines: dict[str, Engine],
        tokenizers: dict[str, object],
        retriever: SearchBackend,
    ) -> None:
        if cfg.max_turns < 1:
            raise ValueError(f"workflow.max_turns must be >= 1, got {cfg.max_turns}")
        if cfg.on_invalid not in ("continue", "end"):
            raise ValueError(f"workflow.on_invalid must be continue or end, got {cfg.on_invalid!r}")
        super().__init__(cfg, agent_models, engines, tokenizers)
        self.retriever = retriever

    async def run_episode(self, task: Task, sampling: SamplingParams) -> Episode:
        turns: list[tuple[str, str]] = []
        steps: list[Step] = []
        answer: str | None = None
        searches = invalid = 0
        stop_on_invalid = self.cfg.on_invalid == "end"
        turn = 0
        for turn in range(1, self.cfg.max_turns + 1):
            if turn < self.cfg.max_turns:
                text, step = await self.call(VERIFIER, task, turns, sampling)
                verdict = parse_verdict(text)
                invalid += self._record(step, verdict is not None, steps, turns, text)
                if verdict is None and stop_on_invalid:
                    break
                if not verdict:
                    text, step = await self.call(SEARCHER, task, turns, sampling)
                    query = parse_search(text)
                    invalid += self._record(step, query is not None, steps, turns, text)
                    if query is None:
                        if stop_on_invalid:
                            break
                        continue
                    passages: list[HasText] = await self.retriever.search(query)
                    searches += 1
                    turns.append((INFO, render_passages(passages, self.cfg.prompt_style)))
                    continue
            text, step = await self.call(ANSWERER, task, turns, sampling)
            answer = parse_answer(text)
            invalid += self._record(step, answer is not None, steps, turns, text)
            break
        golds = task.answers or [task.answer]
        em = exact_match(answer, golds)
        metrics = {
            "em": em,
            "f1": f1_score(answer, golds),
            "answered": float(answer is not None),
            "search_calls": float(searches),
            "turns": float(turn),
            "invalid_actions": float(invalid),
        }
        return Episode(steps=steps, reward=em, metrics=metrics)

    @staticmethod
    def _record(
        step: Step, valid: bool, steps: list[Step], turns: list[tuple[str, str]], text: str
    ) -> int:
        """Keep the step and its text in the team context; 1 if the action was invalid."""
        step.valid = valid
        steps.append(step)
        turns.append((step.agent, text))
        return 0 if valid else 1

    async def close(self) -> None:
        self.retriever.close()
