"""MessagePack framing: one typed decoder per direction.

The broker decodes `ToBroker`, every client decodes `FromBroker`; a frame that is not
valid MessagePack or not one of those records raises `ProtocolError`, and so does one
msgspec cannot walk at all (nesting deep enough to exhaust the recursion limit: a 1 KB
frame can do that, even inside an unknown field before the `type` key).
"""

from __future__ import annotations

import msgspec

from drmas.protocol.messages import FromBroker, ToBroker


class ProtocolError(ValueError):
    """A frame or message was refused; `code` is sent back in an ErrorReply."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


_encoder = msgspec.msgpack.Encoder()
_to_broker = msgspec.msgpack.Decoder(ToBroker)
_from_broker = msgspec.msgpack.Decoder(FromBroker)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_broker(frame: bytes | memoryview) -> ToBroker:
    try:
        return _to_broker.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError("bad_frame", f"not a drmas message: {exc}") from None
    except RecursionError:
        raise ProtocolError("bad_frame", "not a drmas message: nested too deeply") from None


def decode_from_broker(frame: bytes | memoryview) -> FromBroker:
    try:
        return _from_broker.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError("bad_frame", f"not a drmas message: {exc}") from None
    except RecursionError:
        raise ProtocolError("bad_frame", "not a drmas message: nested too deeply") from None
