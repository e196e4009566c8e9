"""The contracts: every message between actors, broker and learners (messages.py, framed
by codec.py, checked by validate.py), and the in-process engine interface that teams call
(engine.py). Imports nothing of drmas."""

from drmas.protocol.arrays import pack_ids, pack_logprobs, unpack_ids, unpack_logprobs
from drmas.protocol.codec import ProtocolError, decode_from_broker, decode_to_broker, encode
from drmas.protocol.messages import *  # noqa: F403
from drmas.protocol.messages import PROTOCOL_VERSION
from drmas.protocol.validate import Limits

__all__ = [
    "PROTOCOL_VERSION",
    "Limits",
    "ProtocolError",
    "decode_from_broker",
    "decode_to_broker",
    "encode",
    "pack_ids",
    "pack_logprobs",
    "unpack_ids",
    "unpack_logprobs",
]
