"""The search team: Verifier routes, Search Agent calls the `search` tool, Answer Agent
answers.

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
normalisation (drmas/teams/search/qa.py; `score`, which `workflow.reward` may replace).
That is the episode's (team) reward: with `workflow.rewards=team` (the default) every step
is scored with it, and it is always what validation counts as solved. Episode metrics
(averaged by the broker into rollout/<name> and val/<name>): em, f1, answered,
search_calls, turns, invalid_actions.

Role rewards (`workflow.rewards=role`): each step carries its own `Step.reward`, and the
broker scores the step with it (minus algorithm.invalid_action_penalty when the step is
invalid). "Holds the answer" means a gold answer occurs, as whole normalised words, in
the text (`contains_answer`, qa.py):
    Search Agent    1.0 if the passages its own query retrieved hold the answer, else 0.0
                    (a first hop that finds only the bridge entity earns 0; a reply
                    without a query earns 0);
    Answer Agent    exact match of its answer (the team reward of its episode);
    Verifier        1.0 for a right verdict: yes if the passages retrieved so far in the
                    episode (before this verdict) hold the answer, no if they do not;
                    0.0 for a wrong verdict and for a reply without one. This is what the
                    episode knows; whether the Answer Agent then copies the answer is the
                    Answer Agent's job and is paid to it.
These use the team's own grading, so role rewards and `workflow.reward` exclude each other
(check_settings refuses both).

The `search` tool is the retriever (`RetrieverTool`): a BatchingRetriever
(drmas/retrieval/batching.py) turns the searches of every episode in flight on this actor
that arrive together into one retriever call, run in a worker thread so the engines keep
generating meanwhile. `workflow.tools.search=pkg.mod:fn` replaces it with any async
function of the query.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from drmas.config.actor import WorkflowConfig
from drmas.protocol.messages import Episode, SamplingParams, Step, Task
from drmas.teams.base import Team, Tool
from drmas.teams.search import prompts as search_prompts
from drmas.teams.search.kb import search_corpus
from drmas.teams.search.prompts import (
    AGENTS,
    ANSWERER,
    INFO,
    INSTRUCTIONS,
    SEARCH_TOOL,
    SEARCHER,
    TINY_INSTRUCTIONS,
    VERIFIER,
    HasText,
    parse_answer,
    parse_search,
    parse_verdict,
    render_passages,
)
from drmas.teams.search.qa import contains_answer, exact_match, f1_score

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

DEFAULT_INSTRUCTIONS = {"plain": TINY_INSTRUCTIONS, "chat": INSTRUCTIONS}


class SearchBackend(Protocol):
    """What the retriever tool needs of a retriever: one query in, its top-k passages out
    (drmas.retrieval.batching.BatchingRetriever batches concurrent calls)."""

    async def search(self, query: str) -> Sequence[Any]: ...

    def close(self) -> None: ...


class RetrieverTool:
    """The retriever as a tool: the query's passages rendered for the prompt style."""

    def __init__(self, backend: SearchBackend, style: str) -> None:
        self.backend = backend
        self.style = style

    async def __call__(self, query: str) -> str:
        passages: list[HasText] = list(await self.backend.search(query))
        return render_passages(passages, self.style)

    def close(self) -> None:
        self.backend.close()


class SearchTeam(Team):
    """Verifier -> Search Agent | Answer Agent episodes over per-model engines."""

    name = "search"
    agents = AGENTS
    default_instructions = DEFAULT_INSTRUCTIONS
    layout = search_prompts.LAYOUT
    result_keys: ClassVar[Mapping[str, str]] = {SEARCH_TOOL: INFO}

    @classmethod
    def check_settings(cls, cfg: WorkflowConfig) -> None:
        if cfg.max_turns < 1:
            raise ValueError(f"workflow.max_turns must be >= 1, got {cfg.max_turns}")
        if cfg.on_invalid not in ("continue", "end"):
            raise ValueError(f"workflow.on_invalid must be continue or end, got {cfg.on_invalid!r}")
        if cfg.rewards == "role" and cfg.reward:
            raise ValueError(
                f"workflow.rewards=role pays the search team's agents by its own grading, so "
                f"workflow.reward={cfg.reward!r} would not train anything: unset "
                "workflow.reward, or keep workflow.rewards=team to train with it"
            )

    def check_tools(self) -> None:
        if SEARCH_TOOL not in self.tool_fns:
            raise ValueError(
                f"the search team needs a {SEARCH_TOOL!r} tool (the retriever), got "
                f"{sorted(self.tool_fns)}"
            )

    # ------------------------------------------------------------ construction
    @classmethod
    def make_tools(cls, cfg: DrmasConfig) -> dict[str, Tool]:
        """The retriever (a local bm25/dense index, loaded from the cache `drmas train`
        built, or an HTTP server) as the `search` tool, unless `workflow.tools` gives one."""
        tools = super().make_tools(cfg)
        if SEARCH_TOOL not in tools:
            from drmas.retrieval import build_retriever
            from drmas.retrieval.batching import BatchingRetriever

            r = cfg.retriever
            corpus = search_corpus(r, cfg.task, cfg.run.cache_dir or None)
            backend = BatchingRetriever(
                build_retriever(r, corpus),
                top_k=r.top_k,
                max_batch=r.max_batch,
                timeout_s=r.timeout_s,
            )
            tools[SEARCH_TOOL] = RetrieverTool(backend, cfg.workflow.prompt_style)
        return tools

    @classmethod
    def check_config(cls, cfg: DrmasConfig) -> None:
        """Somewhere to search: a corpus (bm25/dense), a server (http) or a `search` tool."""
        from drmas.config import ConfigError

        w = cfg.workflow
        try:
            cls.check_settings(w)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if SEARCH_TOOL in w.tools:
            return
        r = cfg.retriever
        if r.timeout_s <= 0:
            raise ConfigError(f"retriever.timeout_s must be > 0, got {r.timeout_s}")
        if r.name == "http" and not r.url:
            raise ConfigError(
                "retriever.name=http needs retriever.url (e.g. http://127.0.0.1:8000)"
            )
        if r.name != "http" and not r.corpus_path and cfg.task.name != "kb":
            raise ConfigError(
                f"retriever.name={r.name} needs retriever.corpus_path (a JSONL of id, title, "
                "text) unless task.name=kb, whose generated corpus is used"
            )

    @classmethod
    def prepare(cls, cfg: DrmasConfig) -> DrmasConfig:
        """A local index: fix the corpus path (generating the synthetic one for task.name=kb)
        and build the index once here, so actors load it from the cache instead of each
        building it."""
        if cfg.retriever.name == "http" or SEARCH_TOOL in cfg.workflow.tools:
            return cfg
        from drmas.retrieval import build_retriever

        corpus = search_corpus(cfg.retriever, cfg.task, cfg.run.cache_dir or None)
        assert corpus is not None  # only http has no corpus
        build_retriever(cfg.retriever, corpus).close()
        retriever = dataclasses.replace(cfg.retriever, corpus_path=str(Path(corpus).resolve()))
        return dataclasses.replace(cfg, retriever=retriever)

    # ----------------------------------------------------------------- episodes
    async def run_episode(self, task: Task, sampling: SamplingParams) -> Episode:
        turns: list[tuple[str, str]] = []
        steps: list[Step] = []
        answer: str | None = None
        searches = invalid = 0
        stop_on_invalid = self.cfg.on_invalid == "end"
        golds = task.answers or [task.answer]
        role = self.cfg.rewards == "role"
        retrieved = False  # a passage retrieved so far in this episode holds the answer
        turn = 0
        for turn in range(1, self.cfg.max_turns + 1):
            if turn < self.cfg.max_turns:
                text, step = await self.call(VERIFIER, task, turns, sampling)
                verdict = parse_verdict(text)
                invalid += self._record(step, verdict is not None, steps, turns, text)
                if role:
                    step.reward = 1.0 if verdict is not None and verdict == retrieved else 0.0
                if verdict is None and stop_on_invalid:
                    break
                if not verdict:
                    search = await self.tool_step(SEARCHER, task, turns, sampling, _search_call)
                    steps.append(search.step)
                    hit = role and search.tool is not None and contains_answer(search.result, golds)
                    retrieved = retrieved or hit
                    if role:
                        search.step.reward = 1.0 if hit else 0.0
                    if search.tool is None:
                        invalid += 1
                        if stop_on_invalid:
                            break
                        continue
                    searches += 1
                    continue
            text, step = await self.call(ANSWERER, task, turns, sampling)
            answer = parse_answer(text)
            invalid += self._record(step, answer is not None, steps, turns, text)
            if role:
                step.reward = exact_match(answer, golds)
            break
        metrics = {
            "em": exact_match(answer, golds),
            "f1": f1_score(answer, golds),
            "answered": float(answer is not None),
            "search_calls": float(searches),
            "turns": float(turn),
            "invalid_actions": float(invalid),
        }
        return Episode(steps=steps, reward=self.reward(task, answer), metrics=metrics)

    def score(self, task: Task, answer: str | None) -> float:
        return exact_match(answer, task.answers or [task.answer])

    @staticmethod
    def _record(
        step: Step, valid: bool, steps: list[Step], turns: list[tuple[str, str]], text: str
    ) -> int:
        """Keep the step and its text in the team context; 1 if the action was invalid."""
        step.valid = valid
        steps.append(step)
        turns.append((step.agent, text))
        return 0 if valid else 1


def _search_call(text: str) -> tuple[str, str] | None:
    query = parse_search(text)
    return None if query is None else (SEARCH_TOOL, query)
