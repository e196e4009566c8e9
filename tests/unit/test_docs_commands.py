"""Every `drmas` command line of README.md, CONTRIBUTING.md and docs/*.md runs as written, in
a dry form, so the documents cannot drift from the CLI and the config schema.

Where commands are found: lines of fenced code blocks whose command word is `drmas` (after
`VAR=value` prefixes, and as `.venv/bin/drmas`; a line ending in a backslash continues;
`&&`, `;`, `|` and `&` separate commands), and inline code that starts with `drmas `.

How each runs (`python -m drmas.launch.cli`, a subprocess per command, several at once):
- `drmas config ...` as written: it composes and checks a config and starts nothing;
- every other subcommand with `--help` appended: argparse accepts the command line as
  written (subcommand, options, their values) without starting processes or long work;
- `drmas train|prepare|probe|eval` with overrides or `--config`: ALSO those overrides and
  that config composed and checked by `drmas config`, so a documented key that does not
  exist, or a value the schema refuses, fails here.
Also `python -m drmas.learners --help` (the torchrun entry the documents show), and every
`drmas/...` path the documents name must exist.

Commands run in the repository root, as a user runs them. Placeholders are written so
they run: PLACEHOLDERS maps each to a value here (a temporary folder, the loopback
address); the `export`s of a code block are set for the commands after them. The plug-in
examples (`workflow.target=my_pkg.teams:Debate`, `task.name=my_tasks.py:make`, ...) need
no files: composing a config loads no plug-in. A command that cannot run dry is listed in
EXCLUDED with the reason.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 120.0

PLACEHOLDERS = {
    "RUN_DIR": "{tmp}/run",  # a run folder
    "/shared/": "{tmp}/shared/",  # storage every node sees
    "HEAD_IP": "127.0.0.1",  # the broker's host
    "tcp://HEAD:": "tcp://127.0.0.1:",
    "RETRIEVER_HOST": "127.0.0.1",
}
"""Placeholder in a document -> what the test substitutes (`{tmp}`: the commands' folder)."""

EXCLUDED: dict[str, str] = {}
"""Command line as written -> why it cannot run dry (none so far)."""

HELP_FREE = {"config"}
"""Subcommands run as written: they start nothing."""
VALIDATED = {"train", "prepare", "probe", "eval"}
"""Subcommands whose overrides and --config are also checked with `drmas config`."""
VALUE_OPTIONS = {
    "--config", "--id", "--model", "--step", "--data", "--tasks", "--k", "--n",
    "--temperature", "--top-p", "--seed", "--out", "--last",
}  # fmt: skip
"""Options of those subcommands that take a value (the next word is not an override)."""


@dataclass(frozen=True)
class Doc:
    """One command line of a document."""

    where: str  # file:line
    text: str  # as written (continuations joined)
    env: tuple[tuple[str, str], ...] = ()  # `export`s of its code block before it


def _split(text: str) -> Iterator[list[str]]:
    """Shell words of each command of `text` (comments dropped, split at && ; | &)."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    words: list[str] = []
    for word in lex:
        if word in {"&&", "||", ";", "|", "&"}:
            yield words
            words = []
        else:
            words.append(word)
    yield words


def _assignments(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading `VAR=value` words (as a mapping) and the words after them."""
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name, _, value = words[0].partition("=")
        env[name], words = value, words[1:]
    return env, words


def _drmas_words(words: list[str]) -> list[str] | None:
    """The words after `drmas` if this command runs drmas, else None."""
    _, words = _assignments(words)
    if words and (words[0] == "drmas" or words[0].endswith("/bin/drmas")):
        return words[1:]
    return None


def _exports(text: str) -> dict[str, str]:
    """What the `export VAR=value ...` commands of a line set."""
    env: dict[str, str] = {}
    for words in _split(text):
        if words[:1] == ["export"]:
            env.update(_assignments(words[1:])[0])
    return env


def document_commands() -> list[Doc]:
    found: list[Doc] = []
    for path in DOCUMENTS:
        fenced, pending, env = False, "", {}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced, pending, env = not fenced, "", {}
                continue
            where = f"{path.relative_to(ROOT)}:{number}"
            if not fenced:
                found += [Doc(where, m) for m in re.findall(r"`(drmas [^`]+)`", line)]
                continue
            pending += line
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            text, pending = pending, ""
            if any(_drmas_words(words) is not None for words in _split(text)):
                found.append(Doc(where, text.strip(), tuple(env.items())))
            env.update(_exports(text))
    return found


def substitute(text: str, tmp: Path) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value.format(tmp=tmp))
    return text


Run = tuple[tuple[str, ...], tuple[tuple[str, str], ...]]
"""(arguments of `python -m drmas.launch.cli`, environment variables to set)."""


def dry_runs(text: str, exported: tuple[tuple[str, str], ...] = ()) -> list[Run]:
    """The runs that check one documented line (`exported`: its block's `export`s)."""
    runs: list[Run] = []
    for words in _split(text):
        args = _drmas_words(words)
        if not args:
            continue
        env = tuple({**dict(exported), **_assignments(words)[0]}.items())
        command = args[0]
        if command in HELP_FREE:
            runs.append((tuple(args), env))
            continue
        runs.append((tuple(args if "--help" in args else [*args, "--help"]), env))
        if command in VALIDATED:
            config, overrides = _overrides(command, args[1:])
            if config or overrides:
                check = ["config", *(["--config", config] if config else []), "", *overrides]
                runs.append((tuple(check), env))
    return runs


def _overrides(command: str, args: list[str]) -> tuple[str, list[str]]:
    """(--config value, overrides) of a train/prepare/probe/eval argument list."""
    config, overrides, positional = "", [], 0
    words = iter(args)
    for word in words:
        if word in VALUE_OPTIONS:
            value = next(words, "")
            config = value if word == "--config" else config
        elif word.startswith("-"):
            continue
        else:
            positional += 1
            run_folder = command == "eval" and positional == 1 and "=" not in word
            if not run_folder:
                overrides.append(word)
    return config, overrides


def _run(run: Run) -> subprocess.CompletedProcess[str]:
    argv, extra = run
    return subprocess.run(
        [sys.executable, "-m", "drmas.launch.cli", *argv],
        cwd=ROOT,
        env={**os.environ, **dict(extra)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


COMMANDS = document_commands()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder PLACEHOLDERS' `{tmp}` stands for, with the run folder in it."""
    tmp = tmp_path_factory.mktemp("docs_commands")
    (tmp / "run").mkdir()
    (tmp / "shared").mkdir()
    return tmp


Outcomes = dict[Run, subprocess.CompletedProcess[str]]


def _runs_of(doc: Doc, tmp: Path) -> list[Run]:
    exported = tuple((k, substitute(v, tmp)) for k, v in doc.env)
    return dry_runs(substitute(doc.text, tmp), exported)


@pytest.fixture(scope="module")
def outcomes(workdir: Path) -> Outcomes:
    """Every distinct dry run of the documented commands, run a few at once (the same
    command line in several documents runs once)."""
    runs = list(
        dict.fromkeys(r for d in COMMANDS if d.text not in EXCLUDED for r in _runs_of(d, workdir))
    )
    with ThreadPoolExecutor(max_workers=(os.cpu_count() or 1) + 1) as pool:
        return dict(zip(runs, pool.map(_run, runs)))


def test_documents_have_commands() -> None:
    """The extraction finds what the README shows (a broken extractor would test nothing)."""
    texts = [doc.text for doc in COMMANDS]
    assert any(t.startswith("drmas train workflow.target=my_agents.py:episode") for t in texts)
    assert any("drmas config algorithm --docs" in t for t in texts)
    assert any(t.endswith(".venv/bin/drmas train") for t in texts)  # the set-up line
    assert len(COMMANDS) > 50


def test_dry_runs_of_a_line() -> None:
    """What a documented line becomes (derived by hand from the rules in the docstring)."""
    line = "drmas eval runs/try1 --step 15 --data a.jsonl val.n=4  # a comment"
    assert dry_runs(line) == [
        (("eval", "runs/try1", "--step", "15", "--data", "a.jsonl", "val.n=4", "--help"), ()),
        (("config", "", "val.n=4"), ()),
    ]
    line = "VLLM=1 .venv/bin/drmas train --config c.yaml '~agents' &"
    assert dry_runs(line, (("X", "1"),)) == [
        (("train", "--config", "c.yaml", "~agents", "--help"), (("X", "1"), ("VLLM", "1"))),
        (("config", "--config", "c.yaml", "", "~agents"), (("X", "1"), ("VLLM", "1"))),
    ]
    assert dry_runs("drmas config algorithm --docs") == [(("config", "algorithm", "--docs"), ())]
    assert dry_runs("torchrun -m drmas.learners --config c.yaml") == []
    assert _exports("export A=tcp://h:1 B=2 && drmas status x") == {"A": "tcp://h:1", "B": "2"}


@pytest.mark.parametrize("doc", COMMANDS, ids=[f"{d.where} {d.text}" for d in COMMANDS])
def test_documented_command_runs(doc: Doc, workdir: Path, outcomes: Outcomes) -> None:
    if doc.text in EXCLUDED:
        pytest.skip(EXCLUDED[doc.text])
    for run in _runs_of(doc, workdir):
        proc = outcomes[run]
        env = " ".join(f"{k}={v}" for k, v in run[1])
        assert proc.returncode == 0, (
            f"{doc.where}: `{doc.text}` fails as `{env} drmas {shlex.join(run[0])}` "
            f"(exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )


def test_a_documented_typo_would_fail() -> None:
    """The check has teeth: an override with a key that does not exist exits non-zero."""
    (run,) = [r for r in dry_runs("drmas train algorithm.loss.clip_lo=0.2") if r[0][0] == "config"]
    proc = _run(run)
    assert proc.returncode != 0
    assert "clip_low" in proc.stderr  # the nearest key is suggested


def test_learner_entry_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "drmas.learners", "--help"],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--model" in proc.stdout


def test_named_paths_exist() -> None:
    """Every `drmas/...` file or folder a document names is in the tree."""
    missing = []
    for path in DOCUMENTS:
        for match in re.finditer(r"(?<![\w./-])drmas/[\w./-]*[\w/]", path.read_text()):
            if not (ROOT / match.group(0)).exists():
                line = path.read_text().count("\n", 0, match.start()) + 1
                missing.append(f"{path.relative_to(ROOT)}:{line} {match.group(0)}")
    assert not missing, "documents name paths that do not exist:\n" + "\n".join(missing)
