"""How the broker names a connection in its logs: never by its ZeroMQ routing id.

libzmq numbers the connections that do not name themselves from a counter; a log line that
showed those numbers would tell its reader the next one, and a client that takes that
number as its own id ahead of time makes libzmq abort the broker (an assertion) when the
counter reaches it. drmas/transports/channel.py starts the counter where nobody can guess;
this keeps it from being read back. A hash keyed by a secret of this broker process keeps
the lines of one connection together without revealing its id. Used by the broker's
refusal log (server.py) and its flood watch (wire_watch.py).
"""

from __future__ import annotations

import hashlib
import os

_KEY = os.urandom(16)


def peer_label(identity: bytes) -> str:
    """`peer-` and 12 hex digits: the same for the same connection id in this process."""
    return "peer-" + hashlib.blake2b(identity, key=_KEY, digest_size=6).hexdigest()
