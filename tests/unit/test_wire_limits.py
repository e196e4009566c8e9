"""Wire ceilings: msgspec refuses an over-long list, map or string of a protocol type while
decoding (drmas/protocol/wire_limits.py), so a frame cannot make the broker build what
it will refuse anyway; a field at its ceiling still decodes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from drmas.protocol.codec import ProtocolError, decode_from_broker, decode_to_broker
from drmas.protocol.wire_limits import (
    MAX_EPISODE_STEPS,
    MAX_GROUP_EPISODES,
    MAX_ID_CHARS,
    MAX_LEASE_IDS,
    MAX_METRICS,
    MAX_MODELS,
    MAX_NAME_CHARS,
    MAX_TEXT_CHARS,
)

raw = msgspec.msgpack.encode


def _step(**kw: Any) -> dict[str, Any]:
    return {"agent": "solver", "model": "m", "prompt_len": 1, "response_len": 1, "version": 0,
            "valid": True, "finish_reason": "stop", **kw}  # fmt: skip


def _group(episodes: list[Any]) -> dict[str, Any]:
    return {"type": "group_result", "client_id": "a", "lease_id": 0, "group_id": 0,
            "episodes": episodes, "prompt_ids": b"", "response_ids": b"", "logprobs": b""}  # fmt: skip


def _at_and_over(limit: int, make: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return make(limit), make(limit + 1)


CASES = {
    "hello client_id": lambda n: {
        "type": "hello",
        "role": "actor",
        "client_id": "x" * n,
        "protocol_version": 5,
    },
    "hello host": lambda n: {
        "type": "hello",
        "role": "actor",
        "client_id": "x",
        "protocol_version": 5,
        "host": "h" * n,
    },
    "hello models": lambda n: {
        "type": "hello",
        "role": "actor",
        "client_id": "x",
        "protocol_version": 5,
        "models": [f"m{i}" for i in range(n)],
    },
    "lease_return ids": lambda n: {
        "type": "lease_return",
        "client_id": "a",
        "lease_ids": [1] * n,
    },
    "lease_return reason": lambda n: {
        "type": "lease_return",
        "client_id": "a",
        "lease_ids": [],
        "reason": "r" * n,
    },
    "goodbye ids": lambda n: {"type": "goodbye", "client_id": "a", "lease_ids": [1] * n},
    "heartbeat versions": lambda n: {
        "type": "heartbeat",
        "client_id": "a",
        "versions": {f"m{i}": 0 for i in range(n)},
    },
    "step_report metrics": lambda n: {
        "type": "step_report",
        "model": "m",
        "version": 1,
        "metrics": {f"k{i}": 0.0 for i in range(n)},
    },
    "step_report metric name": lambda n: {
        "type": "step_report",
        "model": "m",
        "version": 1,
        "metrics": {"k" * n: 0.0},
    },
    "weights_loaded error": lambda n: {
        "type": "weights_loaded",
        "client_id": "a",
        "model": "m",
        "version": 0,
        "seconds": 0.0,
        "error": "e" * n,
    },
    "group episodes": lambda n: _group([{"steps": [_step()], "reward": 0.0}] * n),
    "group steps": lambda n: _group([{"steps": [_step()] * n, "reward": 0.0}]),
    "group agent name": lambda n: _group([{"steps": [_step(agent="a" * n)], "reward": 0.0}]),
}
LIMITS = {
    "hello client_id": MAX_ID_CHARS, "hello host": MAX_ID_CHARS, "hello models": MAX_MODELS,
    "lease_return ids": MAX_LEASE_IDS, "lease_return reason": MAX_TEXT_CHARS,
    "goodbye ids": MAX_LEASE_IDS, "heartbeat versions": MAX_MODELS,
    "step_report metrics": MAX_METRICS, "step_report metric name": MAX_NAME_CHARS,
    "weights_loaded error": MAX_TEXT_CHARS, "group episodes": MAX_GROUP_EPISODES,
    "group steps": MAX_EPISODE_STEPS, "group agent name": MAX_NAME_CHARS,
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_field_at_its_ceiling_decodes_and_one_over_is_refused(case: str) -> None:
    at, over = _at_and_over(LIMITS[case], CASES[case])
    decode_to_broker(raw(at))
    with pytest.raises(ProtocolError, match="length <="):
        decode_to_broker(raw(over))


def test_a_64_mb_lease_return_is_refused_at_its_length_header() -> None:
    """The issue's attack: 64 M one-byte lease ids. msgspec reads the array's length first
    and refuses it there, so nothing of the 64 MB is built (the refusal names the field)."""
    frame = raw({"type": "lease_return", "client_id": "a", "lease_ids": [1] * (1 << 26)})
    assert len(frame) > 64 * 2**20
    with pytest.raises(ProtocolError, match=r"\$\.lease_ids"):
        decode_to_broker(frame)


def test_broker_replies_are_bounded_too() -> None:
    reply = {"type": "error", "code": "invalid", "reason": "r" * (MAX_TEXT_CHARS + 1)}
    with pytest.raises(ProtocolError, match="length <="):
        decode_from_broker(raw(reply))
