"""Task generation, the training cursor and local task files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from drmas.config.task import TaskConfig
from drmas.protocol.messages import Task
from drmas.tasks.source import TaskFileError, TaskSource, load_file, normalise_answer
from drmas.teams.math import arithmetic

QUESTION = re.compile(r"\d+([+-]\d+)+")


def _eval(question: str) -> int:
    """Independent evaluator: split on the operators, add signed operands."""
    return sum(int(tok) for tok in re.findall(r"[+-]?\d+", question))


# ------------------------------------------------------------------ arithmetic
@pytest.mark.parametrize("num_ops", [1, 2, 3])
def test_arithmetic_format_and_answers(num_ops: int) -> None:
    train, val = arithmetic.generate(200, 20, max_operand=19, num_ops=num_ops, seed=3)
    assert len(train) == 200 and len(val) == 20
    for p in train + val:
        assert QUESTION.fullmatch(p.question), p.question
        assert " " not in p.question
        assert len(re.findall(r"[+-]", p.question)) == num_ops
        assert all(0 <= int(x) <= 19 for x in re.split(r"[+-]", p.question))
        assert p.answer == str(_eval(p.question))


def test_arithmetic_deterministic_and_seeded() -> None:
    a = arithmetic.generate(100, 10, 19, 1, seed=0)
    b = arithmetic.generate(100, 10, 19, 1, seed=0)
    c = arithmetic.generate(100, 10, 19, 1, seed=1)
    assert a == b
    assert a != c


def test_arithmetic_val_distinct_and_disjoint_from_train() -> None:
    # 20 * 20 * 2 = 800 distinct questions; a large val set makes collisions likely
    train, val = arithmetic.generate(4000, 400, 19, 1, seed=0)
    val_q = [p.question for p in val]
    assert len(set(val_q)) == len(val_q)
    assert not set(val_q) & {p.question for p in train}


def test_arithmetic_uses_both_operators_and_full_range() -> None:
    train, _ = arithmetic.generate(2000, 0, 9, 1, seed=0)
    qs = [p.question for p in train]
    assert any("+" in q for q in qs) and any("-" in q for q in qs)
    operands = {int(x) for q in qs for x in re.split(r"[+-]", q)}
    assert operands == set(range(10))


def test_arithmetic_refuses_impossible_sizes() -> None:
    # max_operand=1, one op: 2 * 2 * 2 = 8 questions
    with pytest.raises(ValueError, match="no training question"):
        arithmetic.generate(10, 8, 1, 1, seed=0)
    train, val = arithmetic.generate(10, 7, 1, 1, seed=0)
    assert len({p.question for p in val}) == 7 and len(train) == 10


@pytest.mark.parametrize("ops", ["+", "-"])
def test_arithmetic_with_one_operator_uses_only_it_and_counts_its_questions(ops: str) -> None:
    """task.ops="+" (or "-"): every question, held out or not, uses that operator only;
    the question space is (max_operand + 1)^(num_ops + 1), so 100 held-out questions of 0..9
    with one operator leave no training question, and 99 leave one."""
    train, val = arithmetic.generate(500, 60, 9, 2, seed=0, ops=ops)
    other = "-" if ops == "+" else "+"
    assert all(other not in p.question and p.answer == str(_eval(p.question)) for p in train + val)
    assert len({p.question for p in val}) == 60
    assert arithmetic.question_space(9, 1, ops) == 100
    with pytest.raises(ValueError, match="ops="):
        arithmetic.generate(10, 100, 9, 1, seed=0, ops=ops)
    train, val = arithmetic.generate(10, 99, 9, 1, seed=0, ops=ops)
    assert len({p.question for p in train}) == 1


def test_arithmetic_with_both_operators_draws_the_tasks_it_always_drew() -> None:
    """The default ("+-") keeps every earlier run's tasks: the first questions of seed 0
    (operands 0..19), written down before `task.ops` existed."""
    train, val = arithmetic.generate(3, 2, 19, 1, seed=0)
    assert [p.question for p in val] == ["7+18", "9+9"]
    assert arithmetic.generate(3, 2, 19, 1, seed=0, ops="+-") == (train, val)
    with pytest.raises(ValueError, match=r"task\.ops"):
        arithmetic.generate(3, 2, 19, 1, seed=0, ops="*")


# ----------------------------------------------------------------- task source
def _cfg(**kw: object) -> TaskConfig:
    base: dict[str, object] = {"num_train": 20, "num_val": 5, "seed": 7}
    base.update(kw)
    return TaskConfig(**base)  # type: ignore[arg-type]


def _take(source: TaskSource, n: int) -> list[str]:
    return [source.next_task().task_id for _ in range(n)]


def test_source_tasks_and_ids() -> None:
    source = TaskSource(_cfg())
    assert len(source.train) == 20 and len(source.val) == 5
    ids = [t.task_id for t in source.train + source.val]
    assert len(set(ids)) == len(ids)
    assert source.train[3].task_id == "arithmetic:train:3"
    assert source.val[0].task_id == "arithmetic:val:0"
    assert all(t.source == "arithmetic" for t in source.train)
    # stable across runs
    assert TaskSource(_cfg()).train == source.train


def test_epochs_cover_every_task_and_reshuffle() -> None:
    source = TaskSource(_cfg())
    epoch0, epoch1 = _take(source, 20), _take(source, 20)
    everything = sorted(t.task_id for t in source.train)
    assert sorted(epoch0) == everything and sorted(epoch1) == everything
    assert epoch0 != epoch1  # (seed, epoch) shuffles differ
    assert epoch0 != [t.task_id for t in source.train]  # shuffled, not file order
    assert source.epoch == 2
    # same seed -> same order; other seed -> other order
    assert _take(TaskSource(_cfg()), 20) == epoch0
    assert _take(TaskSource(_cfg(seed=8)), 20) != epoch0


def test_order_seed_changes_the_stream_but_not_the_tasks_or_the_held_out_split() -> None:
    base, reordered = TaskSource(_cfg()), TaskSource(_cfg(order_seed=3))
    assert reordered.val == base.val
    assert sorted(t.task_id for t in reordered.train) == sorted(t.task_id for t in base.train)
    assert _take(reordered, 20) != _take(base, 20)
    assert _take(TaskSource(_cfg(order_seed=7)), 20) == _take(TaskSource(_cfg()), 20)  # = seed
    with pytest.raises(ValueError, match="order seed"):
        TaskSource(_cfg()).load_state(TaskSource(_cfg(order_seed=3)).state())


def test_state_resume_is_exact() -> None:
    source = TaskSource(_cfg())
    _take(source, 27)  # into the second epoch
    state = json.loads(json.dumps(source.state()))  # survives a JSON checkpoint
    assert (state["epoch"], state["index"]) == (1, 7)
    expected = _take(source, 50)

    resumed = TaskSource(_cfg())
    resumed.load_state(state)
    assert _take(resumed, 50) == expected


def test_state_keeps_requeued_tasks() -> None:
    source = TaskSource(_cfg())
    first = [source.next_task() for _ in range(3)]
    source.requeue(first[1])
    state = source.state()
    resumed = TaskSource(_cfg())
    resumed.load_state(state)
    assert _take(resumed, 5) == _take(source, 5)
    assert resumed.state() == source.state()


def test_load_state_refuses_other_dataset() -> None:
    state = TaskSource(_cfg()).state()
    with pytest.raises(ValueError, match="training tasks"):
        TaskSource(_cfg(num_train=30)).load_state(state)
    with pytest.raises(ValueError, match="out of range"):
        TaskSource(_cfg()).load_state({**state, "index": 20})


def test_requeue_serves_front_first() -> None:
    source = TaskSource(_cfg())
    a, b, c = (source.next_task() for _ in range(3))
    upcoming = _take(TaskSource(_cfg()), 5)[3:]
    source.requeue(a)
    source.requeue(b)
    # most recently requeued first, then the cursor continues where it was
    assert [source.next_task() for _ in range(2)] == [b, a]
    assert _take(source, 2) == upcoming
    assert c.task_id not in upcoming


def test_val_tasks_first_n_stable() -> None:
    source = TaskSource(_cfg())
    _take(source, 13)
    assert source.val_tasks(3) == TaskSource(_cfg()).val[:3]
    assert source.val_tasks(100) == source.val
    assert source.val_tasks() == source.val


def test_unknown_source_name() -> None:
    with pytest.raises(ValueError, match="unknown task source"):
        TaskSource(_cfg(name="nope"))


# ------------------------------------------------------------------------ files
def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_loading_and_answer_normalisation(tmp_path: Path) -> None:
    train = _jsonl(
        tmp_path / "dapo.jsonl",
        [
            {"problem": "1+1?", "solution": 2},
            "",
            {"problem": "half?", "solution": 0.5},
            {"problem": "list?", "solution": ["\\frac{1}{2}", "0.5"]},
            {"problem": "str?", "solution": " 7 "},
            {"problem": "float int?", "solution": 3.0},
            {"problem": "tagged?", "solution": "x", "data_source": "aime"},
        ],
    )
    val = _jsonl(tmp_path / "math500.jsonl", [{"problem": "v?", "solution": "1"}])
    cfg = TaskConfig(
        name="jsonl",
        train_path=str(train),
        val_path=str(val),
        question_key="problem",
        answer_key="solution",
    )
    source = TaskSource(cfg)
    assert [t.answer for t in source.train] == ["2", "0.5", "\\frac{1}{2}", "7", "3", "x"]
    assert source.train[0] == Task("dapo:train:0", "1+1?", "2", "dapo")
    assert source.train[-1].source == "aime"
    assert source.val_tasks(1) == [Task("math500:val:0", "v?", "1", "math500")]


def test_jsonl_nested_key(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"q": "a", "reward_model": {"ground_truth": 4}}])
    (task,) = load_file(path, "train", "q", "reward_model.ground_truth")
    assert task.answer == "4"


def test_jsonl_errors_name_file_line_and_key(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": 1}, "", {"question": "b"}])
    with pytest.raises(
        TaskFileError, match=r"bad\.jsonl line 3: missing key 'answer'.*task\.answer_key"
    ):
        load_file(path, "train", "question", "answer")

    path = _jsonl(tmp_path / "bad2.jsonl", [{"question": "a", "answer": 1}, "{oops"])
    with pytest.raises(TaskFileError, match=r"bad2\.jsonl line 2: not valid JSON"):
        load_file(path, "train", "question", "answer")

    path = _jsonl(tmp_path / "bad3.jsonl", ["[1, 2]"])
    with pytest.raises(TaskFileError, match="line 1: expected a JSON object"):
        load_file(path, "train", "question", "answer")

    path = _jsonl(tmp_path / "bad4.jsonl", [{"question": "a", "answer": []}])
    with pytest.raises(TaskFileError, match="line 1: answer 'answer' must be"):
        load_file(path, "train", "question", "answer")

    path = _jsonl(tmp_path / "bad5.jsonl", [{"question": 3, "answer": "1"}])
    with pytest.raises(TaskFileError, match="line 1: question 'question' must be"):
        load_file(path, "train", "question", "answer")

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TaskFileError, match="holds no tasks"):
        load_file(empty, "train", "question", "answer")

    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        load_file(tmp_path / "missing.jsonl", "train", "question", "answer")

    with pytest.raises(ValueError, match="train_path"):
        TaskSource(TaskConfig(name="jsonl"))


def test_normalise_answer() -> None:
    assert normalise_answer(12) == "12"
    assert normalise_answer(-1.0) == "-1"
    assert normalise_answer(0.25) == "0.25"
    assert normalise_answer([5, 6]) == "5"
    assert normalise_answer([]) is None
    assert normalise_answer(True) is None
    assert normalise_answer(float("nan")) is None
    assert normalise_answer({"a": 1}) is None


def test_parquet_loading(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["1+2", "3-5"], "answer": [3, -2]}), path)
    tasks = load_file(path, "train", "question", "answer")
    assert [(t.task_id, t.question, t.answer) for t in tasks] == [
        ("train:train:0", "1+2", "3"),
        ("train:train:1", "3-5", "-2"),
    ]
    with pytest.raises(TaskFileError, match=r"train\.parquet: no column 'solution'"):
        load_file(path, "train", "question", "solution")


def test_parquet_without_pyarrow_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_file(path, "train", "question", "answer")
