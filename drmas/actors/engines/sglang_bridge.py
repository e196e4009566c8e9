"""The actor's side of a weight update into an SGLang server: re-broadcast what arrived.

Who talks to whom:

    learner rank 0 --(drmas weight group, WeightSender -> WeightReceiver)--> actor process
    actor process  --(bridge group, this module, rank 0)--> SGLang server (ranks 1..tp)
    actor process  --(HTTP: SGLangEngine)--> SGLang server, to make it join and receive

SGLang joins a group by its own rendezvous (`init_weights_update_group`): it connects a
TCPStore client to `master_address:master_port`, namespaces it by the group name and
builds the group with torch's process-group helper; its tensor-parallel rank r becomes
rank `rank_offset + r`. Each `update_weights_from_distributed` then receives one
broadcast from rank 0 per named tensor, in the order of its `names`. This module is that
rank 0: it hosts the store, builds its side of the group with the same torch helper (so
the store keys match whatever the installed torch uses) and broadcasts tensors one by one.

Backend: gloo, always. The actor process holds no GPU of its own, and NCCL cannot put two
ranks of one communicator on the GPU the server already uses; gloo broadcasts into the
server's CUDA tensors (it stages through host memory), which costs a host copy on a link
that is the same machine's memory bus anyway.

The group lives as long as the engine (one rendezvous, not one per publish); any failure
tears it down (abort, never waiting on the peer) and the next publish builds a new one
under a new name. Every wait (rendezvous, each broadcast) has the bridge's timeout.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("drmas.engine.sglang")

_names = itertools.count()


class BridgeError(RuntimeError):
    """The actor -> SGLang weight group failed; the message says where and what to do."""


class WeightBridge:
    """Rank 0 of a gloo group whose other ranks are one SGLang server's TP workers."""

    def __init__(self, host: str, server_ranks: int, timeout_s: float, tag: str) -> None:
        self.host = host
        self.world_size = 1 + server_ranks
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group_name = f"drmas-bridge-{tag}-{next(_names)}"
        self.store: Any = None
        self.pg: Any = None

    @property
    def port(self) -> int:
        return int(self.store.port)

    def listen(self) -> None:
        """Host the rendezvous store (free port) before the server is told to connect."""
        self.store = dist.TCPStore(
            self.host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout
        )

    def connect(self) -> None:
        """Rendezvous with the server's ranks (they are joining through HTTP meanwhile)."""
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper

        start = time.monotonic()
        try:
            store = dist.PrefixStore(self.group_name, self.store)
            self.pg, _ = _new_process_group_helper(
                self.world_size,
                0,
                [],
                Backend("gloo"),
                store,
                group_name=self.group_name,  # type: ignore[arg-type]
                timeout=self.timeout,
            )
        except RuntimeError as exc:
            raise BridgeError(
                f"SGLang weight bridge {self.group_name!r}: rendezvous with the server's "
                f"{self.world_size - 1} rank(s) at {self.host}:{self.port} failed after "
                f"{time.monotonic() - start:.1f}s ({_first_line(exc)}); check that the server "
                "can reach this address (actor.engine.sglang_bridge_host)"
            ) from None

    def broadcast(
        self, tensors: Sequence[torch.Tensor], during: Callable[[], None] | None = None
    ) -> None:
        """Send each tensor (in order: one broadcast each, as SGLang receives them), all
        queued at once, then wait for all within the timeout."""
        if self.pg is None:
            raise BridgeError(f"SGLang weight bridge {self.group_name!r} is not connected")
        start = time.monotonic()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        try:
            works = [self.pg.broadcast([t.detach().contiguous()], opts) for t in tensors]
            for work in works:
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise BridgeError(
                f"SGLang weight bridge {self.group_name!r}: broadcast of {len(tensors)} "
                f"tensor(s) failed after {time.monotonic() - start:.1f}s "
                f"(timeout {self.timeout.total_seconds():.0f}s): {_first_line(exc)}; the "
                "server may be stuck or gone: check its log"
            ) from None

    def close(self, ok: bool) -> None:
        """Tear down: shutdown after success, abort (never waits for the peer) otherwise."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown() if ok else pg.abort()
            except RuntimeError as exc:
                log.debug("closing %s: %s", self.group_name, exc)
        self.store = None


class Rendezvous:
    """Run `call` (a blocking HTTP request that makes the server join or receive) in a
    thread while this thread does its side, then collect the call's result in time."""

    def __init__(self, call: Callable[[], Any], what: str, timeout_s: float) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True, name=what)
        self.thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.result = call()
        except BaseException as exc:
            self.error = exc

    def join(self) -> Any:
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            raise BridgeError(
                f"{self.what}: no answer from the SGLang server within {self.timeout_s:.0f}s"
            )
        if self.error is not None:
            raise self.error
        return self.result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
