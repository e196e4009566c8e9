"""The roll call of a weight publish (drmas/transports/weights/membership.py) for a member
that comes late: rank 0 keeps the keys of its last two roll calls and deletes older ones,
so a member whose version's nonce is gone must learn that rank 0 moved on instead of
waiting out weights.timeout_s for a key that will never come back (round four: an actor
that attached mid-run waited 30 s in such a roll call, missed every other publish
meanwhile and was dropped). Real TCPStore on loopback; rank 0 in this thread."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from drmas.transports.weights import WeightSyncError
from drmas.transports.weights.membership import answer_roll, call_roll, roll_key

TOKEN = "t" * 32
TIMEOUT_S = 120.0  # what a member would wait without the fix; never reached here


@pytest.fixture
def store():
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    yield dist.PrefixStore("g", master)


def test_a_member_whose_roll_call_is_gone_fails_at_once_naming_the_newer_version(store) -> None:
    roll = call_roll(store, "g", 1, TOKEN, members=1, join_timeout_s=0.05)
    assert roll.absent == [1]  # the member was late
    for key in ("nonce", "roster", 1):  # rank 0's clean-up of an older roll call
        store.delete_key(roll_key(1, key))
    call_roll(store, "g", 2, TOKEN, members=1, join_timeout_s=0.05)
    with pytest.raises(WeightSyncError, match=r"v1's publish is over \(rank 0 is at v2\)"):
        answer_roll(store, "g", 1, TOKEN, rank=1, timeout_s=TIMEOUT_S)


def test_a_member_late_for_a_roll_call_still_kept_is_told_it_was_left_out(store) -> None:
    call_roll(store, "g", 1, TOKEN, members=1, join_timeout_s=0.05)
    call_roll(store, "g", 2, TOKEN, members=1, join_timeout_s=0.05)
    with pytest.raises(WeightSyncError, match="left out of v1's publish"):
        answer_roll(store, "g", 1, TOKEN, rank=1, timeout_s=TIMEOUT_S)


def test_no_roll_call_at_all_times_out_at_the_members_bound(store) -> None:
    with pytest.raises(WeightSyncError, match=r"no roll call for v3 within 0.2s"):
        answer_roll(store, "g", 3, TOKEN, rank=1, timeout_s=0.2)


def test_the_sender_keeps_the_last_two_roll_calls_keys() -> None:
    """WeightSender deletes a roll call's keys two roll calls later, not at the next one."""
    from drmas.config.transport import WeightSyncConfig
    from drmas.transports.weights import WeightSender

    sender = WeightSender(WeightSyncConfig(host="127.0.0.1", timeout_s=10.0, join_timeout_s=0.05))
    try:
        prefix = dist.PrefixStore("g", sender.store)
        for version in (1, 2, 3):
            sender._roll_call("g", version, TOKEN, 1, ["a"])
        assert not prefix.check([roll_key(1, "nonce")])
        assert prefix.check([roll_key(2, "nonce")]) and prefix.check([roll_key(3, "nonce")])
    finally:
        sender.close()


@pytest.mark.parametrize("members", [1, 2])
def test_a_member_that_checks_in_and_never_joins_fails_the_publish_at_the_rendezvous_bound(
    monkeypatch, members: int
) -> None:
    """It proves the token at the roll call, then never writes its rendezvous entry: rank 0
    gives up after max(RENDEZVOUS_MIN_S, join_timeout_s), not weights.timeout_s (each
    publish waited 60 s for such a member in a whole run, then 2 x join_timeout_s), and
    names it by its rank in the
    plan (`absent`; with 2 members, rank 1 never checks in, so the culprit, plan rank 2, is
    the group's rank 1), so the broker counts the failure against it and no one else."""
    import threading

    import drmas.transports.weights.sender as sender_module
    from drmas.config.transport import WeightSyncConfig
    from drmas.transports.weights import WeightSender, WeightSyncTimeout

    monkeypatch.setattr(sender_module, "RENDEZVOUS_MIN_S", 0.5)
    cfg = WeightSyncConfig(host="127.0.0.1", timeout_s=TIMEOUT_S, join_timeout_s=0.8)
    sender = WeightSender(cfg)
    client = dist.TCPStore("127.0.0.1", sender.store.port, is_master=False,
                           timeout=datetime.timedelta(seconds=30))  # fmt: skip
    checked_in = threading.Thread(
        target=answer_roll,
        args=(dist.PrefixStore("g", client), "g", 1, TOKEN, members, 30.0),
        daemon=True,
    )
    checked_in.start()
    try:
        # the store's own words: it waited the rendezvous bound (join_timeout_s, over
        # RENDEZVOUS_MIN_S), not TIMEOUT_S
        with pytest.raises(
            WeightSyncTimeout, match=r"rendezvous failed.*wait timeout after 800ms"
        ) as failed:
            sender.publish("g", members + 1, [], TIMEOUT_S, specs=[], token=TOKEN, version=1)
        assert failed.value.absent == (members,)
    finally:
        checked_in.join(30)
        sender.close()


def test_an_honest_member_stops_waiting_when_rank_0_gives_up_the_rendezvous(monkeypatch) -> None:
    """Members 1 (honest, a real WeightReceiver) and 2 (checks in, never joins) of a publish:
    rank 0 gives up at its rendezvous bound and writes a signed abort, and the honest
    member's receive fails on it, not at its own timeout (TIMEOUT_S, never reached),
    which it used to wait out with its engine paused (2.37x a whole run's time)."""
    import threading

    import drmas.transports.weights.sender as sender_module
    from drmas.config.transport import WeightSyncConfig
    from drmas.protocol.messages import JoinWeightGroup
    from drmas.transports.weights import WeightReceiver, WeightSender

    monkeypatch.setattr(sender_module, "RENDEZVOUS_MIN_S", 0.5)
    cfg = WeightSyncConfig(host="127.0.0.1", timeout_s=TIMEOUT_S, join_timeout_s=5.0)
    sender = WeightSender(cfg)
    address = f"127.0.0.1:{sender.store.port}"
    client = dist.TCPStore("127.0.0.1", sender.store.port, is_master=False,
                           timeout=datetime.timedelta(seconds=30))  # fmt: skip
    squatter = threading.Thread(
        target=answer_roll, args=(dist.PrefixStore("g", client), "g", 1, TOKEN, 2, 30.0),
        daemon=True,
    )  # fmt: skip
    failure: list[BaseException] = []

    def honest() -> None:
        receiver = WeightReceiver(WeightSyncConfig(host="127.0.0.1", timeout_s=TIMEOUT_S))
        join = JoinWeightGroup("m", 1, "g", address, 1, 3, TIMEOUT_S, TOKEN)
        try:
            list(receiver.receive(join))
        except BaseException as exc:  # what it failed with is the result
            failure.append(exc)
        finally:
            receiver.close()

    member = threading.Thread(target=honest, daemon=True)
    squatter.start()
    member.start()
    try:
        with pytest.raises(WeightSyncError) as failed:
            sender.publish("g", 3, [], TIMEOUT_S, specs=[], token=TOKEN, version=1)
        assert failed.value.absent == (2,)
        member.join(30)
        assert not member.is_alive()
        assert len(failure) == 1 and "rank 0 gave up the rendezvous" in str(failure[0])
    finally:
        squatter.join(30)
        sender.close()
