"""The `sglang` engine: the Engine protocol (base.py) over an SGLang HTTP server.

Who talks to whom: workflow coroutines call `generate`; each call becomes one
`POST /generate` (token ids in, token ids + per-token log-probs + finish reason out), run
on a thread pool sized `max_batch`, so SGLang's own scheduler batches them. The actor
process calls `pause` / `load_weights` (once per received bucket, from its receive
thread) / `resume` around a publish. The server is either a child this engine starts
(sglang_server.py: `python -m sglang.launch_server`) or one already running at a URL;
the request bodies and the HTTP calls are sglang_requests.py.

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

LoRA base (models.<m>.lora.rank > 0): the server runs with LoRA enabled for the model's
adapters (sglang_server.lora_flags) and each /generate names its adapter's current version
in `lora_path`. A publish carries the tensors of the adapters that changed since the
version the actor holds (possibly none); they do not go over the bridge: once the publish
is whole each adapter it carried is written as a PEFT folder and loaded with
/load_lora_adapter as a new version, the old one unloaded when unused, the other adapters
untouched (sglang_lora.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.actors.engines import sglang_requests as api
from drmas.actors.engines.base import GenerateRequest, GenerateResult
from drmas.actors.engines.sglang_lora import SGLangAdapters
from drmas.actors.engines.sglang_server import ManagedServer, SGLangOptions, launch_args
from drmas.config.actor import EngineConfig
from drmas.transports.ports import free_port

if TYPE_CHECKING:
    import torch

    from drmas.actors.engines.sglang_bridge import WeightBridge
    from drmas.config.model import LoraConfig
    from drmas.transports.digest import Digest
    from drmas.transports.weights import Expected

log = logging.getLogger("drmas.engine.sglang")


class SGLangEngine:
    """Engine protocol (drmas/actors/engines/base.py) over an SGLang HTTP server; RollsBack
    (engines/__init__.py) too, which only a LoRA base can (backup_weights is None otherwise)."""

    def __init__(
        self,
        model_name: str,
        model_path: str | Path,
        cfg: EngineConfig,
        options: SGLangOptions | None = None,
        lora: LoraConfig | None = None,
        adapters: Sequence[str] | None = None,
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
        self.adapters: SGLangAdapters | None = None
        """LoRA base: its adapters' versions on the server (None: a full model)."""
        if lora is not None and lora.rank > 0 and adapters:
            self.adapters = SGLangAdapters(
                model_name, Path(model_path), lora, adapters, self._control_call, cfg.dtype
            )

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if not self.url:
            port = self.opts.port or free_port(self.opts.host)
            self.url = f"http://{self.opts.host}:{port}"
            lora, adapters = (
                (self.adapters.lora, self.adapters.adapters) if self.adapters else (None, [])
            )
            args = launch_args(self.opts, self.model_path, port, lora, adapters)
            self.server = ManagedServer(args, self.url)
            log.info("%s: starting SGLang server: %s", self.model_name, " ".join(self.server.args))
            await asyncio.to_thread(self.server.start, self.opts.start_timeout_s)
        else:
            status, _ = await asyncio.to_thread(
                api.http_call, self.url, "/health", None, self.opts.control_timeout_s
            )
            if status != 200:
                raise RuntimeError(f"SGLang server at {self.url}: /health answered {status}")
        self.tokenizer = await asyncio.to_thread(self._load_tokenizer)
        if self.adapters is not None:
            await asyncio.to_thread(self.adapters.start)

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
        if self.adapters is not None:
            self.adapters.close()

    # ---------------------------------------------------------------- requests
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        self._check_adapter(request.adapter)
        if request.max_new_tokens == 0:
            return GenerateResult([], [], "length", self.version)
        while True:
            if self._closed:
                raise RuntimeError("engine closed")
            await asyncio.wait_for(self._resumed.wait(), self.opts.request_timeout_s)
            version, pauses = self.version, self._pauses
            reply = await self._post_generate(request)
            ids, logprobs, reason = api.parse_generate(reply)
            if reason != "abort":
                return GenerateResult(ids, logprobs, reason, version)
            if self.opts.pause_mode != "abort" or self._pauses == pauses:
                raise api.SGLangHTTPError(
                    f"SGLang aborted a request ({reply['meta_info'].get('finish_reason')}); "
                    "a prompt longer than the context? (actor.engine.max_model_len)"
                )
            # aborted by our pause (abort mode): run it again, on the new weights

    async def _post_generate(self, request: GenerateRequest) -> dict[str, Any]:
        """One POST /generate on the thread pool, with the adapter's current version held
        (on a LoRA base) until it returns; the reply checked."""
        loaded = self.adapters.acquire(request.adapter) if self.adapters else None
        try:
            status, reply = await asyncio.get_running_loop().run_in_executor(
                self._pool,
                api.http_call,
                self.url,
                "/generate",
                api.generate_body(request, loaded.lora_name if loaded else None),
                self.opts.request_timeout_s,
            )
        finally:
            if self.adapters is not None:
                old = self.adapters.release(loaded)
                if old is not None:  # superseded, and this was its last request
                    await asyncio.to_thread(self.adapters.unload, old)
        if status != 200 or not isinstance(reply, dict):
            raise api.SGLangHTTPError(f"SGLang server at {self.url}: /generate {status}: {reply}")
        return reply

    def _check_adapter(self, adapter: str) -> None:
        if self.adapters is not None:
            self.adapters.slots.check(adapter)
        elif adapter:
            raise ValueError(
                f"request for LoRA adapter {adapter!r}, but model {self.model_name!r} has no "
                "adapters (models.<m>.lora.rank is 0)"
            )

    async def pause(self) -> None:
        self._pauses += 1
        self._resumed.clear()
        await asyncio.to_thread(
            api.checked,
            self.url,
            "/pause_generation",
            api.pause_body(self.opts.pause_mode),
            self.opts.control_timeout_s,
        )

    async def resume(self) -> None:
        """Make a staged LoRA publish serve (the actor resumes after a load that went
        through, digest checked; after a failed one it discarded the staged publish
        first), close the weight-update session (if one is open), then continue generation
        even when either failed (the error is raised after)."""
        try:
            if self.adapters is not None:
                committed = await asyncio.to_thread(self.adapters.commit)
                if committed is not None:
                    self.version = committed
            if self._session is not None:
                self._session = None
                await asyncio.to_thread(
                    self._session_call, "/end_weight_update", api.end_update_body()
                )
        finally:
            try:
                await asyncio.to_thread(
                    api.checked,
                    self.url,
                    "/continue_generation",
                    api.continue_body(),
                    self.opts.control_timeout_s,
                )
            finally:
                self._resumed.set()

    # ---------------------------------------------------------------- weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Forward one received bucket to the server (called from the actor's receive
        thread, the engine paused). Failing tears the bridge down; the next publish
        builds a new one. On a LoRA base the buckets are kept until the publish is whole,
        then the adapters it carried are loaded as new versions, which serve (and set the
        engine's version) once `resume` commits them (sglang_lora.py); a call without
        tensors ends a publish; the bridge is not used."""
        from drmas.transports.digest import Digest
        from drmas.transports.weights import spec_of

        from .sglang_bridge import Rendezvous

        if self.adapters is not None:  # a LoRA base: adapters, loaded by folder, staged
            self.adapters.receive(named_tensors, version)  # until resume() commits them
            return
        batch = list(named_tensors)
        if not batch:
            return
        specs = [spec_of(name, t) for name, t in batch]
        try:
            bridge = self._bridge or self._open_bridge()
            if self._session != version and self._sessions_supported:
                self._session_call("/begin_weight_update", api.begin_update_body())
                self._session = version
            body = api.update_body(
                [s.name for s in specs],
                [s.dtype for s in specs],
                [s.shape for s in specs],
                bridge.group_name,
                version,
            )
            answer = Rendezvous(
                lambda: api.checked(
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
        server's own weights cannot be read back in full over HTTP); on a LoRA base, of every
        adapter: the folders the server loaded, read back, and the initial tensors of those
        no publish carried yet ("" before the first publish)."""
        if self.adapters is not None:  # a staged publish: what serves once resumed
            return self.adapters.staged_digest or self.adapters.digest
        return self._digest.hexdigest() if self._digest is not None else ""

    def expected_weights(self, adapters: Sequence[str]) -> Expected | None:
        """What a publish must carry (drmas/actors/engines/expected.py), checked by the
        actor's receiver before a bucket is forwarded: every parameter of the model
        folder's architecture; on a LoRA base of the adapters the publish carries."""
        from drmas.actors.engines.expected import adapters_expected, folder_expected

        if self.adapters is not None:
            held = self.adapters
            return adapters_expected(held.model_path, held.lora, held.adapters, adapters)
        return folder_expected(self.model_path)

    def backup_weights(self) -> object:
        """RollsBack (engines/__init__.py): on a LoRA base a publish switches adapters only
        when the engine resumes after a load that went through, so a failed one (restore
        discards what it staged) leaves the previous version serving; None (cannot roll
        back: the server loads buckets in place) otherwise."""
        return self.version if self.adapters is not None else None

    def restore_weights(self, backup: object) -> None:
        if not isinstance(backup, int) or self.adapters is None:
            raise TypeError(f"engine {self.model_name!r}: nothing to restore ({backup!r})")
        self.adapters.discard()
        self.version = backup

    def _control_call(self, route: str, body: dict[str, Any]) -> Any:
        """A checked control request (LoRA adapter loads and unloads) within the weight
        timeout."""
        return api.checked(self.url, route, body, self.opts.weight_timeout_s)

    def server_weight_version(self) -> str:
        """The weight_version the server reports (GET /get_model_info)."""
        reply = api.checked(self.url, "/get_model_info", None, self.opts.control_timeout_s)
        return str(reply.get("weight_version"))

    def _open_bridge(self) -> WeightBridge:
        from .sglang_bridge import Rendezvous, WeightBridge

        bridge = WeightBridge(
            self.opts.bridge_host, self.opts.tp_size, self.opts.weight_timeout_s, self.model_name
        )
        bridge.listen()
        body = api.init_group_body(bridge.host, bridge.port, bridge.world_size, bridge.group_name)
        answer = Rendezvous(
            lambda: api.checked(
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
        with contextlib.suppress(api.SGLangHTTPError):
            timeout = self.opts.control_timeout_s if ok else 5.0
            api.http_call(
                self.url,
                "/destroy_weights_update_group",
                api.destroy_group_body(bridge.group_name),
                timeout,
            )
        bridge.close(ok)

    def _session_call(self, route: str, body: dict[str, Any]) -> None:
        """begin/end_weight_update; a server without them (404) is used without sessions."""
        status, reply = api.http_call(self.url, route, body, self.opts.weight_timeout_s)
        if status == 404:
            self._sessions_supported = False
            return
        if status != 200 or (isinstance(reply, dict) and reply.get("success") is False):
            raise api.SGLangHTTPError(
                f"SGLang server at {self.url}: {route} answered {status}: {reply}"
            )
