"""The broker's side of weights that prove themselves (drmas/broker/publishing.py): who
is told a weight group's token, and how often an actor whose loads fail is re-published."""

from __future__ import annotations

import collections

from drmas.broker.adapter_versions import AdapterVersions
from drmas.broker.leases import ActorRecord
from drmas.broker.metrics import StepMetrics
from drmas.broker.publishing import MAX_MISSED_JOINS, MAX_RELOADS, WeightPublishing
from drmas.config import load_config


class NoSink:
    def write(self, record: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def publishing(*actor_ids: str) -> WeightPublishing:
    cfg = load_config(["train.steps=100"])
    actors = {a: ActorRecord(a, "h", 1, ["solver"], 0.0) for a in actor_ids}
    return WeightPublishing(
        cfg,
        actors,
        dict.fromkeys(cfg.models, 0),
        collections.Counter(),
        StepMetrics(NoSink(), sorted(cfg.models)),
        AdapterVersions(cfg),
    )


def test_the_token_goes_to_the_learner_and_the_members_only() -> None:
    pub = publishing("a1", "a2")
    plan, joins = pub.plan("solver", 1, "h:1", now=0.0)
    assert len(plan.token) == 32  # 128 bits, hex
    assert [cid for cid, _ in joins] == ["a1", "a2"] == plan.members
    assert {j.token for _, j in joins} == {plan.token}
    assert [j.rank for _, j in joins] == [1, 2]
    # the same members over the same store: the kept group, the same token
    pub.done("solver", 1, 0.1, ok=True)
    for cid in ("a1", "a2"):
        pub.loaded(cid, "solver", 1, ok=True)
    again, _ = pub.plan("solver", 2, "h:1", now=1.0)
    assert (again.group_name, again.token) == (plan.group_name, plan.token)
    # another member set (a3 attached): a new group, a token nobody held before
    pub.actors["a3"] = ActorRecord("a3", "h", 1, ["solver"], 0.0)
    pub.done("solver", 2, 0.1, ok=True)
    third, joins3 = pub.plan("solver", 3, "h:1", now=2.0)
    assert third.group_name != plan.group_name and third.token != plan.token
    assert {j.token for _, j in joins3} == {third.token}


def test_an_actor_whose_loads_keep_failing_is_re_published_with_a_growing_back_off() -> None:
    """A refused header or a digest mismatch is a failed load: the actor stays behind and
    the broker re-publishes to it, at once for the first MAX_RELOADS failures in a row,
    then only after a back-off of weights.timeout_s that doubles with each failure (a
    broken actor cannot keep its learner re-publishing, and an actor whose loads failed
    for another member's sake is not left behind for ever); the next version's publish
    includes it again."""
    pub = publishing("good", "bad")
    timeout = pub.cfg.weights.timeout_s
    pub.plan("solver", 1, "h:1", now=0.0)
    pub.done("solver", 1, 0.1, ok=True)
    pub.loaded("good", "solver", 1, ok=True, now=1.0)
    pub.loaded("bad", "solver", 1, ok=False, now=1.0)
    now = 1.0
    for _ in range(MAX_RELOADS - 1):  # re-published at once
        assert pub.stale_actors("solver", 1, now=now) == ["bad"]
        plan, joins = pub.plan("solver", 1, "h:1", now=now)
        assert plan.members == ["bad"] and len(joins) == 1
        pub.done("solver", 1, 0.1, ok=True)
        now += 1.0
        pub.loaded("bad", "solver", 1, ok=False, now=now)
    assert pub.counters["weight_republishes_given_up"] == 1
    assert pub.counters["weight_loads_failed"] == MAX_RELOADS
    # the third failure in a row: a back-off of timeout, then twice that after the fourth
    assert pub.stale_actors("solver", 1, now=now + timeout - 0.1) == []
    assert pub.stale_actors("solver", 1, now=now + timeout) == ["bad"]
    pub.plan("solver", 1, "h:1", now=now + timeout)
    now += timeout
    pub.loaded("bad", "solver", 1, ok=False, now=now)
    assert pub.stale_actors("solver", 1, now=now + 2 * timeout - 0.1) == []
    assert pub.stale_actors("solver", 1, now=now + 2 * timeout) == ["bad"]
    assert pub.reload_backoff_s(100) == timeout * 16  # bounded
    # version 2: a full publish to every actor, "bad" included, and it may fail again
    plan, _ = pub.plan("solver", 2, "h:1", now=1000.0)
    assert plan.members == ["bad", "good"]
    pub.done("solver", 2, 0.1, ok=True)
    pub.loaded("good", "solver", 2, ok=True, now=1001.0)
    pub.loaded("bad", "solver", 2, ok=False, now=1001.0)
    assert pub.stale_actors("solver", 2, now=1001.0) == ["bad"]
    # a load that succeeds (of a re-publish it was sent) clears its count
    plan, _ = pub.plan("solver", 2, "h:1", now=1002.0)
    assert plan.members == ["bad"]
    pub.loaded("bad", "solver", 2, ok=True)  # taken once the publish is done
    pub.done("solver", 2, 0.1, ok=True)
    assert ("bad", "solver") not in pub.failed_loads


def test_members_left_out_of_a_roll_call_are_behind_and_dropped_if_they_never_come() -> None:
    """PublishDone.left_out: a1 checked in, a2 did not. a2 is behind and on probation: the
    next version's publish goes to a1 alone (it never waits for a2 again) and a2 gets
    each version by a re-publish of its own; the kept group is not reused (others formed
    one); after MAX_MISSED_JOINS publishes in a row without checking in a2 is handed over
    to be dropped, once; a1, which loads every time, never is."""
    pub = publishing("a1", "a2")
    plan, _ = pub.plan("solver", 1, "h:1", now=0.0)
    pub.done("solver", 1, 0.1, ok=True, left_out=["a2"], now=0.0)
    pub.loaded("a1", "solver", 1, ok=True)
    assert pub.counters["weight_joins_missed"] == 1 and pub.take_never_joined() == []
    assert pub.stale_actors("solver", 1, now=1.0) == ["a2"]
    again, _ = pub.plan("solver", 2, "h:1", now=1.0)
    assert again.members == ["a1"] and again.group_name != plan.group_name
    assert pub.counters["weight_joins_on_probation"] == 1
    pub.done("solver", 2, 0.1, ok=True, now=1.0)
    pub.loaded("a1", "solver", 2, ok=True)
    for n in (2, 3):  # the re-publishes of v2 to a2 alone, missed too
        alone, _ = pub.plan("solver", 2, "h:1", now=float(n))
        assert alone.members == ["a2"]
        pub.done("solver", 2, 0.1, ok=True, left_out=["a2"], now=float(n))
    assert pub.take_never_joined() == ["a2"] and pub.take_never_joined() == []
    # a1's count was reset by its loads; a2's stays with its name
    assert pub.missed_joins == {"a2": MAX_MISSED_JOINS}


def test_an_actor_dropped_for_missed_joins_that_says_hello_again_waits_out_a_back_off() -> None:
    """A fake actor that rejoins each time it is dropped (its count kept with its name) used
    to cost every publish a join timeout: now no full publish includes it, its re-publish
    waits weights.timeout_s after its last miss (doubling with each further miss), its
    next miss drops it again at once, and it gets no lease meanwhile; a load clears all."""
    from drmas.broker.publishing import MAX_MISSED_JOINS as MAX

    pub = publishing("a1", "rejoiner")
    timeout = pub.cfg.weights.timeout_s
    pub.missed_joins["rejoiner"], pub.missed_at["rejoiner"] = MAX, 10.0  # dropped, back
    assert pub.rejoin_backoff_s("rejoiner") == timeout
    plan, _ = pub.plan("solver", 1, "h:1", now=11.0)
    assert plan.members == ["a1"]  # the new version never waits for it
    pub.done("solver", 1, 0.1, ok=True, now=11.0)
    pub.loaded("a1", "solver", 1, ok=True)
    assert pub.stale_actors("solver", 1, now=10.0 + timeout - 0.1) == []
    assert pub.stale_actors("solver", 1, now=10.0 + timeout) == ["rejoiner"]
    alone, _ = pub.plan("solver", 1, "h:1", now=10.0 + timeout)
    assert alone.members == ["rejoiner"]
    pub.done("solver", 1, 0.1, ok=True, left_out=["rejoiner"], now=10.0 + timeout)
    assert pub.take_never_joined() == ["rejoiner"]  # dropped again at its next miss
    assert pub.rejoin_backoff_s("rejoiner") == 2 * timeout
    assert pub.stale_actors("solver", 1, now=10.0 + 3 * timeout - 0.1) == []
    assert pub.stale_actors("solver", 1, now=10.0 + 3 * timeout) == ["rejoiner"]
    pub.plan("solver", 1, "h:1", now=10.0 + 3 * timeout)
    pub.done("solver", 1, 0.1, ok=True, now=10.0 + 3 * timeout)
    pub.loaded("rejoiner", "solver", 1, ok=True)  # an honest actor, back: cleared
    assert pub.rejoin_backoff_s("rejoiner") == 0.0 and "rejoiner" not in pub.missed_at
    assert pub.plan("solver", 2, "h:1", now=1000.0)[0].members == ["a1", "rejoiner"]


def test_an_ok_for_a_load_the_broker_never_asked_for_changes_nothing() -> None:
    """An actor left out of a roll call (or never sent a join) that says it loaded the
    version anyway: not taken, its missed joins not cleared, so it is still dropped."""
    pub = publishing("a1", "fake")
    for version in (1, 2, 3):
        pub.plan("solver", version, "h:1", now=float(version))
        pub.done("solver", version, 0.1, ok=True, left_out=["fake"])
        pub.loaded("a1", "solver", version, ok=True)
        pub.loaded("fake", "solver", version, ok=True)  # it never checked in
    assert pub.actors["fake"].versions.get("solver", 0) == 0
    assert pub.actors["a1"].versions["solver"] == 3
    assert pub.counters["weight_loads_unexpected"] == 3
    assert pub.take_never_joined() == ["fake"]


def test_an_actor_still_loading_is_not_stale() -> None:
    """Joined and not yet reported: its learner must not re-publish to it meanwhile (under
    load, 80 to 299 re-publishes in a 6-step run came from actors still loading)."""
    pub = publishing("a1")
    pub.plan("solver", 1, "h:1", now=0.0)
    pub.done("solver", 1, 0.1, ok=True)
    assert pub.stale_actors("solver", 1, now=1.0) == []  # still receiving or loading
    bound = pub.cfg.weights.timeout_s + pub.cfg.weights.join_timeout_s
    assert pub.stale_actors("solver", 1, now=bound + 0.1) == ["a1"]  # it never reported
    pub.loaded("a1", "solver", 1, ok=True)
    assert pub.stale_actors("solver", 1, now=bound + 0.2) == []


def test_a_member_that_checks_in_again_starts_its_count_afresh() -> None:
    pub = publishing("a1")
    pub.plan("solver", 1, "h:1", now=1.0)
    pub.done("solver", 1, 0.1, ok=True, left_out=["a1"], now=1.0)
    pub.plan("solver", 1, "h:1", now=2.0)  # the re-publish to it alone: missed again
    pub.done("solver", 1, 0.1, ok=True, left_out=["a1"], now=2.0)
    assert pub.missed_joins["a1"] == 2
    assert pub.plan("solver", 2, "h:1", now=3.0)[0].members == []  # on probation
    pub.done("solver", 2, 0.1, ok=True, now=3.0)
    assert pub.plan("solver", 2, "h:1", now=4.0)[0].members == ["a1"]
    pub.done("solver", 2, 0.1, ok=True, now=4.0)
    pub.loaded("a1", "solver", 2, ok=True)
    assert pub.plan("solver", 3, "h:1", now=5.0)[0].members == ["a1"]  # back in the full one
    pub.done("solver", 3, 0.1, ok=True, left_out=["a1"], now=5.0)
    assert pub.take_never_joined() == [] and pub.missed_joins["a1"] == 1


def test_a_member_that_checks_in_and_breaks_the_group_is_found_by_trying_each_alone() -> None:
    """A fake actor checks in at the roll call and never joins: the publish fails for
    everyone. The members that checked in are then re-published to one at a time, so the
    honest ones load and the one that breaks even its own group is counted; from then on
    it is left out of every new version's publish (so it breaks no other) and fails only
    the re-publishes it gets alone, until dropped after MAX_MISSED_JOINS; no honest actor
    is ever counted."""
    pub = publishing("a1", "a2", "fake")
    plan, _ = pub.plan("solver", 1, "h:1", now=0.0)
    assert plan.members == ["a1", "a2", "fake"]
    pub.done("solver", 1, 60.0, ok=False)  # checked in, all of them; the group never formed
    assert pub.missed_joins == {} and pub.suspects["solver"] == ["a1", "a2", "fake"]
    pub.loaded("a1", "solver", 1, ok=False)  # the honest ones time out too and say so
    pub.loaded("a2", "solver", 1, ok=False)  # (the fake stays silent: busy for a while)
    now = 100.0  # past weights.timeout_s + join_timeout_s: the fake is not busy any more
    for honest in ("a1", "a2"):
        plan, _ = pub.plan("solver", 1, "h:1", now=now)
        assert plan.members == [honest]  # alone
        pub.done("solver", 1, 0.1, ok=True)
        pub.loaded(honest, "solver", 1, ok=True)
    plan, _ = pub.plan("solver", 1, "h:1", now=now)
    assert plan.members == ["fake"]
    pub.done("solver", 1, 60.0, ok=False)  # alone, it fails its own group: the culprit
    assert pub.missed_joins == {"fake": 1} and not pub.suspects.get("solver")
    for version in (2, 3):  # on probation: every full publish works without it, and it
        now += 100.0  # fails the re-publish it gets alone
        plan, _ = pub.plan("solver", version, "h:1", now=now)
        assert plan.members == ["a1", "a2"]
        pub.done("solver", version, 0.1, ok=True)
        for honest in ("a1", "a2"):
            pub.loaded(honest, "solver", version, ok=True)
        plan, _ = pub.plan("solver", version, "h:1", now=now)
        assert plan.members == ["fake"]
        pub.done("solver", version, 60.0, ok=False)
    assert pub.counters["weight_publishes_failed"] == 4  # the first full one, then alone
    assert pub.take_never_joined() == ["fake"]
    assert pub.missed_joins == {"fake": MAX_MISSED_JOINS}  # never an honest actor
    assert pub.actors["a1"].versions["solver"] == pub.actors["a2"].versions["solver"] == 3


def test_an_ok_before_the_publish_is_done_waits_for_its_roll_call() -> None:
    """An actor that never checks in but says it loaded at once, before the learner's
    PublishDone: it used to be taken as loaded (its version raised, its missed joins
    cleared), so it was never dropped and every publish waited for it at the roll call.
    An honest member's early ok is taken when the publish is done."""
    pub = publishing("a1", "fake")
    for version in (1, 2, 3):
        pub.plan("solver", version, "h:1", now=float(version))
        pub.loaded("a1", "solver", version, ok=True, digest="d")  # honest, and quick
        pub.loaded("fake", "solver", version, ok=True)  # it never checked in
        assert pub.actors["a1"].versions.get("solver", 0) == version - 1  # not yet
        pub.done("solver", version, 0.1, ok=True, digest="d", left_out=["fake"])
        assert pub.actors["a1"].versions["solver"] == version
    assert pub.actors["fake"].versions.get("solver", 0) == 0
    assert pub.counters["weight_loads_unexpected"] == 3
    assert pub.counters["weight_digest_match"] == 3
    assert pub.take_never_joined() == ["fake"]


def test_a_member_the_learner_names_as_breaking_a_publish_is_counted_and_tried_alone() -> None:
    """PublishDone.broke: rank 0 saw `fake` check in and never write its rendezvous entry.
    It counts as two missed joins against `fake` alone (it proved it was there, then held
    up everyone) and nobody else becomes a suspect; the honest member's re-publish goes
    without it, and `fake` is re-published to alone, so it never fails an honest actor's
    group again: its second break drops it (once)."""
    pub = publishing("a1", "fake")
    plan, _ = pub.plan("solver", 1, "h:1", now=0.0)
    assert plan.members == ["a1", "fake"]
    pub.done("solver", 1, 10.0, ok=False, broke=["fake"], now=0.0)
    assert pub.missed_joins == {"fake": 2} and not pub.suspects.get("solver")
    assert pub.take_never_joined() == []  # one break: an honest actor may stall once
    pub.loaded("a1", "solver", 1, ok=False, now=1.0)  # its rendezvous failed too
    assert pub.stale_actors("solver", 1, now=1.0) == ["a1", "fake"]  # fake: not receiving
    assert pub.plan("solver", 1, "h:1", now=1.0)[0].members == ["a1"]
    pub.done("solver", 1, 0.1, ok=True, now=1.0)
    pub.loaded("a1", "solver", 1, ok=True)
    assert pub.plan("solver", 2, "h:1", now=2.0)[0].members == ["a1"]  # on probation
    pub.done("solver", 2, 0.1, ok=True, now=2.0)
    pub.loaded("a1", "solver", 2, ok=True)
    assert pub.plan("solver", 2, "h:1", now=3.0)[0].members == ["fake"]  # alone
    pub.done("solver", 2, 10.0, ok=False, broke=["fake"], now=3.0)
    pub.done("solver", 2, 10.0, ok=False, broke=["fake"], now=3.0)  # a second, before the drop
    assert pub.take_never_joined() == ["fake"]  # handed over once
    assert pub.counters["weight_publishes_failed"] == 3
