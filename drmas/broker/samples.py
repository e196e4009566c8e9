"""Transcripts: whole episodes of training groups, as text, in RUN_DIR/samples.jsonl.

Written by the broker (the process that already writes metrics.jsonl) from accepted
groups: every `run.samples_every` steps, the first group accepted at that step gives its
first `run.samples_episodes` episodes. Each record holds, per episode, the team reward
and every step in order: the agent, its model, the weight version that generated it, the
prompt and response text (decoded with the model's tokenizer), whether its action
parsed, its reward (its own Step.reward, else the team reward: drmas/broker/scores.py),
its score and its advantage. Advantages are the group's own (scope=group), as
the learners get them; with algorithm.advantage.scope=batch the learners' differ, and
the record says which scope it used. `drmas show RUN_DIR` prints the latest records.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from drmas.broker.advantages import compute_advantages
from drmas.broker.scores import step_scores
from drmas.config.broker import AdvantageConfig
from drmas.protocol.arrays import unpack_ids
from drmas.protocol.messages import GroupResult, Task

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

log = logging.getLogger("drmas.broker")

MAX_CHARS = 4000
"""A prompt or response longer than this is cut (the record says so)."""


def load_tokenizers(model_paths: dict[str, str]) -> dict[str, Any]:
    """Each model's tokenizer from its checkpoint folder; a model without one is left out
    (its steps are written as token ids)."""
    out = {}
    for model, path in model_paths.items():
        try:
            out[model] = _fast_decoder(Path(path)) or _transformers_tokenizer(path)
        except Exception as exc:  # a tokenizer is a convenience here, never a failure
            log.warning("samples: no tokenizer for %s at %s (%s): token ids only", model, path, exc)
    return out


class _PlainDecoder:
    """The folder's tokenizer.json through the `tokenizers` library alone: the same text
    as transformers' decode where no clean-up is configured, without importing transformers
    and torch into the broker (seconds of CPU at every start)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _fast_decoder(folder: Path) -> _PlainDecoder | None:
    """The plain decoder where it decodes exactly as transformers would: a tokenizer.json,
    and no `clean_up_tokenization_spaces` (a transformers-side rewrite of the text)."""
    config_path = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    if config.get("clean_up_tokenization_spaces", False):
        return None
    return _PlainDecoder(folder / "tokenizer.json")


def _transformers_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class SampleWriter:
    """Tokenizers load in a thread started with the writer (importing transformers takes
    seconds, which the broker loop must not stall for); a group sampled before they are
    ready waits in `pending` and is written by `flush`, which the loop calls regularly."""

    @classmethod
    def for_run(cls, cfg: DrmasConfig, run_dir: Path | None) -> SampleWriter | None:
        """The run's writer, or None when it keeps no samples (run.samples_every=0)."""
        if run_dir is None or cfg.run.samples_every <= 0:
            return None
        return cls(
            run_dir / "samples.jsonl",
            {m: c.path for m, c in cfg.models.items()},
            cfg.run.samples_every,
            cfg.run.samples_episodes,
            cfg.algorithm.advantage,
            cfg.algorithm.invalid_action_penalty,
            cfg.workflow.reward_scale,
        )

    def __init__(
        self,
        path: Path,
        model_paths: dict[str, str],
        every: int,
        episodes: int,
        advantage: AdvantageConfig,
        penalty: float,
        scale: Mapping[str, float] | None = None,
    ) -> None:
        self.path = path
        self.scale = scale or {}  # workflow.reward_scale
        self.tokenizers: dict[str, Any] = {}
        self.every = every
        self.episodes = episodes
        self.advantage = advantage
        self.penalty = penalty
        self.written: set[int] = set()  # steps already sampled
        self.pending: list[tuple[int, Task, GroupResult]] = []
        self.ready = threading.Event()
        threading.Thread(
            target=self._load, args=(model_paths,), name="samples-tokenizers", daemon=True
        ).start()

    def _load(self, model_paths: dict[str, str]) -> None:
        self.tokenizers = load_tokenizers(model_paths)
        self.ready.set()

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0 and step not in self.written

    def add(self, step: int, task: Task, result: GroupResult) -> None:
        """Sample this group for `step` (written now, or by `flush` once tokenizers load)."""
        self.written.add(step)
        self.pending.append((step, task, result))

    def flush(self) -> list[dict[str, Any]]:
        """Write the pending groups if the tokenizers are ready; returns the records."""
        if not self.pending or not self.ready.is_set():
            return []
        records = [self.record(step, task, result) for step, task, result in self.pending]
        self.pending.clear()
        with self.path.open("a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        return records

    def record(self, step: int, task: Task, result: GroupResult) -> dict[str, Any]:
        headers = [(e, h) for e, ep in enumerate(result.episodes) for h in ep.steps]
        rewards, scores = step_scores(result.episodes, self.penalty, self.scale)
        advantages = compute_advantages(
            np.asarray(scores, dtype=np.float64),
            np.zeros(len(headers), dtype=np.int64),
            np.asarray([e for e, _ in headers], dtype=np.int64),
            [h.agent for _, h in headers],
            mode=self.advantage.mode,
            norm_by_std=self.advantage.norm_by_std,
            eps=self.advantage.eps,
            std=self.advantage.std,
            scope="group",
            std_floor=self.advantage.std_floor,
        )
        prompts, responses = unpack_ids(result.prompt_ids), unpack_ids(result.response_ids)
        episodes: list[dict[str, Any]] = []
        p = r = 0
        for i, (e, h) in enumerate(headers):
            prompt = prompts[p : p + h.prompt_len]
            response = responses[r : r + h.response_len]
            p, r = p + h.prompt_len, r + h.response_len
            if e >= self.episodes:
                continue
            if len(episodes) <= e:
                episodes.append({"reward": result.episodes[e].reward, "steps": []})
            episodes[e]["steps"].append({
                "agent": h.agent, "model": h.model, "version": h.version, "valid": h.valid,
                "finish_reason": h.finish_reason, "reward": rewards[i], "score": scores[i],
                "advantage": float(advantages[i]),
                "prompt": self._text(h.model, prompt), "response": self._text(h.model, response),
            })  # fmt: skip
        return {
            "step": step,
            "time_s": time.time(),
            "task_id": task.task_id,
            "question": task.question,
            "answer": task.answer,
            "advantage_mode": self.advantage.mode,
            "advantage_scope": "group",
            "group_episodes": len(result.episodes),
            "episodes": episodes,
        }

    def _text(self, model: str, ids: np.ndarray) -> str | list[int]:
        tokenizer = self.tokenizers.get(model)
        if tokenizer is None:
            return [int(i) for i in ids]
        text = tokenizer.decode([int(i) for i in ids])
        if len(text) > MAX_CHARS:
            return f"{text[:MAX_CHARS]}... [{len(text) - MAX_CHARS} more characters]"
        return text


def transcript_markdown(rec: dict[str, Any]) -> str:
    """One record as markdown (the trackers' text tables)."""
    import io

    buf = io.StringIO()
    _print_record(rec, buf)
    return "```\n" + buf.getvalue() + "```"


def show(run_dir: Path, last: int = 1, out: Any = None) -> int:
    """Print the latest `last` records of RUN_DIR/samples.jsonl readably."""
    import sys

    out = out or sys.stdout
    path = Path(run_dir) / "samples.jsonl"
    if not path.is_file():
        print(
            f"drmas show: {path} does not exist (run.samples_every=0, or no step sampled yet)",
            file=sys.stderr,
        )
        return 2
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for rec in records[-last:]:
        _print_record(rec, out)
    return 0


def _print_record(rec: dict[str, Any], out: Any) -> None:
    print(f"=== step {rec['step']} · task {rec['task_id']} · {rec['advantage_mode']} advantages",
          file=out)  # fmt: skip
    print(f"question: {rec['question']}\ngold answer: {rec['answer']}", file=out)
    for e, ep in enumerate(rec["episodes"]):
        print(f"\n--- episode {e} · team reward {ep['reward']:.2f}", file=out)
        for st in ep["steps"]:
            flag = "" if st["valid"] else " · INVALID"
            reward = st.get("reward", ep["reward"])  # records before per-step rewards: the team's
            print(f"[{st['agent']} · {st['model']} v{st['version']} · reward {reward:.2f}"
                  f" · score {st['score']:.2f} · advantage {st['advantage']:+.2f}{flag}]",
                  file=out)  # fmt: skip
            print(f"  {_last_line(st['prompt'])}", file=out)
            print(f"  → {str(st['response']).strip()}", file=out)
    print(file=out)


def _last_line(prompt: object) -> str:
    """The end of a prompt (the part the agent answers), not the whole transcript."""
    text = str(prompt).rstrip()
    tail = text[-300:]
    return ("..." if len(text) > 300 else "") + tail.replace("\n", "\n  ")
