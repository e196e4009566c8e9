"""Hugging Face Hub model ids (`models.<m>.path=org/name`) -> a local checkpoint folder.

Resolved once, by the launcher (`drmas train` / `drmas prepare`), through huggingface_hub:
its cache (HF_HOME / HF_HUB_CACHE), `models.<m>.revision`, and offline mode
(HF_HUB_OFFLINE=1: the cache only). Every process then reads the resolved folder from
RUN_DIR/config.yaml, so actors and learners never download anything themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a causal LM needs: weights, config, tokenizer, generation config. Skips other
# formats a repo may also carry (GGUF, ONNX, original PyTorch shards, ...).
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py", "*.jinja"]


def looks_like_hub_id(path: str) -> bool:
    """org/name, and not a folder that exists here (a local folder wins)."""
    return bool(_HUB_ID.match(path)) and not Path(path).exists()


def fetch_command(repo_id: str, revision: str = "") -> str:
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def resolve_hub_id(repo_id: str, revision: str = "") -> Path:
    """The snapshot folder of `repo_id` at `revision` ("" = main), downloading what is
    missing unless offline. Raises FileNotFoundError saying how to fetch it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}" + (f"@{revision}" if revision else "")
    fetch = (
        f"fetch it on a machine with internet with `{fetch_command(repo_id, revision)}` and "
        f"copy that Hugging Face cache here (this run reads {constants.HF_HUB_CACHE}; set "
        "HF_HOME or HF_HUB_CACHE to use another), or set the path to a local checkpoint folder"
    )
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision or None,
                allow_patterns=_PATTERNS,
                local_files_only=constants.HF_HUB_OFFLINE,
            )
        )
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise FileNotFoundError(
            f"model {at}: the Hub has no such repository, or it is gated and this machine "
            f"has no token for it ({type(exc).__name__}); check the id, `hf auth login`, or "
            f"{fetch}"
        ) from exc
    except RevisionNotFoundError as exc:
        raise FileNotFoundError(f"model {at}: no revision {revision!r}; {fetch}") from exc
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError) as exc:
        offline = " (HF_HUB_OFFLINE=1: the cache only)" if constants.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(
            f"model {at} is not in the local Hugging Face cache and could not be "
            f"downloaded{offline}: {type(exc).__name__}; {fetch}"
        ) from exc
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model {at}: the snapshot {folder} has no config.json, so it is not a "
            "Hugging Face causal-LM checkpoint"
        )
    return folder
