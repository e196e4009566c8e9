"""The sglang engine against a fake SGLang server, for real on CPU: HTTP, a managed child
process (start, readiness through /health, stop), pause/continue, and a weight update that
travels learner (WeightSender) -> actor (WeightReceiver + the engine's bridge) -> server
over two real gloo groups on loopback.

The fake server (this file run as a script, or in a thread) implements the routes the
adapter uses with SGLang 0.5.23's shapes (see test_sglang_contract.py), refuses any body
that does not fit SGLang's request types, and joins the bridge group the way SGLang's
`init_weights_update_group` does: a TCPStore client from torch's `tcp://` rendezvous,
a PrefixStore named after the group, torch's process-group helper, rank
`rank_offset + tp_rank`; then one broadcast per named tensor. Its "model" answers every
prompt with log-prob -(0.1 + frac(sum of every received weight)), so a test can tell
which weights generated a reply.

Nothing waits on the clock: a test asks the fake (route /_fake/hold) to keep the next
/generate in flight until a pause arrives, and waits (route /_fake/wait) until that request
has reached the fake, so the pause is certain to catch it in flight.

LoRA (the fake started with --enable-lora, as SGLang's launch_server parses it):
/load_lora_adapter reads the PEFT folder it is given (refused, as SGLang does, for a name
it holds, a rank above --max-lora-rank or modules outside --lora-target-modules),
/generate with `lora_path` answers with log-prob -(0.1 + frac(sum of that adapter's
tensors)), and /unload_lora_adapter of an adapter a request still runs on is recorded as
a violation (SGLang would wait for that request, holding its adapter-update lock).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 20.0
"""Longest any wait of the fake takes (a test that hangs fails with this instead)."""


# ------------------------------------------------------------------ fake server
class FakeSGLang:
    """State of one fake server; `handler()` gives the HTTP handler class."""

    def __init__(self, sessions: bool = True, lora: dict[str, Any] | None = None) -> None:
        self.sessions = sessions
        self.lora = lora
        """--enable-lora: {"rank", "targets", "per_batch"} from the launch flags; else None."""
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.in_use: Counter[str] = Counter()
        """Adapter name -> /generate requests running on it."""
        self.paused = False
        self.mode = ""
        self.session = False
        self.weights: dict[str, torch.Tensor] = {}
        self.weight_version = "default"
        self.groups: dict[str, Any] = {}
        self.violations: list[str] = []
        self.routes: list[str] = []
        self.changed = threading.Condition()
        """Notified whenever `paused`, `held` or `arrived` change."""
        self.hold = 0
        """How many of the next /generate requests stay in flight until a pause arrives."""
        self.arrived = 0
        """/generate requests received so far."""
        self.aborted = 0
        """/generate requests answered "abort" because of a pause."""

    def logprob(self, adapter: str | None = None) -> float:
        tensors = self.adapters[adapter] if adapter else self.weights
        total = sum(float(t.double().sum()) for t in tensors.values())
        return -(0.1 + (total - math.floor(total)))

    def handle(self, route: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        from tests.unit.test_sglang_contract import violations

        self.routes.append(route)
        if route == "/_fake/state":
            return 200, self.state()
        if route == "/_fake/hold":
            with self.changed:
                self.hold += 1
            return 200, None
        if route == "/_fake/wait":
            return self.wait_for_count(str(body["count"]), int(body["at_least"]))
        if route in ("/begin_weight_update", "/end_weight_update") and not self.sessions:
            return 404, {"detail": "Not Found"}
        problems = violations(route, body)
        if problems:
            self.violations += problems
            return 400, {"error": problems}
        handler = getattr(self, "do_" + route.strip("/"))
        return handler(body)  # type: ignore[no-any-return]

    def state(self) -> dict[str, Any]:
        from drmas.transports.digest import digest_of

        return {
            "violations": self.violations,
            "routes": self.routes,
            "digest": digest_of(self.weights.items()) if self.weights else "",
            "groups": sorted(self.groups),
            "adapters": sorted(self.adapters),
            "lora": self.lora,
        }

    def do_health(self, body: None) -> tuple[int, Any]:
        return 200, None

    def do_get_model_info(self, body: None) -> tuple[int, Any]:
        return 200, {"model_path": "fake", "weight_version": self.weight_version}

    def wait_for_count(self, count: str, at_least: int) -> tuple[int, Any]:
        """Block until self.<count> (arrived, aborted) reaches `at_least`: 200, or 504."""
        with self.changed:
            ok = self.changed.wait_for(lambda: getattr(self, count) >= at_least, WAIT_S)
        return (200, None) if ok else (504, {"error": f"{count} < {at_least} after {WAIT_S}s"})

    def _wait(self, until: Callable[[], bool], what: str) -> None:
        with self.changed:
            if not self.changed.wait_for(until, WAIT_S):
                raise TimeoutError(f"fake SGLang: no {what} within {WAIT_S}s")

    def do_generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        adapter = body.get("lora_path")
        if adapter is not None and adapter not in self.adapters:
            return 400, {
                "error": f"The following requested LoRA adapters are not loaded: {adapter}"
            }
        self.in_use[adapter or ""] += 1
        try:
            return self.generate(body, adapter)
        finally:
            self.in_use[adapter or ""] -= 1

    def generate(self, body: dict[str, Any], adapter: str | None) -> tuple[int, Any]:
        params = body["sampling_params"]
        n = params["max_new_tokens"]
        with self.changed:
            held, self.hold = self.hold > 0, max(0, self.hold - 1)
            self.arrived += 1
            self.changed.notify_all()
        if held:  # a decode in flight until the test's pause catches it
            self._wait(lambda: self.paused, "pause for a held request")
        if self.paused and self.mode == "abort":
            with self.changed:
                self.aborted += 1
                self.changed.notify_all()
            meta = {"finish_reason": {"type": "abort", "message": "paused"},
                    "weight_version": self.weight_version, "output_token_logprobs": []}  # fmt: skip
            return 200, {"text": "", "output_ids": [], "meta_info": meta}
        self._wait(lambda: not self.paused, "continue")  # retract: it waits in the queue
        ids = [(sum(body["input_ids"]) + i) % 50 + 3 for i in range(n)]
        lp = self.logprob(adapter)
        meta = {
            "id": "r",
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(body["input_ids"]),
            "weight_version": self.weight_version,
            "output_token_logprobs": [[lp, i, None] for i in ids],
        }
        return 200, {"text": "", "output_ids": ids, "meta_info": meta}

    def do_load_lora_adapter(self, body: dict[str, Any]) -> tuple[int, Any]:
        from safetensors.torch import load_file

        name, folder = body["lora_name"], Path(body["lora_path"])
        config = json.loads((folder / "adapter_config.json").read_text())
        if self.lora is None:
            problem = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        elif name in self.adapters:
            problem = f"LoRA with name {name} already exists."
        elif config["r"] > self.lora["rank"] or not set(config["target_modules"]) <= set(
            self.lora["targets"]
        ):
            problem = f"LoRA adapter {name} does not fit --max-lora-rank / --lora-target-modules"
        else:
            self.adapters[name] = load_file(str(folder / "adapter_model.safetensors"))
            paths = {n: "loaded" for n in self.adapters}
            return 200, {"success": True, "error_message": "", "loaded_adapters": paths}
        return 400, {"success": False, "error_message": problem}

    def do_unload_lora_adapter(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = body["lora_name"]
        if name not in self.adapters:
            return 400, {
                "success": False,
                "error_message": f"LoRA with name {name} does not exist.",
            }
        if self.in_use[name]:
            self.violations.append(
                f"unload of {name} while {self.in_use[name]} request(s) run on it"
            )
            return 400, {"success": False, "error_message": "in use"}
        del self.adapters[name]
        return 200, {"success": True, "error_message": "", "loaded_adapters": {}}

    def do_pause_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.set_paused(True, body.get("mode", "abort"))
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def do_continue_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.set_paused(False)
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def set_paused(self, paused: bool, mode: str = "") -> None:
        with self.changed:
            self.paused, self.mode = paused, mode or self.mode
            self.changed.notify_all()

    def do_begin_weight_update(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.session = True
        return 200, {"success": True, "message": ""}

    def do_end_weight_update(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.session = False
        return 200, {"success": True, "message": ""}

    def do_init_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper

        timeout = datetime.timedelta(seconds=20)
        rank, world, name = body["rank_offset"], body["world_size"], body["group_name"]
        init = f"tcp://{body['master_address']}:{body['master_port']}"
        store, _, _ = next(dist.rendezvous(init, rank, world, timeout=timeout))
        pg, _ = _new_process_group_helper(
            world, rank, [], Backend(body["backend"]), dist.PrefixStore(name, store),
            group_name=name, timeout=timeout,
        )  # fmt: skip
        self.groups[name] = pg
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def do_update_weights_from_distributed(self, body: dict[str, Any]) -> tuple[int, Any]:
        import torch.distributed as dist

        if self.sessions and not self.session:
            return 400, {"success": False, "message": "must run between begin/end_weight_update"}
        pg = self.groups[body["group_name"]]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        received, works = [], []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            works.append(pg.broadcast([t], opts))
            received.append((name, t))
        for work in works:
            work.wait(datetime.timedelta(seconds=20))
        self.weights.update(received)
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def do_destroy_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        pg = self.groups.pop(body["group_name"], None)
        if pg is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        pg.shutdown()
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, body: dict[str, Any] | None) -> None:
                status, reply = fake.handle(self.path, body)
                data = b"" if reply is None else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._reply(None)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                self._reply(json.loads(self.rfile.read(length) or b"{}"))

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


def serve(argv: list[str]) -> None:
    """Entry point of the fake managed server: parses sglang.launch_server's flags (the
    ones the engine sends) as SGLang does; unknown flags are an error."""
    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--host", "--dtype"):
        parser.add_argument(flag, required=True)
    for flag in ("--port", "--tp-size", "--random-seed", "--context-length", "--max-lora-rank"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--lora-target-modules", nargs="*")
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--enable-lora", action="store_true")
    args = parser.parse_args(argv)
    time.sleep(float(os.environ.get("FAKE_SGLANG_START_DELAY", "0.3")))  # "loading the model"
    lora = None
    if args.enable_lora:
        lora = {"rank": args.max_lora_rank, "targets": args.lora_target_modules,
                "per_batch": args.max_loras_per_batch}  # fmt: skip
    fake = FakeSGLang(os.environ.get("FAKE_SGLANG_SESSIONS", "1") == "1", lora)
    server = ThreadingHTTPServer((args.host, args.port), fake.handler())
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    serve(sys.argv[1:])
    sys.exit(0)


# ------------------------------------------------------------------ tests
from drmas.actors.engines import sglang as sg  # noqa: E402
from drmas.actors.engines import sglang_requests as sq  # noqa: E402
from drmas.actors.engines import sglang_server as ss  # noqa: E402
from drmas.actors.engines.base import GenerateRequest  # noqa: E402
from drmas.config.actor import EngineConfig  # noqa: E402
from drmas.config.transport import WeightSyncConfig  # noqa: E402
from drmas.protocol.messages import JoinWeightGroup  # noqa: E402
from drmas.transports.digest import digest_of  # noqa: E402
from drmas.transports.weights import WeightReceiver, WeightSender  # noqa: E402
from tests.unit import test_sglang_contract  # noqa: E402, F401  (parses SGLang's types here, in the main thread)

REQ = GenerateRequest([1, 2, 3], temperature=1.0, top_p=1.0, max_new_tokens=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from drmas.models.builtin import char_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    char_tokenizer().save_pretrained(folder)
    return folder


def options(**kw: Any) -> ss.SGLangOptions:
    base = {"command": [sys.executable, str(Path(__file__).resolve())],
            "start_timeout_s": 20.0, "control_timeout_s": 10.0, "request_timeout_s": 20.0,
            "weight_timeout_s": 20.0}  # fmt: skip
    base.update(kw)
    return ss.SGLangOptions(**base)


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(40, 16, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(32, 16, generator=g).bfloat16()),
        ("model.norm.weight", torch.randn(16, generator=g)),
        ("lm_head.weight", torch.randn(40, 16, generator=g)),
    ]


def expected_logprob(named: list[tuple[str, torch.Tensor]]) -> float:
    total = sum(float(t.double().sum()) for _, t in named)
    return -(0.1 + (total - math.floor(total)))


async def publish(engine: sg.SGLangEngine, sender: WeightSender, version: int) -> list:
    """What the actor's sync_weights does, with the learner's side in a thread."""
    named = tensors(version)
    name = f"m-v{version}"
    join = JoinWeightGroup("m", version, name, sender.store_address, 1, 2, 20.0)
    learner = asyncio.create_task(asyncio.to_thread(sender.publish, name, 2, named, 20.0))
    await engine.pause()
    try:
        await asyncio.to_thread(
            WeightReceiver().receive_into, join, lambda b: engine.load_weights(b, version)
        )
    finally:
        await engine.resume()
    await learner
    return named


def fake_state(engine: sg.SGLangEngine) -> dict[str, Any]:
    return sq.http_call(engine.url, "/_fake/state", None, 5.0)[1]  # type: ignore[no-any-return]


async def hold_next(engine: sg.SGLangEngine) -> None:
    """The fake keeps the next /generate in flight until a pause arrives."""
    status, _ = await asyncio.to_thread(sq.http_call, engine.url, "/_fake/hold", {}, 5.0)
    assert status == 200


async def fake_reached(engine: sg.SGLangEngine, count: str, at_least: int) -> None:
    """Wait until the fake's `count` (arrived: /generate requests received; aborted: those
    it answered "abort") reaches `at_least`."""
    body = {"count": count, "at_least": at_least}
    status, reply = await asyncio.to_thread(
        sq.http_call, engine.url, "/_fake/wait", body, WAIT_S + 5.0
    )
    assert status == 200, reply


def test_managed_server_generates_pauses_takes_weights_and_stops(model_dir: Path) -> None:
    engine = sg.SGLangEngine("m", model_dir, EngineConfig(), options())
    sender = WeightSender(WeightSyncConfig(bucket_mb=0.002))  # several buckets per publish

    async def main() -> None:
        await engine.start()
        assert engine.tokenizer is not None and engine.server is not None
        proc = engine.server.proc
        assert proc is not None and proc.poll() is None
        try:
            first = await asyncio.gather(*(engine.generate(REQ) for _ in range(8)))
            assert all(r.finish_reason == "length" and len(r.token_ids) == 4 for r in first)
            assert all(r.logprobs == [-0.1] * 4 and r.version == 0 for r in first)
            # a request in flight when the pause comes (keep -> retract) finishes after it
            await hold_next(engine)
            inflight = asyncio.create_task(engine.generate(REQ))
            await fake_reached(engine, "arrived", 9)
            for version in (1, 2):
                named = await publish(engine, sender, version)
                assert engine.version == version
                assert await asyncio.to_thread(engine.server_weight_version) == str(version)
                state = fake_state(engine)
                assert state["violations"] == []
                assert state["digest"] == digest_of(named) == engine.weights_digest()
                after = await engine.generate(REQ)
                assert after.version == version
                assert after.logprobs == pytest.approx([expected_logprob(named)] * 4, abs=1e-6)
            assert (await inflight).finish_reason == "length"
            routes = state["routes"]
            assert routes.count("/init_weights_update_group") == 1  # the bridge is reused
            assert routes.count("/pause_generation") == routes.count("/continue_generation") == 2
            assert routes.count("/begin_weight_update") == routes.count("/end_weight_update") == 2
            assert routes.count("/update_weights_from_distributed") > 2  # one per bucket
        finally:
            await engine.close()
        assert proc.wait(10) is not None and engine.server.proc is None
        assert fake_state_gone(engine)

    asyncio.run(asyncio.wait_for(main(), 60))


def fake_state_gone(engine: sg.SGLangEngine) -> bool:
    with pytest.raises(sq.SGLangHTTPError, match="is the server running"):
        sq.http_call(engine.url, "/health", None, 2.0)
    return True


def test_url_mode_abort_pause_resubmits_and_old_server_has_no_sessions(model_dir: Path) -> None:
    """A server at a URL (in a thread here), abort mode, a server that predates the
    begin/end_weight_update session (404): the adapter works without it."""
    fake = FakeSGLang(sessions=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    engine = sg.SGLangEngine("m", model_dir, EngineConfig(), options(url=url, pause_mode="abort"))

    async def main() -> None:
        await engine.start()
        try:
            await hold_next(engine)
            inflight = asyncio.create_task(engine.generate(REQ))
            await fake_reached(engine, "arrived", 1)
            await engine.pause()
            await fake_reached(engine, "aborted", 1)  # the engine resubmits it after resume
            assert not inflight.done()
            engine._session_call("/begin_weight_update", sq.begin_update_body())
            assert not engine._sessions_supported
            await engine.resume()
            result = await inflight
            assert result.finish_reason == "length" and len(result.token_ids) == 4
            fake.set_paused(True, "abort")  # the server aborts on its own: an error
            with pytest.raises(sq.SGLangHTTPError, match="aborted a request"):
                await engine.generate(REQ)
            fake.set_paused(False)
        finally:
            await engine.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        server.shutdown()
    assert fake.violations == []
    # aborted by our pause and run again once resumed (a resubmission while still paused
    # would have been aborted as well, and failed), then the server's own abort: an error
    assert fake.routes.count("/generate") == 3 and fake.aborted == 2


def test_managed_server_that_exits_reports_its_log(model_dir: Path) -> None:
    crash = [sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)"]
    engine = sg.SGLangEngine("m", model_dir, EngineConfig(), options(command=crash))
    with pytest.raises(RuntimeError, match=r"exited with code 3(.|\n)*CUDA out of memory"):
        asyncio.run(engine.start())


def test_managed_server_never_ready_times_out_and_is_killed(model_dir: Path) -> None:
    hang = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
            "signal.SIG_IGN); time.sleep(60)"]  # fmt: skip
    engine = sg.SGLangEngine(
        "m", model_dir, EngineConfig(), options(command=hang, start_timeout_s=1.0)
    )
    with pytest.raises(TimeoutError, match="not ready within 1s"):
        asyncio.run(engine.start())
    assert engine.server is not None and engine.server.proc is None  # stopped (killed)


# ------------------------------------------------------------------ LoRA
from drmas.actors.engines.lora_folders import initial_adapter_tensors  # noqa: E402
from drmas.actors.engines.sglang_lora import SGLangAdapters  # noqa: E402
from drmas.models.lora import adapter_of_param  # noqa: E402
from tests.unit.lora_helpers import (  # noqa: E402
    ADAPTERS,
    LORA,
    peft_model,
    published,
    tiny_model_folder,
)


@pytest.fixture(scope="module")
def lora_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer and a tiny Qwen2's config: what the engine reads of a LoRA base."""
    from drmas.models.builtin import char_tokenizer

    folder = tmp_path_factory.mktemp("lora-base")
    char_tokenizer().save_pretrained(folder)
    return tiny_model_folder(folder)


async def publish_adapters(
    engine: sg.SGLangEngine,
    sender: WeightSender,
    model: Path,
    version: int,
    adapters: tuple[str, ...] = tuple(ADAPTERS),
    while_paused: Callable[[], None] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """A LoRA publish as the actor's sync_weights runs it: the tensors of `adapters` only.
    `while_paused` runs after the load and before the resume (a request held by the pause
    is still in flight then)."""
    named = [
        (n, t)
        for n, t in published(peft_model(model, seed=version))
        if adapter_of_param(n) in adapters
    ]
    name = f"m-v{version}"
    join = JoinWeightGroup("m", version, name, sender.store_address, 1, 2, 20.0)
    learner = asyncio.create_task(asyncio.to_thread(sender.publish, name, 2, named, 20.0))
    await engine.pause()
    try:
        await asyncio.to_thread(
            WeightReceiver().receive_into, join, lambda b: engine.load_weights(b, version)
        )
        if while_paused is not None:
            while_paused()
    finally:
        await engine.resume()
    await learner
    return named


def adapter_logprob(named: list[tuple[str, torch.Tensor]], adapter: str) -> float:
    return expected_logprob([(n, t) for n, t in named if f".{adapter}." in n])


def test_lora_adapters_load_per_version_and_old_ones_unload_once_unused(
    lora_model_dir: Path,
) -> None:
    engine = sg.SGLangEngine(
        "m", lora_model_dir, EngineConfig(), options(), lora=LORA, adapters=ADAPTERS
    )
    sender = WeightSender(WeightSyncConfig(bucket_mb=0.001))  # several buckets per publish

    def on(adapter: str) -> GenerateRequest:
        return GenerateRequest([1, 2, 3], 1.0, 1.0, 4, adapter=adapter)

    async def main() -> None:
        await engine.start()
        try:
            assert fake_state(engine)["lora"] == {
                "rank": 4, "targets": LORA.target_modules, "per_batch": 5
            }  # fmt: skip
            first = await engine.generate(on("solver"))  # before any publish: the base
            assert first.logprobs == [-0.1] * 4 and first.version == 0
            v1 = await publish_adapters(engine, sender, lora_model_dir, 1)
            assert engine.version == 1 and engine.weights_digest() == digest_of(v1)
            assert fake_state(engine)["adapters"] == ["solver-v1-1", "verifier-v1-2"]
            for adapter in ADAPTERS:
                result = await engine.generate(on(adapter))
                assert result.logprobs == pytest.approx([adapter_logprob(v1, adapter)] * 4)
            # a solver request in flight across the next publish finishes on solver v1
            await hold_next(engine)
            inflight = asyncio.create_task(engine.generate(on("solver")))
            await fake_reached(engine, "arrived", 4)
            during: list[list[str]] = []  # the old solver is kept while its request runs

            def loaded() -> None:
                during.append(fake_state(engine)["adapters"])

            v2 = await publish_adapters(engine, sender, lora_model_dir, 2, while_paused=loaded)
            # while paused v2 is staged beside v1: nothing switches before the load is
            # verified; v1's verifier unloads when v2 serves, v1's solver once unused
            assert during == [["solver-v1-1", "solver-v2-3", "verifier-v1-2", "verifier-v2-4"]]
            old = await inflight
            assert old.version == 1
            assert old.logprobs == pytest.approx([adapter_logprob(v1, "solver")] * 4)
            state = fake_state(engine)
            assert state["adapters"] == ["solver-v2-3", "verifier-v2-4"]  # unloaded when unused
            new = await engine.generate(on("solver"))
            assert new.version == 2
            assert new.logprobs == pytest.approx([adapter_logprob(v2, "solver")] * 4)
            assert state["violations"] == []
            assert "/init_weights_update_group" not in state["routes"]  # no bridge for LoRA
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert engine.adapters is not None and engine.adapters.root is None


def test_lora_publish_of_one_adapter_leaves_the_other_serving(lora_model_dir: Path) -> None:
    """The verifier alone (v1, several buckets): loaded as a new version, the solver still
    on the base, the digest over the solver's initial tensors and the verifier sent; then
    the solver alone (v2): the verifier keeps its v1 (the same version object), the digest
    covers both as sent; then a publish of nothing (v3): the version only."""
    engine = sg.SGLangEngine(
        "m", lora_model_dir, EngineConfig(), options(), lora=LORA, adapters=ADAPTERS
    )
    sender = WeightSender(WeightSyncConfig(bucket_mb=0.001))
    initial = initial_adapter_tensors(lora_model_dir, LORA, ADAPTERS)

    def on(adapter: str) -> GenerateRequest:
        return GenerateRequest([1, 2, 3], 1.0, 1.0, 4, adapter=adapter)

    async def main() -> None:
        await engine.start()
        assert engine.adapters is not None
        try:
            v1 = await publish_adapters(engine, sender, lora_model_dir, 1, ("verifier",))
            assert engine.version == 1 and fake_state(engine)["adapters"] == ["verifier-v1-1"]
            solver_v0 = [(n, t) for n, t in initial if ".solver." in n]
            assert engine.weights_digest() == digest_of(solver_v0 + v1)
            assert (await engine.generate(on("solver"))).logprobs == [-0.1] * 4  # the base
            verifier = engine.adapters.slots.current["verifier"]
            v2 = await publish_adapters(engine, sender, lora_model_dir, 2, ("solver",))
            assert fake_state(engine)["adapters"] == ["solver-v2-2", "verifier-v1-1"]
            assert engine.adapters.slots.current["verifier"] is verifier
            assert engine.weights_digest() == digest_of(v1 + v2)
            for adapter, sent in (("solver", v2), ("verifier", v1)):
                result = await engine.generate(on(adapter))
                assert result.version == 2
                assert result.logprobs == pytest.approx([adapter_logprob(sent, adapter)] * 4)
            routes = len(fake_state(engine)["routes"])
            await engine.pause()
            engine.load_weights([], 3)  # a publish that carried no tensors
            await engine.resume()
            assert engine.version == 3 and engine.weights_digest() == digest_of(v1 + v2)
            state = fake_state(engine)
            assert state["adapters"] == ["solver-v2-2", "verifier-v1-1"]
            assert [r for r in state["routes"][routes:] if "lora" in r] == []
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_lora_publish_that_fails_leaves_the_previous_adapters(lora_model_dir: Path) -> None:
    """The actor's failure path (backup_weights / restore_weights) on a LoRA base: a
    publish naming an unknown adapter, or one the server refuses half-way, switches
    nothing, and what was loaded of it is unloaded again."""
    calls: list[tuple[str, str]] = []
    refuse = {"verifier-v1-2"}

    def call(route: str, body: dict[str, Any]) -> Any:
        calls.append((route, body["lora_name"]))
        if body["lora_name"] in refuse and route == "/load_lora_adapter":
            raise sq.SGLangHTTPError(f"SGLang server at x: {route} answered 400: rank")
        return {"success": True}

    adapters = SGLangAdapters("m", lora_model_dir, LORA, ADAPTERS, call)
    adapters.start()
    named = published(peft_model(lora_model_dir, seed=1))
    with pytest.raises(sq.SGLangHTTPError, match="answered 400"):
        adapters.receive(named, 1)
    assert calls == [
        ("/load_lora_adapter", "solver-v1-1"), ("/load_lora_adapter", "verifier-v1-2"),
        ("/unload_lora_adapter", "solver-v1-1"),
    ]  # fmt: skip
    assert adapters.slots.current == {} and adapters.digest == ""
    assert adapters.root is not None and list(adapters.root.iterdir()) == []
    critic = [(n.replace(".verifier.", ".critic."), t) for n, t in named]
    with pytest.raises(ValueError, match=r"'base_model\..*critic.*', not a tensor of adapters"):
        adapters.receive(critic[:5], 2)
    refuse.clear()
    assert adapters.receive(named, 3) and adapters.commit() == 3
    assert adapters.digest == digest_of(named) and sorted(adapters.slots.current) == ADAPTERS
    adapters.close()
