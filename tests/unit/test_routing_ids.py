"""A client cannot crash the broker by taking the routing id libzmq would give the next
connection: the broker's ROUTER (bind_router) numbers connections from a counter seeded by
the OS, so it no longer starts at libc's unseeded 0x6B8B4567, and two brokers start apart;
and the broker's logs name connections by a keyed hash, never by their id."""

from __future__ import annotations

import subprocess
import sys

from drmas.broker.peer_label import peer_label

UNSEEDED_FIRST = bytes.fromhex("006b8b4567")  # what every broker gave out first before

ATTACK = """
import sys, zmq
from drmas.config.transport import SecurityConfig
from drmas.transports.channel import bind_router
ctx = zmq.Context()
router, address = bind_router(ctx, "tcp://127.0.0.1:0", 1 << 20, SecurityConfig())
squatters = []
for n in range(8):  # the ids an unseeded counter hands out first, taken ahead of time
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, bytes.fromhex("00") + (0x6B8B4567 + n).to_bytes(4, "big"))
    s.connect(address)
    s.send(b"squat")
    assert router.poll(30_000)
    router.recv_multipart()
    squatters.append(s)
honest = ctx.socket(zmq.DEALER)  # names itself not: the router numbers it
honest.connect(address)
honest.send(b"hello")
assert router.poll(30_000), "no message from the honest client"
ident, payload = router.recv_multipart()
assert payload == b"hello"
print(ident.hex(), flush=True)
"""


def first_id_of_a_broker() -> bytes:
    out = subprocess.run(
        [sys.executable, "-c", ATTACK], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"the broker's socket died (exit {out.returncode}): {out.stderr}"
    return bytes.fromhex(out.stdout.strip())


def test_taking_the_unseeded_ids_ahead_of_time_does_not_abort_the_broker() -> None:
    first = first_id_of_a_broker()  # exit -6 (libzmq's assertion) before the seeding
    assert first[:1] == b"\x00" and first != UNSEEDED_FIRST


def test_two_brokers_number_their_connections_from_different_places() -> None:
    assert first_id_of_a_broker() != first_id_of_a_broker()


def test_logs_name_a_connection_by_a_keyed_hash_not_its_id() -> None:
    label = peer_label(UNSEEDED_FIRST)
    assert label == peer_label(UNSEEDED_FIRST)  # one connection's lines stay together
    assert label != peer_label(UNSEEDED_FIRST[:-1] + b"\x68")
    assert UNSEEDED_FIRST.hex() not in label and "6b8b" not in label
    assert label.startswith("peer-") and len(label) == len("peer-") + 12
