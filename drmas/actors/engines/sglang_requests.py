"""What the sglang engine sends an SGLang server and how it reads the answers.

Who talks to whom: the engine (sglang.py) and the server manager (sglang_server.py) call
`http_call` / `checked` with the bodies built here; nothing here holds state. Each body
matches one SGLang request type (io_struct.py); tests/unit/test_sglang_contract.py checks
every key and value type against the vendored definitions. Every HTTP call has a timeout;
errors name the route and say what to check.

One distribution: /generate names every API field of SGLang's SamplingParams (0.5.23). A
field a request leaves out takes a server default: `--preferred-sampling-params`, merged
under the request's own keys, and with `--sampling-defaults model` (the default) the
model's generation_config.json (many chat models ship top_k 20, repetition_penalty 1.05,
...; which routes apply it depends on the SGLang version). Any of those would change what
the engine samples from, while the learner scores every token under softmax(logits / T)
alone; so every field is sent, at SGLang's own neutral value where GenerateRequest does
not set it, and no server default is left to apply.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from drmas.actors.engines.base import GenerateRequest
from drmas.config.types import PauseMode

PAUSE_MODES: dict[PauseMode, str] = {"keep": "retract", "abort": "abort"}
"""Our pause mode (actor.engine.pause_mode) -> SGLang's PauseGenerationReqInput.mode:
"retract" sends running requests back to the queue (they continue on the new weights),
"abort" ends them (the engine resubmits them after resume)."""


# ------------------------------------------------------------------ request bodies
NEUTRAL_SAMPLING: dict[str, Any] = {
    "top_k": -1,  # the whole vocabulary (SGLang maps -1 to TOP_K_ALL)
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,  # 1 = no penalty
    "min_new_tokens": 0,  # > 0 would mask EOS and the stop tokens for a while
    "n": 1,
    "ignore_eos": False,
    "skip_special_tokens": True,  # text only (we read token ids)
    "spaces_between_special_tokens": True,
}
"""Every SamplingParams field with a value of its own that the request does not set from
GenerateRequest, at SGLang's neutral value (why: module docstring). The fields whose
default is None (beam search, grammars, logit bias, seed, watermark, stop token ids, ...)
are left out: None is their default whatever the model's generation config says, and a
server older than the vendored SamplingParams may not know some of them (it would refuse
every request naming one). The contract test checks that these, the five set per request
and those None-default fields cover every API field of the vendored SamplingParams."""


def generate_body(request: GenerateRequest, lora_name: str | None = None) -> dict[str, Any]:
    """POST /generate -> GenerateReqInput (sampling_params -> SamplingParams); `lora_name`:
    the loaded LoRA adapter to generate with (GenerateReqInput.lora_path takes its name)."""
    body: dict[str, Any] = {
        "input_ids": list(request.prompt_ids),
        "sampling_params": {
            **NEUTRAL_SAMPLING,
            "temperature": float(request.temperature),
            "top_p": float(request.top_p),
            "max_new_tokens": int(request.max_new_tokens),
            "stop": list(request.stop),
            "no_stop_trim": True,  # our contract keeps the stop string in the output
        },
        "return_logprob": True,
        "logprob_start_len": -1,  # log-probs of output tokens only
        "stream": False,
    }
    if lora_name is not None:
        body["lora_path"] = lora_name
    return body


def pause_body(mode: PauseMode) -> dict[str, Any]:
    """POST /pause_generation -> PauseGenerationReqInput."""
    return {"mode": PAUSE_MODES[mode]}


def continue_body() -> dict[str, Any]:
    """POST /continue_generation -> ContinueGenerationReqInput."""
    return {}


def begin_update_body() -> dict[str, Any]:
    """POST /begin_weight_update -> BeginWeightUpdateReqInput."""
    return {}


def end_update_body() -> dict[str, Any]:
    """POST /end_weight_update -> EndWeightUpdateReqInput."""
    return {}


def init_group_body(address: str, port: int, world_size: int, group_name: str) -> dict[str, Any]:
    """POST /init_weights_update_group -> InitWeightsUpdateGroupReqInput (rank 0 = actor)."""
    return {
        "master_address": address,
        "master_port": int(port),
        "rank_offset": 1,
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": "gloo",
    }


def update_body(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group_name: str,
    version: int,
) -> dict[str, Any]:
    """POST /update_weights_from_distributed -> UpdateWeightsFromDistributedReqInput."""
    return {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [[int(d) for d in s] for s in shapes],
        "group_name": group_name,
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": str(version),
    }


def destroy_group_body(group_name: str) -> dict[str, Any]:
    """POST /destroy_weights_update_group -> DestroyWeightsUpdateGroupReqInput."""
    return {"group_name": group_name}


def load_lora_body(name: str, path: str) -> dict[str, Any]:
    """POST /load_lora_adapter -> LoadLoRAAdapterReqInput: the PEFT folder at `path` (on the
    server's file system) becomes adapter `name`."""
    return {"lora_name": name, "lora_path": path}


def unload_lora_body(name: str) -> dict[str, Any]:
    """POST /unload_lora_adapter -> UnloadLoRAAdapterReqInput."""
    return {"lora_name": name}


# ------------------------------------------------------------------ replies
def parse_generate(reply: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """(token ids, log-probs, "stop"|"length"|"abort") from a /generate reply: top-level
    `output_ids`, `meta_info.output_token_logprobs` as (logprob, token id, text) triples,
    `meta_info.finish_reason` as {"type": ...}."""
    meta = reply.get("meta_info") or {}
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise ValueError("SGLang /generate reply has no meta_info.output_token_logprobs")
    logprobs = [float(t[0]) for t in triples]
    ids = [int(t[1]) for t in triples]
    output_ids = reply.get("output_ids")
    if output_ids is not None and [int(i) for i in output_ids] != ids:
        raise ValueError(
            f"SGLang /generate reply: output_ids ({len(output_ids)}) and "
            f"output_token_logprobs ({len(ids)}) disagree"
        )
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"SGLang /generate reply: unknown finish_reason {reason!r}")
    return ids, logprobs, str(kind)


# ------------------------------------------------------------------ HTTP
class SGLangHTTPError(RuntimeError):
    """A request to the SGLang server failed or was refused."""


def http_call(
    url: str, route: str, body: dict[str, Any] | None, timeout_s: float
) -> tuple[int, Any]:
    """(status, decoded JSON or None); body None = GET. Connection errors raise."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url.rstrip("/") + route,
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SGLangHTTPError(
            f"SGLang server at {url}: {route} failed ({reason}); is the server running and "
            "reachable (actor.engine.sglang_url)?"
        ) from None
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode(errors="replace")


def checked(url: str, route: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """`http_call` that raises SGLangHTTPError unless the server answered 200 and did not
    report {"success": false}; returns the decoded reply."""
    status, reply = http_call(url, route, body, timeout_s)
    failed = isinstance(reply, dict) and reply.get("success") is False
    if status != 200 or failed:
        raise SGLangHTTPError(f"SGLang server at {url}: {route} answered {status}: {reply}")
    return reply
