"""The `sglang` engine: the Engine protocol (base.py) over an SGLang HTTP server.

Who talks to whom: workflow coroutines call `generate`; each call becomes one
`POST /generate` (token ids in, token ids + per-token log-probs + finish reason out), run
on a thread pool sized `max_batch`, so SGLang's own scheduler batches them. The actor
process calls `pause` / `load_weights` (once per received bucket, from its receive
thread) / `resume` around a publish. The server is either a child this engine starts
(`python -m sglang.launch_server`, in its own process group, ready once `GET /health`
answers 200, stopped with SIGTERM then SIGKILL) or one already running at a URL.

Weights reach the server through a bridge (sglang_bridge.py): the actor receives our
broadcast as for any engine and, per bucket, re-broadcasts the tensors to the server over
a gloo group the actor hosts, while `POST /update_weights_from_distributed` (names,
dtypes, shapes, `weight_version=str(version)`, `flush_cache`) makes the server receive
and load them. The alternative, the learner adding the server's ranks to its own group,
would save one hop but cannot work with our wire format (SGLang expects one broadcast
per tensor with names sent over HTTP, we send a header and mixed buckets), would make
the learner talk to every server's HTTP API, and would tie each server's rank layout
into the broker's per-publish plan; the bridge keeps learner and broker unchanged,
keeps the learner's group one rank per actor, and costs a local copy on the actor host.

Around an update: `POST /pause_generation` (mode "retract" for our "keep": running
requests go back to the queue and continue on the new weights, and the prefix cache can
be flushed; "abort" aborts them and this adapter resubmits them after resume), then
`/begin_weight_update` ... `/end_weight_update` (SGLang >= 0.5.2x insists on that
session; older servers answer 404 and are used without), then `/continue_generation`.
Every HTTP call has a timeout; errors name the route and say what to check.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from drmas.actors.engines.base import GenerateRequest, GenerateResult
from drmas.config.actor import EngineConfig

if TYPE_CHECKING:
    import torch

    from drmas.actors.engines.sglang_bridge import WeightBridge
    from drmas.transports.digest import Digest

log = logging.getLogger("drmas.engine.sglang")

PauseMode = Literal["keep", "abort"]
PAUSE_MODES: dict[str, str] = {"keep": "retract", "abort": "abort"}
"""Our pause mode -> SGLang's PauseGenerationReqInput.mode."""


@dataclass
class SGLangOptions:
    """What the engine needs from EngineConfig (read in one place: `from_config`)."""

    url: str = ""
    """Server to use; "" = start a managed `sglang.launch_server` child."""
    host: str = "127.0.0.1"
    """Managed server: bind address."""
    port: int = 0
    """Managed server: port; 0 = a free one."""
    tp_size: int = 1
    mem_fraction: float = 0.85
    context_length: int = 0
    """0 = the model's own."""
    dtype: str = "auto"
    seed: int = 0
    prefix_caching: bool = True
    pause_mode: PauseMode = "keep"
    start_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    control_timeout_s: float = 60.0
    weight_timeout_s: float = 300.0
    bridge_host: str = "127.0.0.1"
    """Address the server reaches the actor's bridge store at."""
    max_concurrency: int = 64
    extra_args: list[str] = field(default_factory=list)
    command: list[str] = field(
        default_factory=lambda: [sys.executable, "-m", "sglang.launch_server"]
    )
    """Managed server program (tests put a fake server here)."""

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> SGLangOptions:

        def get(name: str, default: Any) -> Any:
            return getattr(cfg, name, default)

        mode = get("pause_mode", "keep")
        if mode not in PAUSE_MODES:
            raise ValueError(f"actor.engine.pause_mode must be one of {sorted(PAUSE_MODES)}")
        return cls(
            url=get("sglang_url", ""),
            host=get("sglang_host", "127.0.0.1"),
            port=int(get("sglang_port", 0)),
            tp_size=int(get("tensor_parallel_size", 1)),
            mem_fraction=float(get("gpu_memory_utilization", 0.85)),
            context_length=int(get("max_model_len", 0)),
            dtype=cfg.dtype,
            seed=cfg.seed,
            prefix_caching=bool(get("enable_prefix_caching", True)),
            pause_mode=mode,
            start_timeout_s=float(get("sglang_start_timeout_s", 600.0)),
            request_timeout_s=float(get("sglang_request_timeout_s", 600.0)),
            weight_timeout_s=float(get("sglang_weight_timeout_s", 300.0)),
            bridge_host=get("sglang_bridge_host", "127.0.0.1"),
            max_concurrency=max(1, cfg.max_batch),
            extra_args=extra_flags(get("extra_args", {})),
        )


def extra_flags(extra: dict[str, Any]) -> list[str]:
    """EngineConfig.extra_args (server_args field -> value) as launch_server flags:
    {"enable_torch_compile": True, "chunked_prefill_size": 512} -> --enable-torch-compile
    --chunked-prefill-size 512 (False drops a flag)."""
    flags: list[str] = []
    for key, value in extra.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def require_sglang(opts: SGLangOptions) -> None:
    """Fail before training starts when a managed server cannot be launched here."""
    import importlib.util

    managed = not opts.url and opts.command[1:3] == ["-m", "sglang.launch_server"]
    if managed and importlib.util.find_spec("sglang") is None:
        raise ImportError(
            "actor.engine.name=sglang starts an SGLang server, but the sglang package is "
            "not installed: pip install 'drmas[sglang]' (needs a CUDA GPU), or set "
            "actor.engine.sglang_url to a running server"
        )


# ------------------------------------------------------------------ request bodies
# Each body matches one SGLang request type (io_struct.py); tests/unit/test_sglang_contract.py
# checks every key and value type against the vendored definitions.
def generate_body(request: GenerateRequest) -> dict[str, Any]:
    """POST /generate -> GenerateReqInput (sampling_params -> SamplingParams)."""
    return {
        "input_ids": list(request.prompt_ids),
        "sampling_params": {
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


def _checked(url: str, route: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    status, reply = http_call(url, route, body, timeout_s)
    failed = isinstance(reply, dict) and reply.get("success") is False
    if status != 200 or failed:
        raise SGLangHTTPError(f"SGLang server at {url}: {route} answered {status}: {reply}")
    return reply


# ------------------------------------------------------------------ managed server
def launch_args(opts: SGLangOptions, model_path: str, port: int) -> list[str]:
    """The managed server's command line (SGLang's server_args flag names)."""
    args = [
        *opts.command,
        "--model-path", model_path,
        "--host", opts.host,
        "--port", str(port),
        "--tp-size", str(opts.tp_size),
        "--mem-fraction-static", str(opts.mem_fraction),
        "--dtype", opts.dtype,
        "--random-seed", str(opts.seed),
    ]  # fmt: skip
    if opts.context_length > 0:
        args += ["--context-length", str(opts.context_length)]
    if not opts.prefix_caching:
        args.append("--disable-radix-cache")
    return args + list(opts.extra_args)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ManagedServer:
    """A `sglang.launch_server` child in its own process group, its output in a log file."""

    def __init__(self, args: list[str], url: str) -> None:
        self.args = args
        self.url = url
        self.log_path = Path(tempfile.mkstemp(prefix="drmas-sglang-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float) -> None:
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang server exited with code {self.proc.returncode} before it was "
                    f"ready (log {self.log_path}):\n{self.tail()}\nIs sglang installed "
                    "(pip install 'drmas[sglang]') and does the model fit on the GPU "
                    "(actor.engine.gpu_memory_utilization)?"
                )
            with contextlib.suppress(SGLangHTTPError):
                if http_call(self.url, "/health", None, 5.0)[0] == 200:
                    return
            time.sleep(0.2)
        self.stop(5.0)
        raise TimeoutError(
            f"SGLang server at {self.url} not ready within {timeout_s:.0f}s (log "
            f"{self.log_path}):\n{self.tail()}\nraise actor.engine.sglang_start_timeout_s "
            "if the model is still loading"
        )

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to the child's process group, wait, then SIGKILL (by its pid only)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout_s)


# ------------------------------------------------------------------ engine
class SGLangEngine:
    """Engine protocol (drmas/actors/engines/base.py) over an SGLang HTTP server."""

    def __init__(
        self,
        model_name: str,
        model_path: str | Path,
        cfg: EngineConfig,
        options: SGLangOptions | None = None,
    ) -> None:
        self.model_name = model_name
        self.model_path = str(model_path)
        self.opts = options or SGLangOptions.from_config(cfg)
        self.version = 0
        self.tokenizer: Any = None
        self.url = self.opts.url.rstrip("/")
        self.server: ManagedServer | None = None
        self.weight_updates = 0
        """update_weights_from_distributed calls that succeeded (one per bucket)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.opts.max_concurrency, thread_name_prefix=f"sglang-{model_name}"
        )
        self._bridge: WeightBridge | None = None
        self._session: int | None = None  # version whose begin_weight_update is open
        self._sessions_supported = True
        self._digest: Digest | None = None
        self._digest_version = -1
        self._pauses = 0  # pause() calls: tells our own aborts from the server's
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._closed = False

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if not self.url:
            port = self.opts.port or free_port(self.opts.host)
            self.url = f"http://{self.opts.host}:{port}"
            self.server = ManagedServer(launch_args(self.opts, self.model_path, port), self.url)
            log.info("%s: starting SGLang server: %s", self.model_name, " ".join(self.server.args))
            await asyncio.to_thread(self.server.start, self.opts.start_timeout_s)
        else:
            status, _ = await asyncio.to_thread(
                http_call, self.url, "/health", None, self.opts.control_timeout_s
            )
            if status != 200:
                raise RuntimeError(f"SGLang server at {self.url}: /health answered {status}")
        self.tokenizer = await asyncio.to_thread(self._load_tokenizer)

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    async def close(self) -> None:
        self._closed = True
        self._resumed.set()
        if self._bridge is not None:
            await asyncio.to_thread(self._drop_bridge, True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            await asyncio.to_thread(self.server.stop, 30.0)

    # ---------------------------------------------------------------- requests
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        if request.max_new_tokens == 0:
            return GenerateResult([], [], "length", self.version)
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise RuntimeError("engine closed")
            await asyncio.wait_for(self._resumed.wait(), self.opts.request_timeout_s)
            version, pauses = self.version, self._pauses
            status, reply = await loop.run_in_executor(
                self._pool,
                http_call,
                self.url,
                "/generate",
                generate_body(request),
                self.opts.request_timeout_s,
            )
            if status != 200 or not isinstance(reply, dict):
                raise SGLangHTTPError(f"SGLang server at {self.url}: /generate {status}: {reply}")
            ids, logprobs, reason = parse_generate(reply)
            if reason != "abort":
                return GenerateResult(ids, logprobs, reason, version)
            if self.opts.pause_mode != "abort" or self._pauses == pauses:
                raise SGLangHTTPError(
                    f"SGLang aborted a request ({reply['meta_info'].get('finish_reason')}); "
                    "a prompt longer than the context? (actor.engine.max_model_len)"
                )
            # aborted by our pause (abort mode): run it again, on the new weights

    async def pause(self) -> None:
        self._pauses += 1
        self._resumed.clear()
        await asyncio.to_thread(
            _checked,
            self.url,
            "/pause_generation",
            pause_body(self.opts.pause_mode),
            self.opts.control_timeout_s,
        )

    async def resume(self) -> None:
        """Close the weight-update session (if one is open), then continue generation
        even when closing failed (the error is raised after)."""
        try:
            if self._session is not None:
                self._session = None
                await asyncio.to_thread(self._session_call, "/end_weight_update", end_update_body())
        finally:
            try:
                await asyncio.to_thread(
                    _checked,
                    self.url,
                    "/continue_generation",
                    continue_body(),
                    self.opts.control_timeout_s,
                )
            finally:
                self._resumed.set()

    # ---------------------------------------------------------------- weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Forward one received bucket to the server (called from the actor's receive
        thread, the engine paused). Failing tears the bridge down; the next publish
        builds a new one."""
        from drmas.transports.digest import Digest
        from drmas.transports.weights import spec_of

        from .sglang_bridge import Rendezvous

        batch = list(named_tensors)
        if not batch:
            return
        specs = [spec_of(name, t) for name, t in batch]
        try:
            bridge = self._bridge or self._open_bridge()
            if self._session != version and self._sessions_supported:
                self._session_call("/begin_weight_update", begin_update_body())
                self._session = version
            body = update_body(
                [s.name for s in specs],
                [s.dtype for s in specs],
                [s.shape for s in specs],
                bridge.group_name,
                version,
            )
            answer = Rendezvous(
                lambda: _checked(
                    self.url, "/update_weights_from_distributed", body, self.opts.weight_timeout_s
                ),
                f"{self.url}/update_weights_from_distributed",
                self.opts.weight_timeout_s + 5.0,
            )
            bridge.broadcast([t for _, t in batch])
            answer.join()
        except BaseException:
            self._drop_bridge(False)
            raise
        if self._digest is None or version != self._digest_version:
            self._digest, self._digest_version = Digest(), version
        for name, tensor in batch:
            self._digest.add(name, tensor)
        self.weight_updates += 1
        self.version = version

    def weights_digest(self) -> str:
        """Fingerprint of what was forwarded and acknowledged for the current version (the
        server's own weights cannot be read back in full over HTTP)."""
        return self._digest.hexdigest() if self._digest is not None else ""

    def server_weight_version(self) -> str:
        """The weight_version the server reports (GET /get_model_info)."""
        reply = _checked(self.url, "/get_model_info", None, self.opts.control_timeout_s)
        return str(reply.get("weight_version"))

    def _open_bridge(self) -> WeightBridge:
        from .sglang_bridge import Rendezvous, WeightBridge

        bridge = WeightBridge(
            self.opts.bridge_host, self.opts.tp_size, self.opts.weight_timeout_s, self.model_name
        )
        bridge.listen()
        body = init_group_body(bridge.host, bridge.port, bridge.world_size, bridge.group_name)
        answer = Rendezvous(
            lambda: _checked(
                self.url, "/init_weights_update_group", body, self.opts.weight_timeout_s
            ),
            f"{self.url}/init_weights_update_group",
            self.opts.weight_timeout_s + 5.0,
        )
        try:
            bridge.connect()
            answer.join()
        except BaseException:
            bridge.close(False)
            raise
        self._bridge = bridge
        return bridge

    def _drop_bridge(self, ok: bool) -> None:
        bridge, self._bridge = self._bridge, None
        if bridge is None:
            return
        with contextlib.suppress(SGLangHTTPError):
            timeout = self.opts.control_timeout_s if ok else 5.0
            http_call(
                self.url,
                "/destroy_weights_update_group",
                destroy_group_body(bridge.group_name),
                timeout,
            )
        bridge.close(ok)

    def _session_call(self, route: str, body: dict[str, Any]) -> None:
        """begin/end_weight_update; a server without them (404) is used without sessions."""
        status, reply = http_call(self.url, route, body, self.opts.weight_timeout_s)
        if status == 404:
            self._sessions_supported = False
            return
        if status != 200 or (isinstance(reply, dict) and reply.get("success") is False):
            raise SGLangHTTPError(
                f"SGLang server at {self.url}: {route} answered {status}: {reply}"
            )
