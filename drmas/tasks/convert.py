"""`drmas data math|search`: files the user downloaded -> drmas task files (JSONL).

    downloaded .parquet/.jsonl/.json (public datasets' shapes) ── convert ──> OUT.jsonl
    OUT.jsonl ── task.train_path / task.val_path ──> drmas/tasks/source.py

Math rows become {"question", "answer", "data_source"}; search rows {"question",
"golden_answers", "data_source"}. The shapes recognised (the first key found wins):
- question: `problem`, `question`, `Problem`, or `prompt` (a string or a chat message
  list, whose last user message is taken);
- math answer: `answer`, `reward_model.ground_truth`, `final_answer`, `Answer`, else the
  last \\boxed{} of `solution`;
- search answers: `golden_answers`, `answers`, `reward_model.ground_truth.target`,
  `reward_model.ground_truth`, `answer` (a string or a list);
- data source: the row's `data_source` / `source`, else --source, else the file's stem.
Prompt wrappers that ask for another answer format (DAPO-Math's "Answer: $Answer" lines)
are stripped, since the drmas workflows give their own instructions. A row without a
question or answer is an error naming the file and row, unless --skip-bad, which counts
it instead.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from drmas.tasks.source import normalise_answer

KINDS = ("math", "search")
_QUESTION_KEYS = ("problem", "question", "Problem", "prompt")
_MATH_ANSWER_KEYS = ("answer", "reward_model.ground_truth", "final_answer", "Answer")
_SEARCH_ANSWER_KEYS = (
    "golden_answers",
    "answers",
    "reward_model.ground_truth.target",
    "reward_model.ground_truth",
    "answer",
)
# Instructions some datasets wrap around the problem, in favour of another answer format.
_WRAPPERS = (
    re.compile(r"^Solve the following math problem step by step\..*?\n\s*\n", re.S),
    re.compile(r"\n\s*\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$"),
    re.compile(
        r"\s*Let's think step by step and output the final answer within \\boxed\{\}\.?\s*$"
    ),
)
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}")


class ConvertError(ValueError):
    """A file or row that cannot become a task; the message names it."""


def convert(
    kind: str, inputs: list[Path], out: Path, source: str = "", skip_bad: bool = False
) -> Counter[str]:
    """Write the tasks of every input to `out` (JSONL, written to a temporary file and
    renamed); returns rows written per data source (and "skipped")."""
    if kind not in KINDS:
        raise ConvertError(f"unknown kind {kind!r}: use one of {list(KINDS)}")
    counts: Counter[str] = Counter()
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("w") as f:
        for path in inputs:
            for where, row in rows_of(path):
                try:
                    task = convert_row(kind, row, source or path.stem)
                except ConvertError as exc:
                    if not skip_bad:
                        tmp.unlink(missing_ok=True)
                        raise ConvertError(
                            f"{path} {where}: {exc} (--skip-bad skips such rows)"
                        ) from None
                    counts["skipped"] += 1
                    continue
                f.write(json.dumps(task, ensure_ascii=False) + "\n")
                counts[task["data_source"]] += 1
    if not sum(n for k, n in counts.items() if k != "skipped"):
        tmp.unlink(missing_ok=True)
        raise ConvertError(f"no tasks in {', '.join(map(str, inputs))}")
    tmp.replace(out)
    return counts


def convert_row(kind: str, row: dict[str, Any], default_source: str) -> dict[str, Any]:
    question = _question(row)
    data_source = row.get("data_source") or row.get("source") or default_source
    if not isinstance(data_source, str):
        data_source = default_source
    if kind == "math":
        return {"question": question, "answer": _math_answer(row), "data_source": data_source}
    return {
        "question": question,
        "golden_answers": _search_answers(row),
        "data_source": data_source,
    }


def rows_of(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if not path.is_file():
        raise ConvertError(f"{path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"row {i}", row
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict):  # {"data": [...]} or {"rows": [...]}
            data = next((v for v in data.values() if isinstance(v, list)), [])
        for i, row in enumerate(data):
            yield f"item {i}", row
    elif path.suffix == ".jsonl":
        with path.open() as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"line {i}", json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ConvertError(f"{path} line {i}: not JSON ({exc.msg})") from None
    else:
        raise ConvertError(f"{path}: expected .parquet, .jsonl or .json")


def _get(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _question(row: dict[str, Any]) -> str:
    for key in _QUESTION_KEYS:
        value = _get(row, key)
        if isinstance(value, list):  # chat messages: the last user turn
            users = [
                m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"
            ]
            value = users[-1] if users else None
        if isinstance(value, str) and value.strip():
            text = value.strip()
            for wrapper in _WRAPPERS:
                text = wrapper.sub("", text).strip()
            return text
    raise ConvertError(f"no question (looked for {', '.join(_QUESTION_KEYS)})")


def _math_answer(row: dict[str, Any]) -> str:
    for key in _MATH_ANSWER_KEYS:
        answer = normalise_answer(_get(row, key))
        if answer:
            return answer
    solution = row.get("solution")
    if isinstance(solution, str):
        boxed = _BOXED.findall(solution)
        if boxed and boxed[-1].strip():
            return boxed[-1].strip()
    raise ConvertError(
        f"no answer (looked for {', '.join(_MATH_ANSWER_KEYS)} and a \\boxed{{}} in solution)"
    )


def _search_answers(row: dict[str, Any]) -> list[str]:
    for key in _SEARCH_ANSWER_KEYS:
        value = _get(row, key)
        if hasattr(value, "tolist"):  # numpy arrays from some parquet readers
            value = value.tolist()
        values = value if isinstance(value, list) else [value]
        answers = [a for a in (normalise_answer(v) for v in values) if a]
        if answers:
            return answers
    raise ConvertError(f"no answers (looked for {', '.join(_SEARCH_ANSWER_KEYS)})")
