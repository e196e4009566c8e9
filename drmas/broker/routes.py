"""Who a connection is: the broker's map between ZeroMQ routing ids and client ids (pure logic).

Owned by the broker loop (drmas/broker/server.py). Clients do not choose their routing id:
the broker's ROUTER gives each connection its own, never reused, and the client id a
connection speaks for is the one its Hello was welcomed under. So a connection that only
holds a name cannot stop its owner's messages from arriving (a ROUTER ignores the second
connection that brings an identity already in use: with client-chosen identities, a
squatter holding `learner-solver-0` left the real learner's Hello unanswered), and every
message after the Hello is attributed by its connection, not by what it says.

Who gets a name (`claim`, at each Hello, before the gate):
- a name nobody holds, or one whose holder is no longer registered, as asked;
- a name held by this same connection (a client saying Hello again), as asked;
- a name held through another connection, by a client silent for longer than
  `stale_s` (it restarted or reconnected: its old connection is gone), as asked, and
  with CURVE only from the same key;
- otherwise, an actor or observer gets a fresh name, `<name>~<n>`, which its Welcome
  carries, and a learner keeps asking for its own (its seat is its name, and the gate's
  proof decides: drmas/broker/gate.py): `claim` returns the name and `taken` says whether
  a live connection holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from drmas.protocol import ProtocolError
from drmas.protocol.messages import Hello


@dataclass
class Route:
    identity: bytes  # the connection's ZeroMQ routing id
    key: str  # its CURVE key (z85), "" without CURVE
    role: str = ""  # what its Hello said it is (actor, learner, client)


class Routes:
    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self.by_name: dict[str, Route] = {}
        self.by_identity: dict[bytes, str] = {}

    def name_of(self, identity: bytes) -> str | None:
        """The client id this connection was welcomed under, or None (no Hello yet)."""
        return self.by_identity.get(identity)

    def identity_of(self, name: str) -> bytes | None:
        route = self.by_name.get(name)
        return None if route is None else route.identity

    def taken(
        self, name: str, identity: bytes, key: str, last_seen: float | None, now: float
    ) -> bool:
        """Whether `name` belongs to another connection whose client is registered
        (`last_seen` not None) and live, or (with CURVE) to another key."""
        route = self.by_name.get(name)
        if route is None or route.identity == identity or last_seen is None:
            return False
        return route.key != key or now - last_seen <= self.stale_s

    def claim(
        self,
        name: str,
        identity: bytes,
        key: str,
        last_seen: Callable[[str], float | None],
        now: float,
        *,
        rename: bool,
    ) -> str:
        """The name a Hello asking for `name` from `identity` is to be welcomed under (see
        the module); nothing is bound until `bind`. `last_seen(name)`: when the client
        registered under a name was last heard from, None when none is."""
        if not rename or not self.taken(name, identity, key, last_seen(name), now):
            return name
        n = 2
        while self.taken(f"{name}~{n}", identity, key, last_seen(f"{name}~{n}"), now):
            n += 1
        return f"{name}~{n}"

    def bind(self, name: str, identity: bytes, key: str, role: str = "") -> None:
        """`identity` now speaks for `name` (its Hello was welcomed); a connection that did
        before no longer does, and this connection's previous name, if any, is let go."""
        old = self.by_name.pop(name, None)
        if old is not None:
            self.by_identity.pop(old.identity, None)
        previous = self.by_identity.pop(identity, None)
        if previous is not None and previous != name:
            self.by_name.pop(previous, None)
        self.by_name[name] = Route(identity, key, role)
        self.by_identity[identity] = name

    def forget(self, identity: bytes) -> None:
        """A connection the broker shut: its name is free for its client's next Hello."""
        name = self.by_identity.pop(identity, None)
        if name is not None:
            self.by_name.pop(name, None)

    def prune(self, registered: Callable[[str], bool]) -> list[bytes]:
        """Forget the routes of names no longer registered (dropped, timed out, left);
        returns the routing ids of those that were actors or learners (the broker shuts
        their connections; an observer is never registered and keeps its connection)."""
        gone = []
        for name in [n for n in self.by_name if not registered(n)]:
            route = self.by_name.pop(name)
            self.by_identity.pop(route.identity, None)
            if route.role in ("actor", "learner"):
                gone.append(route.identity)
        return gone

    def hello_name(
        self,
        msg: Hello,
        identity: bytes,
        key: str,
        last_seen: Callable[[str], float | None],
        now: float,
        proven: bool,
    ) -> str:
        """The name a Hello is to be welcomed under (`claim`: actors and observers may be
        renamed, a learner never). `proven`: false for a learner when the broker has no
        learner secret, which then cannot tell a learner from a rival, so a learner's name
        a live connection speaks for is refused (`forbidden`)."""
        learner = msg.role == "learner"
        name = self.claim(msg.client_id, identity, key, last_seen, now, rename=not learner)
        if not proven and self.taken(name, identity, key, last_seen(name), now):
            raise ProtocolError(
                "forbidden",
                f"{name!r} is in use by another live connection; without a learner secret "
                "(security.learner_secret) the broker cannot tell which is the learner",
            )
        return name
