"""Who may be in a weight group: the roll call through the store that picks the members
of a publish, the signed rendezvous entries that keep anyone else from taking a rank, and
the token proofs. Used by learner rank 0 (sender.py: `call_roll`) and the actors
(receiver.py: `answer_roll`), and by `Group` (group.py) for the rendezvous and the proofs.
Every HMAC here is keyed by the group's token, which the broker hands to the members of its
plan only; nothing here ever puts the token in the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from drmas.transports.weights.layout import WeightSyncError


class SignedStore(dist.Store):
    """The store as the process group's rendezvous sees it, with every value signed under
    the group's token (HMAC of group, key and value, appended). torch.distributed's
    rendezvous has each rank write its address under its rank's key and connect to the
    addresses it reads there; a store client could write a rank's key first (or over
    it) and so take that rank, and then crash the ranks it exchanges data with (gloo
    aborts a process that receives a message of the wrong size). Here an entry without
    the signature is never used: `get` waits until the key holds a signed value (a
    member's write replaces the client's), up to `timeout`, and then fails the rendezvous
    (WeightSyncError, or the store's timeout). The publish fails; no rank does.

    Rank 0 that gives up a rendezvous (a member checked in and never came) says so with a
    signed ABORT entry (`abort`); the other ranks (`watch_abort`) look for it while they
    wait, so an honest member fails at once instead of at its own timeout, with its
    engine paused all that while."""

    def __init__(
        self,
        inner: dist.Store,
        token: str,
        group: str,
        timeout: timedelta,
        watch_abort: bool = False,
    ) -> None:
        super().__init__()
        self.inner, self.group, self.timeout_ = inner, group, timeout
        self._key = token.encode()
        self.watch_abort = watch_abort
        self.missing = ""  # the key of the last wait that ran out: whose entry never came

    def abort(self) -> None:
        """Rank 0: the rendezvous is given up; members waiting in it fail now."""
        with contextlib.suppress(RuntimeError):  # the store may be gone already
            self.set(ABORT, "1")

    def _aborted(self) -> bool:
        return self.inner.check([ABORT]) and self._signed(ABORT) is not None

    def _signed(self, key: str) -> bytes | None:
        """The value under `key` if its signature is the group's, else None."""
        raw = bytes(self.inner.get(key))
        value, signature = raw[:-32], raw[-32:]
        if len(raw) >= 32 and hmac.compare_digest(signature, self._signature(key, value)):
            return value
        return None

    def _signature(self, key: str, value: bytes) -> bytes:
        message = f"{self.group}|{key}|".encode() + value
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, data + self._signature(key, data))  # type: ignore[arg-type]  # takes bytes

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout_.total_seconds()
        while True:
            # this store's timeout, not the inner store's (the run's weights.timeout_s): a
            # member that checked in and never writes its entry fails the rendezvous soon
            left = max(deadline - time.monotonic(), 0.001)
            self._wait_for([key], timedelta(seconds=left))
            value = self._signed(key)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                self.missing = key  # a member's own write would have replaced it
                raise WeightSyncError(
                    f"weight group {self.group!r}: rendezvous entry {key!r} is not "
                    "signed with the group's token (a store client wrote it) after "
                    f"{self.timeout_.total_seconds():.0f}s; no weights sent. Keep "
                    "weights.host reachable by actors only"
                )
            time.sleep(ROLL_POLL_S)

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """At most this store's timeout, whatever the caller asks (gloo's rendezvous asks
        for the process group's)."""
        self._wait_for(keys, min(timeout or self.timeout_, self.timeout_))

    def _wait_for(self, keys: list[str], timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            left = deadline - time.monotonic()
            step = timedelta(seconds=max(min(left, ABORT_POLL_S), 0.001))
            try:
                self.inner.wait(keys, step if self.watch_abort else timeout)
                return
            except RuntimeError:  # the store's timeout
                if self.watch_abort and self._aborted():
                    raise WeightSyncError(
                        f"weight group {self.group!r}: rank 0 gave up the rendezvous (a "
                        "member that checked in never came); loading nothing"
                    ) from None
                if not self.watch_abort or time.monotonic() >= deadline:
                    self.missing = next((k for k in keys if not self.inner.check([k])), keys[0])
                    raise

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def proof_key(rank: int) -> str:
    return f"proof/{rank}"


def token_proof(token: str, group: str, rank: int, nonce: bytes) -> bytes:
    """What rank `rank` answers to `nonce`: only a holder of the token can compute it."""
    message = f"{group}|{rank}|".encode() + nonce
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


# ------------------------------------------------------------------ the roll call
# Before a publish forms (or reuses) its process group, every member checks in through the
# store: rank 0 writes a fresh nonce, each member answers with an HMAC of it under the
# group's token, and rank 0, after at most weights.join_timeout_s, writes the roster of the
# ranks that answered correctly, signed with the token. Only they form the group, numbered
# 1..n in rank order; a member left out (late, gone, or without the token) learns it from
# the roster and loads nothing. So a member that never comes costs a publish the join
# timeout, not the group's, and a store client without the token never enters the group.
ROLL_POLL_S = 0.02


def roll_key(version: int, what: str | int) -> str:
    return f"roll/v{version}/{what}"


def roll_proof(token: str, group: str, version: int, rank: int, nonce: str) -> str:
    """What member `rank` writes to check in for `version`'s publish of `group` (hex)."""
    message = f"roll|{group}|{version}|{rank}|{nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def roster_signature(token: str, group: str, version: int, roster: str, nonce: str) -> str:
    message = f"roster|{group}|{version}|{roster}|{nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


@dataclass
class Roll:
    """The outcome of a roll call: who checked in with the token, who did not in time,
    who answered without it."""

    present: list[int]
    absent: list[int]
    refused: list[int]


def call_roll(
    store: dist.Store, group: str, version: int, token: str, members: int, join_timeout_s: float
) -> Roll:
    """Rank 0's roll call over ranks 1..members (see above); writes the signed roster."""
    nonce = secrets.token_hex(16)
    store.set(LATEST, str(version))  # before the nonce: a late member for an older version
    store.set(roll_key(version, "nonce"), nonce)  # sees it instead of waiting
    deadline = time.monotonic() + join_timeout_s
    waiting = set(range(1, members + 1))
    answers: dict[int, bytes] = {}
    while waiting:
        for rank in sorted(waiting):
            key = roll_key(version, rank)
            if store.check([key]):
                answers[rank] = bytes(store.get(key))
                waiting.discard(rank)
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(ROLL_POLL_S)
    present = [
        rank
        for rank, proof in sorted(answers.items())
        if hmac.compare_digest(proof, roll_proof(token, group, version, rank, nonce).encode())
    ]
    roster = ",".join(map(str, present))
    store.set(
        roll_key(version, "roster"),
        f"{roster}|{roster_signature(token, group, version, roster, nonce)}",
    )
    refused = sorted(set(answers) - set(present))
    return Roll(present, sorted(waiting), refused)


ABORT = "abort"
"""A group's store key: rank 0 gave up its rendezvous (SignedStore.abort)."""
ABORT_POLL_S = 0.25
"""How often a member waiting in a rendezvous looks for rank 0's ABORT."""

LATEST = "roll/latest"
"""The version of rank 0's newest roll call in a group's store."""


def _wait_for_nonce(store: dist.Store, group: str, version: int, timeout_s: float) -> str:
    """The nonce of `version`'s roll call, once rank 0 has written it (within the store's
    timeout). Rank 0 deletes a roll call's keys at its next one, so a member that comes
    after rank 0 moved on to a newer version would otherwise wait the whole timeout for
    a nonce that never comes (an actor that attached mid-run, busy loading another
    model, waited 30 s and missed every other publish meanwhile): it fails at once."""
    key = roll_key(version, "nonce")
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([key]):
            with contextlib.suppress(RuntimeError):  # deleted between check and get
                return bytes(store.get(key)).decode(errors="replace")
        if store.check([LATEST]):
            latest = bytes(store.get(LATEST)).decode(errors="replace")
            if latest.isdigit() and int(latest) > version:
                raise WeightSyncError(
                    f"weight group {group!r}: v{version}'s publish is over (rank 0 is at "
                    f"v{latest}); loading nothing, the broker re-publishes to this actor"
                )
        if time.monotonic() >= deadline:
            raise WeightSyncError(
                f"weight group {group!r}: rank 0 started no roll call for v{version} within "
                f"{timeout_s:g}s (weights.timeout_s)"
            )
        time.sleep(ROLL_POLL_S)


def answer_roll(
    store: dist.Store, group: str, version: int, token: str, rank: int, timeout_s: float
) -> tuple[int, int]:
    """A member checks in for `version`'s publish and waits for the roster (each wait is the
    store's timeout, the group's). Returns its (rank, world size) in the group that forms;
    raises WeightSyncError when it was left out or the roster is not the token holder's."""
    nonce = _wait_for_nonce(store, group, version, timeout_s)
    store.set(roll_key(version, rank), roll_proof(token, group, version, rank, nonce))
    signed = bytes(store.get(roll_key(version, "roster")))
    roster, _, signature = signed.decode(errors="replace").rpartition("|")
    expected = roster_signature(token, group, version, roster, nonce)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        raise WeightSyncError(
            f"weight group {group!r}: the roster of v{version}'s publish is not signed with "
            "the group's token (a store client wrote it); loading nothing"
        )
    present = [int(r) for r in roster.split(",") if r]
    if rank not in present:
        raise WeightSyncError(
            f"weight group {group!r}: left out of v{version}'s publish (not checked in within "
            "weights.join_timeout_s of learner rank 0's roll call); the broker re-publishes "
            "to this actor later"
        )
    return present.index(rank) + 1, len(present) + 1


def roster_group(group: str, version: int, present: int, members: int) -> str:
    """The name (store prefix) of the process group a roll call forms: the planned group's
    when every member is present (kept for the next publish), else a one-off of this
    version's roster."""
    return group if present == members else f"{group}/v{version}-of-{present}"
