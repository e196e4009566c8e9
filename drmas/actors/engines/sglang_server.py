"""The SGLang server the sglang engine uses: its options, and a managed one's lifecycle.

Who talks to whom: the engine (sglang.py) reads its settings through `SGLangOptions`
(from the pool's EngineConfig) and, when no `actor.engine.sglang_url` is given, starts a
`ManagedServer`: a `python -m sglang.launch_server` child in its own process group, its
output in a log file, ready once `GET /health` answers 200, stopped with SIGTERM to its
group and then SIGKILL. The engine factory (engines/__init__.py) calls `require_sglang`
before training starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from drmas.actors.engines import sglang_requests as api
from drmas.config.actor import EngineConfig
from drmas.config.types import PauseMode

if TYPE_CHECKING:
    from drmas.config.model import LoraConfig

HEALTH_POLL_S = 0.2
"""Pause between /health probes of a starting server (it has no other readiness signal)."""


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
        if mode not in get_args(PauseMode):
            raise ValueError(
                f"actor.engine.pause_mode={mode!r} is not one of {list(get_args(PauseMode))}"
            )
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


LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch")
"""The flags `lora_flags` sets (extra_args may not set them on a LoRA base)."""


def lora_flags(lora: LoraConfig, adapters: Sequence[str]) -> list[str]:
    """launch_server flags for serving `adapters` on the base, loaded later through
    /load_lora_adapter (so rank and target modules are given up front). A batch may hold
    two versions of every adapter while requests that started on the old one finish
    (pause_mode=keep), plus the base (SGLang gives it a slot of its own)."""
    return [
        "--enable-lora",
        "--max-lora-rank", str(lora.rank),
        "--lora-target-modules", *lora.target_modules,
        "--max-loras-per-batch", str(2 * len(adapters) + 1),
    ]  # fmt: skip


def launch_args(
    opts: SGLangOptions,
    model_path: str,
    port: int,
    lora: LoraConfig | None = None,
    adapters: Sequence[str] = (),
) -> list[str]:
    """The managed server's command line (SGLang's server_args flag names); with `lora`
    and `adapters`, LoRA serving of those adapters (`lora_flags`)."""
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
    if lora is not None and adapters:
        clash = sorted(set(LORA_FLAGS) & set(opts.extra_args))
        if clash:
            raise ValueError(
                f"engine extra_args may not set {clash} on a LoRA base: drmas sets them"
            )
        args += lora_flags(lora, adapters)
    return args + list(opts.extra_args)


class ManagedServer:
    """A `sglang.launch_server` child in its own process group, its output in a log file."""

    def __init__(self, args: list[str], url: str) -> None:
        self.args = args
        self.url = url
        self.log_path = Path(tempfile.mkstemp(prefix="drmas-sglang-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float) -> None:
        """Launch the child and wait (at most `timeout_s`) until /health answers 200; a
        child that exits or never answers is reported with the tail of its log."""
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
            with contextlib.suppress(api.SGLangHTTPError):
                if api.http_call(self.url, "/health", None, 5.0)[0] == 200:
                    return
            time.sleep(HEALTH_POLL_S)
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
