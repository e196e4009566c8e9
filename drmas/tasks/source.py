"""The broker's task source: a training cursor over shuffled epochs plus a held-out set.

Training tasks are served epoch by epoch; epoch e visits every training task once in an
order that is a pure function of (seed, e), so the cursor `(epoch, index)` is all a broker
needs to save to resume exactly after a restart. Tasks handed back (a dead actor's lease,
a group dropped as stale) go to the front and are served before the cursor moves on.

Where tasks come from (`task.name`): a built-in source (arithmetic, kb: the math and search
teams' synthetic tasks), local files (jsonl, parquet: `load_file`), or your own function
`(TaskConfig) -> (train, val)` given as a target (package.module:fn, path/to/file.py:fn)
whose items are Tasks or mappings with a question and an answer (or answers) and
optionally an id and a source.

Task ids are `{name}:{split}:{i}` (name = `arithmetic`, `kb`, the file's stem or the
function's name; i = position among the records), stable across runs and unique across
the train and validation splits. A task with several gold answers (QA data: NQ's
`golden_answers` list, the synthetic knowledge base's aliases) carries them all in
`Task.answers`; `Task.answer` is the first.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from drmas.config.task import TaskConfig
from drmas.plugins import load_object
from drmas.protocol.messages import Task

FILE_KINDS = ("jsonl", "parquet")
BUILTIN_SOURCES = {
    "arithmetic": "drmas.teams.math.arithmetic:task_source",
    "kb": "drmas.teams.search.kb:task_source",
}
"""task.name -> the function that builds it (loaded the way your own source is)."""


class TaskFileError(ValueError):
    """A task file cannot be used; the message names the file, the line/row and the key."""


class TaskSource:
    """Serves training tasks in shuffled epochs and a stable held-out list."""

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self.train, self.val = _build(cfg)
        if not self.train:
            raise ValueError(f"task source {cfg.name!r} has no training tasks")
        self._by_id = {task.task_id: task for task in (*self.train, *self.val)}
        if len(self._by_id) != len(self.train) + len(self.val):
            raise ValueError(f"task source {cfg.name!r}: a task id is in both train and val")
        self._epoch = 0
        self._index = 0
        self._order = self._epoch_order(0)
        self._requeued: deque[Task] = deque()

    # ------------------------------------------------------------------ training
    def next_task(self) -> Task:
        """The next training task: a requeued one if any, else the cursor's."""
        if self._requeued:
            return self._requeued.popleft()
        task = self.train[self._order[self._index]]
        self._index += 1
        if self._index == len(self.train):
            self._epoch += 1
            self._index = 0
            self._order = self._epoch_order(self._epoch)
        return task

    def requeue(self, task: Task) -> None:
        """Put `task` at the front: it is the next one `next_task` returns (the most
        recently requeued task comes first)."""
        self._requeued.appendleft(task)

    @property
    def epoch(self) -> int:
        """Completed passes over the training set."""
        return self._epoch

    def state(self) -> dict[str, Any]:
        """JSON-able cursor; `load_state` on a source built from the same config resumes
        exactly (requeued tasks included)."""
        return {
            "epoch": self._epoch,
            "index": self._index,
            "requeued": [task.task_id for task in self._requeued],
            "num_train": len(self.train),
            "seed": self.cfg.seed,
            "order_seed": self._order_seed,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        num_train = state.get("num_train", len(self.train))
        seeds = (state.get("seed", self.cfg.seed), state.get("order_seed", self._order_seed))
        if num_train != len(self.train) or seeds != (self.cfg.seed, self._order_seed):
            raise ValueError(
                f"task source state is for {num_train} training tasks with (seed, order seed) "
                f"{seeds}, this source has {len(self.train)} with "
                f"{(self.cfg.seed, self._order_seed)}: resume with the run's task settings"
            )
        if epoch < 0 or not (0 <= index < len(self.train)):
            raise ValueError(f"task source state out of range: epoch {epoch}, index {index}")
        unknown = [tid for tid in state.get("requeued", []) if tid not in self._by_id]
        if unknown:
            raise ValueError(f"task source state requeues unknown task ids {unknown[:5]}")
        self._epoch, self._index = epoch, index
        self._order = self._epoch_order(epoch)
        self._requeued = deque(self._by_id[tid] for tid in state.get("requeued", []))

    @property
    def _order_seed(self) -> int:
        return self.cfg.seed if self.cfg.order_seed is None else self.cfg.order_seed

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train)))
        random.Random(f"drmas.tasks:{self._order_seed}:{epoch}").shuffle(order)
        return order

    # ---------------------------------------------------------------- evaluation
    def val_tasks(self, n: int | None = None) -> list[Task]:
        """The first `n` held-out tasks (all when n is None or larger than the set)."""
        return list(self.val if n is None else self.val[:n])


# ---------------------------------------------------------------------- building
def _build(cfg: TaskConfig) -> tuple[list[Task], list[Task]]:
    if cfg.name in FILE_KINDS:
        if not cfg.train_path:
            raise ValueError(f"task.name={cfg.name} needs task.train_path")
        keys = (cfg.question_key, cfg.answer_key, cfg.name)
        train_tasks = load_file(cfg.train_path, "train", *keys)
        val_tasks = load_file(cfg.val_path, "val", *keys) if cfg.val_path else []
        return train_tasks, val_tasks
    target = BUILTIN_SOURCES.get(cfg.name, cfg.name)
    if ":" not in target:
        raise ValueError(
            f"unknown task source {cfg.name!r}; choose "
            f"{', '.join([*BUILTIN_SOURCES, *FILE_KINDS])} or give your own as "
            "package.module:fn or path/to/file.py:fn"
        )
    make = load_object(target, "task.name")
    if not callable(make):
        raise TypeError(f"task.name={cfg.name!r} is not a function (TaskConfig) -> (train, val)")
    built = make(cfg)
    if not (isinstance(built, tuple) and len(built) == 2):
        raise TaskFileError(
            f"task source {cfg.name!r} returned {type(built).__name__}; return (train, val): "
            "two lists of Tasks or of mappings with question and answer"
        )
    prefix = getattr(make, "__name__", "tasks")
    return _as_tasks(built[0], prefix, "train", cfg.name), _as_tasks(
        built[1], prefix, "val", cfg.name
    )


def _as_tasks(items: Any, prefix: str, split: str, name: str) -> list[Task]:
    """A task function's items as Tasks (mappings: question, answer or answers, and
    optionally id and source)."""
    tasks = []
    for i, item in enumerate(items):
        if isinstance(item, Task):
            tasks.append(item)
            continue
        if not isinstance(item, Mapping) or "question" not in item:
            raise TaskFileError(
                f"task source {name!r}, {split} item {i}: expected a Task or a mapping with "
                f"question and answer, got {item!r:.80}"
            )
        raw = item.get("answers", item.get("answer"))
        answers = all_answers(raw)
        question = item["question"]
        if not isinstance(question, str) or not question.strip() or not answers:
            raise TaskFileError(
                f"task source {name!r}, {split} item {i}: needs a non-empty question and "
                f"answer, got {item!r:.80}"
            )
        source = item.get("source") or prefix
        task_id = str(item.get("id") or f"{prefix}:{split}:{i}")
        tasks.append(
            Task(task_id, question, answers[0], str(source), answers if len(answers) > 1 else [])
        )
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise TaskFileError(f"task source {name!r}: {split} task ids are not unique")
    return tasks


def load_file(
    path: str | Path, split: str, question_key: str, answer_key: str, default_kind: str = "jsonl"
) -> list[Task]:
    """Tasks of a local .jsonl or .parquet file (the suffix decides; else `default_kind`).

    Keys may be dotted paths into nested records (`reward_model.ground_truth`). A row's
    `data_source` (or `source`) string, when present, becomes the task's source (used to
    label validation metrics); otherwise the file's stem is."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    kind = {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix, default_kind)
    rows = _jsonl_rows(path) if kind == "jsonl" else _parquet_rows(path, question_key, answer_key)
    tasks = []
    for i, (where, row) in enumerate(rows):
        question = _lookup(row, question_key, path, where, "task.question_key")
        if not isinstance(question, str) or not question.strip():
            raise TaskFileError(
                f"{path} {where}: question {question_key!r} must be a non-empty string"
            )
        raw_answer = _lookup(row, answer_key, path, where, "task.answer_key")
        answer = normalise_answer(raw_answer)
        answers = all_answers(raw_answer)
        if not answer:
            raise TaskFileError(
                f"{path} {where}: answer {answer_key!r} must be a non-empty string, a number "
                f"or a non-empty list of them, got {raw_answer!r:.80}"
            )
        source = row.get("data_source", row.get("source"))
        if not isinstance(source, str) or not source:
            source = path.stem
        tasks.append(
            Task(
                f"{path.stem}:{split}:{i}",
                question,
                answer,
                source,
                answers if len(answers) > 1 else [],
            )
        )
    if not tasks:
        raise TaskFileError(f"task file {path} holds no tasks")
    return tasks


def normalise_answer(value: object) -> str | None:
    """Gold answer as a string: numbers printed exactly (3.0 -> "3"), a list becomes its
    first element (math datasets list equivalent forms); None for anything else."""
    if isinstance(value, (list, tuple)):
        return normalise_answer(value[0]) if value else None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return value.strip()
    # numpy scalars and arrays from parquet
    if hasattr(value, "tolist"):
        return normalise_answer(value.tolist())
    return None


def all_answers(value: object) -> list[str]:
    """Every gold answer of a list-valued answer (QA data lists aliases), each as
    `normalise_answer` prints it; empty or unusable entries are skipped."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    items = value if isinstance(value, (list, tuple)) else [value]
    return [a for item in items if (a := normalise_answer(item))]


def _lookup(row: Mapping[str, Any], key: str, path: Path, where: str, option: str) -> Any:
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise TaskFileError(
                f"{path} {where}: missing key {key!r} (keys: {sorted(row)}); set {option}"
            )
        node = node[part]
    return node


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TaskFileError(
                    f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}"
                )
            yield f"line {lineno}", row


def _parquet_rows(
    path: Path, question_key: str, answer_key: str
) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            f"reading the parquet task file {path} needs pyarrow: pip install pyarrow"
        ) from exc
    table = pq.read_table(path)
    for key in (question_key, answer_key):
        if key.split(".")[0] not in table.column_names:
            raise TaskFileError(f"{path}: no column {key!r} (columns: {table.column_names})")
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row
