"""Hub ids (`models.<m>.path=org/name`) resolve through a pre-populated Hugging Face cache
with HF_HUB_OFFLINE=1, as on a cluster node without internet; a missing id says how to
fetch it. Real `drmas prepare` processes; the cache holds a tiny Qwen2 under the ids."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def put_in_cache(cache: Path, repo_id: str, commit: str, ref: str | None = "main") -> Path:
    """The Hub cache layout: models--org--name/{refs/<ref>, snapshots/<commit>/...}."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(snapshot)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def prepare(tmp: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(tmp / "hf"),
    }
    return subprocess.run(
        [sys.executable, "-m", "drmas.launch.cli", "prepare", f"run.dir={tmp / 'run'}", *overrides],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    put_in_cache(root, "Qwen/Qwen2.5-3B-Instruct", COMMIT)
    put_in_cache(root, "Qwen/Qwen3-4B", COMMIT)
    put_in_cache(root, "acme/tiny", COMMIT)
    put_in_cache(root, "acme/tiny", OTHER, ref=None)  # only reachable by its commit
    return root


@pytest.mark.parametrize(
    ("experiment", "repo"),
    [("search", "models--Qwen--Qwen2.5-3B-Instruct"), ("math", "models--Qwen--Qwen3-4B")],
)
def test_paper_recipes_resolve_their_hub_ids_offline(
    tmp_path: Path, cache: Path, experiment: str, repo: str
) -> None:
    done = prepare(tmp_path, cache, f"experiment={experiment}", "task.train_path=train.jsonl",
                   "placement.gpus=8")  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    want = str(cache / repo / "snapshots" / COMMIT)
    assert {m["path"] for m in saved["models"].values()} == {want}
    assert "placement on 8 GPU(s)" in done.stderr  # the plan a GPU node would get


def test_revision_picks_the_snapshot(tmp_path: Path, cache: Path) -> None:
    done = prepare(tmp_path, cache, "models.solver.path=acme/tiny", f"models.solver.revision={OTHER}",
                   "models.verifier.path=acme/tiny")  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["models"]["solver"]["path"].endswith(f"snapshots/{OTHER}")
    assert saved["models"]["verifier"]["path"].endswith(f"snapshots/{COMMIT}")


def test_missing_id_says_how_to_fetch_it(tmp_path: Path, cache: Path) -> None:
    done = prepare(tmp_path, cache, "models.solver.path=acme/absent", "models.solver.revision=v2")
    assert done.returncode == 2
    assert "acme/absent@v2 is not in the local Hugging Face cache" in done.stderr
    assert "HF_HUB_OFFLINE=1" in done.stderr
    assert "`hf download acme/absent --revision v2`" in done.stderr


def test_local_folder_wins_over_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from drmas.models.hub import looks_like_hub_id

    assert looks_like_hub_id("Qwen/Qwen3-4B") and not looks_like_hub_id("./Qwen/Qwen3-4B")
    assert not looks_like_hub_id("/models/qwen") and not looks_like_hub_id("builtin:tiny-qwen2")
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not looks_like_hub_id("org/name")  # a folder of that name exists here
