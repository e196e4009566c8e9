"""`drmas status RUN_DIR|ADDRESS [--keys DIR]`: ask a running broker what is attached.

    drmas status ── StatusRequest ──> broker ── StatusReply ──> tables (or --json) on stdout

One request, answered from the broker's state; it changes nothing there. Given a run
folder, the broker's address (and, for a CURVE broker, its keys folder) is read from the
RUN_DIR/config.yaml that `drmas train` / `drmas prepare` wrote."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import yaml
import zmq

if TYPE_CHECKING:
    from drmas.config.transport import SecurityConfig
    from drmas.protocol.messages import StatusReply


class StatusError(ValueError):
    """What was given names no broker; the message says what to pass."""


@dataclass
class Broker:
    """Where to ask: its address, the keys folder of a CURVE broker ("" = none) and the
    run folder it was found in (None: an address was given)."""

    address: str
    keys_dir: str = ""
    run_dir: Path | None = None


def find_broker(target: str, keys_dir: str = "") -> Broker:
    """`target` is a broker address (tcp://HOST:PORT, ipc://, inproc://) or a run folder
    (or its config.yaml); `keys_dir`, when given, wins over the run's. StatusError when it
    is neither."""
    if "://" in target:
        return Broker(target, keys_dir)
    path = Path(target).expanduser()
    config = path / "config.yaml" if path.is_dir() else path
    if not config.is_file():
        raise StatusError(
            f"{target!r} is neither a broker address nor a run folder ({config} does not "
            "exist). Pass the run folder `drmas train` printed (its config.yaml names the "
            "broker) or the broker's address, e.g. tcp://127.0.0.1:5555 (broker.address)"
        )
    saved = _read_yaml(config)
    broker, security = saved.get("broker") or {}, saved.get("security") or {}
    address = broker.get("address") if isinstance(broker, dict) else None
    if not isinstance(address, str) or "://" not in address or address.endswith(":0"):
        raise StatusError(
            f"{config} names no broker address to reach (broker.address={address!r}); pass "
            "the broker's address instead, e.g. tcp://127.0.0.1:5555"
        )
    if not keys_dir and isinstance(security, dict) and security.get("curve"):
        keys_dir = str(security.get("keys_dir") or "")
    return Broker(_reachable(address), keys_dir, config.parent)


def _read_yaml(config: Path) -> dict[str, Any]:
    try:
        saved = yaml.safe_load(config.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise StatusError(f"cannot read {config}: {exc}") from None
    if not isinstance(saved, dict):
        raise StatusError(f"{config} is not a drmas config (a mapping of settings)")
    return saved


def _reachable(address: str) -> str:
    """The broker's bind address as a client connects to it: a wildcard host (* or
    0.0.0.0) means this machine."""
    scheme, _, rest = address.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme == "tcp" and sep and host in ("*", "0.0.0.0"):
        return f"tcp://127.0.0.1:{port}"
    return address


def print_status(
    target: str, *, as_json: bool, timeout_s: float, keys_dir: str = "", client_name: str = ""
) -> int:
    """Ask once; `target` is a run folder or a broker address; a CURVE broker needs a keys
    folder (given, or the run's) and one of its client key pairs. Exit code 0 printed, 1 the
    broker did not answer in `timeout_s`, 2 nothing to ask or the keys are unusable."""
    try:
        broker = find_broker(target, keys_dir)
    except StatusError as exc:
        print(f"drmas status: {exc}", file=sys.stderr)
        return 2
    reply = ask_status(broker.address, timeout_s, broker.keys_dir, client_name)
    ended = broker.run_dir is not None and (broker.run_dir / "train_summary.json").exists()
    if isinstance(reply, int) and reply == 1 and ended:
        print(
            f"drmas status: the last drmas train in {broker.run_dir} has ended "
            "(train_summary.json): a run that is not running has no broker to ask",
            file=sys.stderr,
        )
    if isinstance(reply, int):
        return reply
    if as_json:
        print(json.dumps(msgspec.to_builtins(reply), indent=2, sort_keys=True))
    else:
        print_tables(reply)
    return 0


RETRY_S = (0.2, 2.0)
"""`drmas status`'s first and longest wait (doubling) before it asks again on a fresh
connection, after the broker closed its connection without answering."""


def ask_status(
    address: str, timeout_s: float, keys_dir: str, client_name: str
) -> StatusReply | int:
    """The broker's StatusReply, or the exit code after printing why there is none.
    A connection the broker closes before answering (a cap full of others' connections)
    is tried again on a fresh one, until `timeout_s` is spent."""
    from drmas.config.transport import SecurityConfig
    from drmas.transports.channel import BrokerRefused, BrokerUnavailable
    from drmas.transports.security import SecurityError, find_client

    if keys_dir and not client_name:  # any authorised pair may ask; prefer "default"
        client_name = find_client(Path(keys_dir).expanduser().resolve())
    security = SecurityConfig(curve=bool(keys_dir), keys_dir=keys_dir, client_name=client_name)
    # a plain client at a CURVE broker times out, or sees its connection closed three times
    # (how soon depends on the machine's speed): either way, the way out is --keys
    hint = "" if keys_dir else " (a broker with security.curve=true answers only with --keys DIR)"
    deadline = time.monotonic() + timeout_s
    wait, attempt = RETRY_S[0], 0
    while True:
        attempt += 1
        try:
            return _ask_once(address, f"status-{os.getpid()}-{attempt}", security, deadline)
        except SecurityError as exc:
            print(f"drmas status: {exc}", file=sys.stderr)
            return 2
        except zmq.ZMQError as exc:  # not an address ZeroMQ can connect to
            print(
                f"drmas status: cannot connect to {address!r} ({exc}); pass a broker address "
                "such as tcp://127.0.0.1:5555, or a run folder",
                file=sys.stderr,
            )
            return 2
        except BrokerUnavailable as exc:
            print(f"drmas status: {exc}{hint}", file=sys.stderr)
            return 1
        except BrokerRefused as exc:  # e.g. closed at a connection cap, with which one
            if exc.code == "closed" and time.monotonic() + wait < deadline:
                time.sleep(wait)  # the cap may have room by then: ask on a fresh connection
                wait = min(2 * wait, RETRY_S[1])
                continue
            tries = f" ({attempt} connections in {timeout_s:g} s)" if attempt > 1 else ""
            print(
                f"drmas status: {exc}{tries}{hint if exc.code == 'closed' else ''}", file=sys.stderr
            )
            return 1


def _ask_once(address: str, name: str, security: SecurityConfig, deadline: float) -> StatusReply:
    """One StatusRequest on a fresh connection, answered before `deadline` or raised."""
    from drmas.protocol.messages import StatusReply, StatusRequest
    from drmas.transports.channel import HELLO_CLOSES, BrokerClient

    client = BrokerClient(address, name, security=security)
    try:
        # closed at once (a connection cap) is said so, not left to time out
        left = max(0.001, deadline - time.monotonic())
        return client.request(StatusRequest(), StatusReply, left, max_closes=HELLO_CLOSES)
    finally:
        client.close()


def print_tables(reply: StatusReply) -> None:
    """The run's line, then tables of models, actors and counters."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # every name below comes from a client of the broker: printed as text, never as markup
    console = Console()
    console.print(
        f"run {escape(reply.run_id)}  up {reply.uptime_s:.0f}s  in flight {reply.in_flight_groups} groups"
        f"  done={reply.done}"
    )
    models = Table("model", "version", "buffered groups", "batches cut", "learner ranks")
    for name, m in sorted(reply.models.items()):
        models.add_row(
            escape(name),
            str(m.version),
            str(m.buffered_groups),
            str(m.batches_cut),
            str(m.learner_ranks),
        )
    console.print(models)
    actors = Table("actor", "host", "pid", "versions", "leases", "groups", "episodes", "last seen")
    for a in reply.actors:
        versions = " ".join(f"{k}=v{v}" for k, v in sorted(a.versions.items()))
        actors.add_row(
            escape(a.client_id),
            escape(a.host),
            str(a.pid),
            escape(versions),
            str(a.leases),
            str(a.groups_done),
            str(a.episodes_done),
            f"{a.last_seen_s:.1f}s ago",
        )
    console.print(actors)
    counters = Table("counter", "value")
    for k, v in sorted(reply.counters.items()):
        counters.add_row(escape(k), str(v))
    console.print(counters)
