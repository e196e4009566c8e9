"""`drmas status ADDRESS [--keys DIR]`: ask a running broker what is attached.

    drmas status ── StatusRequest ──> broker ── StatusReply ──> tables (or --json) on stdout

One request, answered from the broker's state; it changes nothing there."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from drmas.protocol.messages import StatusReply


def print_status(
    address: str, *, as_json: bool, timeout_s: float, keys_dir: str = "", client_name: str = ""
) -> int:
    """Ask once; a CURVE broker needs keys_dir and one of its client key pairs. Exit code 0
    printed, 1 the broker did not answer in `timeout_s`, 2 the keys are unusable."""
    reply = ask_status(address, timeout_s, keys_dir, client_name)
    if isinstance(reply, int):
        return reply
    if as_json:
        print(json.dumps(msgspec.to_builtins(reply), indent=2, sort_keys=True))
    else:
        print_tables(reply)
    return 0


def ask_status(
    address: str, timeout_s: float, keys_dir: str, client_name: str
) -> StatusReply | int:
    """The broker's StatusReply, or the exit code after printing why there is none."""
    from drmas.config.transport import SecurityConfig
    from drmas.protocol.messages import StatusReply, StatusRequest
    from drmas.transports.channel import BrokerClient, BrokerUnavailable
    from drmas.transports.security import SecurityError, find_client

    if keys_dir and not client_name:  # any authorised pair may ask; prefer "default"
        client_name = find_client(Path(keys_dir).expanduser().resolve())
    security = SecurityConfig(curve=bool(keys_dir), keys_dir=keys_dir, client_name=client_name)
    try:
        client = BrokerClient(address, f"status-{os.getpid()}", security=security)
    except SecurityError as exc:
        print(f"drmas status: {exc}", file=sys.stderr)
        return 2
    try:
        return client.request(StatusRequest(), StatusReply, timeout_s)
    except BrokerUnavailable as exc:
        hint = (
            "" if keys_dir else " (a broker with security.curve=true answers only with --keys DIR)"
        )
        print(f"drmas status: {exc}{hint}", file=sys.stderr)
        return 1
    finally:
        client.close()


def print_tables(reply: StatusReply) -> None:
    """The run's line, then tables of models, actors and counters."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"run {reply.run_id}  up {reply.uptime_s:.0f}s  in flight {reply.in_flight_groups} groups"
        f"  done={reply.done}"
    )
    models = Table("model", "version", "buffered groups", "batches cut", "learner ranks")
    for name, m in sorted(reply.models.items()):
        models.add_row(
            name, str(m.version), str(m.buffered_groups), str(m.batches_cut), str(m.learner_ranks)
        )
    console.print(models)
    actors = Table("actor", "host", "pid", "versions", "leases", "groups", "episodes", "last seen")
    for a in reply.actors:
        versions = " ".join(f"{k}=v{v}" for k, v in sorted(a.versions.items()))
        actors.add_row(
            a.client_id,
            a.host,
            str(a.pid),
            versions,
            str(a.leases),
            str(a.groups_done),
            str(a.episodes_done),
            f"{a.last_seen_s:.1f}s ago",
        )
    console.print(actors)
    counters = Table("counter", "value")
    for k, v in sorted(reply.counters.items()):
        counters.add_row(k, str(v))
    console.print(counters)
