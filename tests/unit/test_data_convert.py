"""`drmas data math|search`: public datasets' shapes -> task files drmas loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from drmas.tasks.convert import ConvertError, convert
from drmas.tasks.source import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def to_parquet(src: Path, dst: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(read(src)), dst)
    return dst


def test_math_sources_become_tasks_with_their_sources(tmp_path: Path) -> None:
    dapo = to_parquet(FIXTURES / "dapo_math.jsonl", tmp_path / "dapo-math-17k.parquet")
    out = tmp_path / "math.jsonl"
    counts = convert("math", [dapo, FIXTURES / "math500.jsonl", FIXTURES / "aime24.jsonl"], out)
    assert counts == {"math_dapo": 2, "math500": 2, "aime24": 1}
    rows = read(out)
    assert rows[0] == {
        "question": "What is $3 \\cdot 7$?",
        "answer": "21",
        "data_source": "math_dapo",
    }
    assert rows[3]["answer"] == "\\frac{3}{4}"
    assert rows[4] == {  # no answer column: the last \boxed{} of the solution
        "question": "Find the remainder when $2^{10}$ is divided by $7$.",
        "answer": "2",
        "data_source": "aime24",
    }
    tasks = load_file(out, "val", "question", "answer")  # what task.val_path reads
    assert [t.source for t in tasks] == ["math_dapo"] * 2 + ["math500"] * 2 + ["aime24"]


def test_search_sources_keep_every_gold_answer(tmp_path: Path) -> None:
    hotpot = to_parquet(FIXTURES / "searchr1_hotpotqa.jsonl", tmp_path / "hotpot.parquet")
    out = tmp_path / "search.jsonl"
    assert convert("search", [FIXTURES / "nq.jsonl", hotpot], out) == {"nq": 2, "hotpotqa": 1}
    rows = read(out)
    assert rows[0]["golden_answers"] == ["Mary Shelley", "Mary Wollstonecraft Shelley"]
    assert rows[2] == {
        "question": "Which river flows through the city where the Eiffel Tower stands?",
        "golden_answers": ["Seine", "the Seine"],
        "data_source": "hotpotqa",
    }
    tasks = load_file(out, "train", "question", "golden_answers")
    assert tasks[0].answers == ["Mary Shelley", "Mary Wollstonecraft Shelley"]


def test_bad_rows_are_named_or_skipped(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "no answer here"}\n')
    out = tmp_path / "out.jsonl"
    with pytest.raises(ConvertError, match=r"bad\.jsonl line 2: no answer .*--skip-bad"):
        convert("math", [bad], out)
    assert not out.exists()  # nothing half-written
    assert convert("math", [bad], out, source="mine", skip_bad=True) == {"mine": 1, "skipped": 1}


def test_cli(tmp_path: Path) -> None:
    out = tmp_path / "val.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "drmas.launch.cli", "data", "math", str(FIXTURES / "math500.jsonl"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "wrote 2 math tasks" in done.stderr and len(read(out)) == 2
    missing = subprocess.run(
        [sys.executable, "-m", "drmas.launch.cli", "data", "search", "nope.parquet", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "nope.parquet does not exist" in missing.stderr
