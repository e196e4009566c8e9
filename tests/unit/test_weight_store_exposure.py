"""What a weight store exposes and what a receiver accepts from rank 0 (no group needed)."""

from __future__ import annotations

import socket
from pathlib import Path

import msgspec
import pytest

from drmas.config.transport import WeightSyncConfig
from drmas.transports.weights import (
    MAX_BUCKET_BYTES,
    Header,
    TensorSpec,
    WeightSender,
    WeightSyncError,
    decode_header,
)


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                found.append(address)
    return found


def test_the_weight_store_listens_on_the_configured_host_only() -> None:
    sender = WeightSender(WeightSyncConfig(host="127.0.0.1"))
    try:
        port = sender.store.port
        assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # reachable where it should be
    finally:
        sender.release()


def _raw(header: object) -> bytes:
    return msgspec.msgpack.encode(header)


def test_a_receiver_checks_the_header_before_allocating_from_it() -> None:
    good = Header(2**20, [TensorSpec("w", (4, 4), "float32")])
    assert decode_header(_raw(good), "g") == good
    cases = {
        "bucket of": Header(10**15, [TensorSpec("w", (4,), "float32")]),
        "shape": Header(2**20, [TensorSpec("w", (-1,), "float32")]),
        "dtype": Header(2**20, [TensorSpec("w", (4,), "complex1024")]),
        "at most": Header(2**20, [TensorSpec("w", (MAX_BUCKET_BYTES,), "float32")]),
    }
    for match, header in cases.items():
        with pytest.raises(WeightSyncError, match=match):
            decode_header(_raw(header), "g")
    with pytest.raises(WeightSyncError, match="bad header"):
        decode_header(b"\x91" * 5000 + b"\xc0", "g")  # nested too deeply to decode
