"""Broker rules without sockets: admission, freshness, staleness, re-issue, accounting."""

from __future__ import annotations

import time

import pytest

from drmas.broker.state import BrokerState
from drmas.config import load_config
from drmas.protocol import pack_ids, pack_logprobs
from drmas.protocol.messages import Episode, GroupResult, NoBatch, Step, pack_group
from drmas.tasks.source import TaskSource
from tests.fixtures.holding import hold


def make_state(*overrides: str) -> BrokerState:
    cfg = load_config(
        ["group_size=2", "batch_groups=2", "train.steps=3", "val.every=0", *overrides]
    )
    return BrokerState(cfg, TaskSource(cfg.task))


def step(agent: str, version: int = 0, valid: bool = True) -> Step:
    return Step(
        agent=agent,
        model=agent,
        prompt_ids=pack_ids([1, 2, 3]),
        response_ids=pack_ids([4, 5]),
        logprobs=pack_logprobs([-0.5, -0.25]),
        version=version,
        valid=valid,
        finish_reason="stop",
    )


def result(lease, version: int = 0, rewards=(1.0, 0.0), actor: str = "a") -> GroupResult:
    episodes = [Episode([step("solver", version), step("verifier", version)], r) for r in rewards]
    return pack_group(actor, lease.lease_id, lease.group_id, episodes)


def test_admission_caps_in_flight_at_eta_plus_one_batches():
    st = make_state("algorithm.max_staleness=1")
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    leases = st.lease("a", 100, {"solver": 0, "verifier": 0}, 0.0)
    assert len(leases.leases) == 4  # (η + 1) · B = 2 · 2
    assert "admission control" in leases.reason


def test_synchronous_eta0_waits_for_fresh_weights():
    st = make_state("algorithm.max_staleness=0")
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    first = st.lease("a", 100, {"solver": 0, "verifier": 0}, 0.0).leases
    assert len(first) == 2  # B groups, all for version 0
    for lease in first:
        assert st.accept("a", result(lease), 0.0) == ""
    for model in ("solver", "verifier"):
        assert st.batch(model, 0, 1, 0, 0.0).version == 0  # cut for version 0
    # batch 0 is cut: the next groups train version 1, so a v0 actor must wait
    refused = st.lease("a", 100, {"solver": 0, "verifier": 0}, 0.0)
    assert refused.leases == [] and "waiting for weights" in refused.reason
    claimed = st.lease("a", 100, {"solver": 1, "verifier": 1}, 0.0)
    assert claimed.leases == []  # versions it claims are not taken: only loads the broker saw
    hold(st, "a", solver=1, verifier=1)
    fresh = st.lease("a", 100, {"solver": 1, "verifier": 1}, 0.0)
    assert len(fresh.leases) == 2


def test_an_actor_attaching_mid_run_waits_for_the_current_weights():
    st = make_state("algorithm.max_staleness=2")
    st.versions.update(solver=2, verifier=1)  # the models have trained: a mid-run Hello
    st.add_actor("late", "h", 1, ["solver", "verifier"], 0.0)
    # η = 2 would admit a v0 actor's groups, but an attaching actor waits for the weights
    # current at its Hello, model by model
    hold(st, "late", verifier=1)
    waiting = st.lease("late", 4, {"solver": 2, "verifier": 1}, 0.0)  # a claim: not taken
    assert waiting.leases == []
    assert waiting.reason == ("attached mid-run, waiting for the current weights: solver v0 < v2")
    assert st.counters["actors_synced_on_attach"] == 0
    hold(st, "late", solver=2)
    synced = st.lease("late", 4, {"solver": 2, "verifier": 1}, 0.0)
    assert synced.leases and st.counters["actors_synced_on_attach"] == 1
    # once synced, only the ordinary rules apply (its wait is not asked again)
    assert st.lease("late", 1, {"solver": 2, "verifier": 1}, 0.0).reason == ""
    # an actor present from the start (all models at v0) never waits
    fresh = make_state()
    fresh.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    assert fresh.lease("a", 1, {"solver": 0, "verifier": 0}, 0.0).leases


def test_no_more_groups_are_leased_than_train_steps_need():
    st = make_state("algorithm.max_staleness=10")  # admission control would allow 22
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    leases = st.lease("a", 100, {"solver": 0, "verifier": 0}, 0.0)
    assert len(leases.leases) == 6  # train.steps · B = 3 · 2
    assert leases.reason == "enough groups for train.steps are in flight or buffered"
    # a group handed back is needed again
    st.hand_back("a", [leases.leases[0].lease_id])
    again = st.lease("a", 100, {"solver": 0, "verifier": 0}, 0.0)
    assert [le.task.task_id for le in again.leases] == [leases.leases[0].task.task_id]


def test_batch_cut_shards_equal_counts_with_zero_weight_padding():
    st = make_state("group_size=3")
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    for lease in st.lease("a", 2, {}, 0.0).leases:
        st.accept("a", result(lease, rewards=(1.0, 0.0, 1.0)), 0.0)
    shards = [st.batch("solver", r, 4, 0, 0.0) for r in range(4)]  # 6 solver samples over 4 ranks
    assert {len(s.samples) for s in shards} == {2}
    assert sum(sum(s.weights) for s in shards) == 6
    assert all(s.total_samples == 6 and s.total_tokens == 12 for s in shards)
    again = st.batch("solver", 1, 4, 0, 0.0)  # a retried request gets the same shard
    assert again is shards[1]


def test_stale_groups_are_dropped_counted_and_requeued():
    st = make_state("algorithm.max_staleness=0")
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    leases = st.lease("a", 2, {}, 0.0).leases
    for lease in leases:
        st.accept("a", result(lease, version=0), 0.0)
    reply = st.batch("solver", 0, 1, 1, 0.0)  # learner already at version 1: v0 data is stale
    assert isinstance(reply, NoBatch)
    assert st.counters["dropped_stale_groups"] == 2
    assert st.source.next_task().task_id in {lease.task.task_id for lease in leases}


def test_silent_actor_loses_leases_and_its_late_result_is_refused():
    st = make_state()
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    st.add_actor("b", "h", 2, ["solver", "verifier"], 0.0)
    lease = st.lease("a", 1, {}, 0.0).leases[0]
    st.seen("b", 100.0)
    st.reap(100.0)  # "a" silent for 100 s > heartbeat_timeout_s
    assert "a" not in st.table.actors and st.counters["leases_reissued"] == 1
    again = st.lease("b", 1, {}, 100.0).leases[0]
    assert again.task.task_id == lease.task.task_id and again.group_id != lease.group_id
    st.add_actor("a", "h", 1, ["solver", "verifier"], 101.0)  # comes back, sends the old result
    assert "not held" in st.accept("a", result(lease, actor="a"), 101.0)
    assert st.accept("b", result(again, actor="b"), 101.0) == ""
    assert st.accepted_groups == {again.group_id}


def test_every_accepted_group_is_trained_once_per_model():
    st = make_state("train.steps=2")
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    for version in range(2):
        leases = st.lease("a", 2, {"solver": version, "verifier": version}, 0.0).leases
        for lease in leases:
            st.accept("a", result(lease, version=version), 0.0)
        for model in ("solver", "verifier"):
            assert st.batch(model, 0, 1, version, 0.0).version == version
            st.step_report(model, version + 1, {})
    assert st.counters["groups_trained_twice"] == 0
    assert st.trained_groups["solver"] == st.trained_groups["verifier"] == st.accepted_groups
    assert len(st.accepted_groups) == 4 and st.train_done
    assert st.batch("solver", 0, 1, 2, 0.0).done


def test_actor_must_serve_every_model():
    st = make_state()
    assert "missing ['verifier']" in st.actor_refusal(["solver"])
    with pytest.raises(ValueError, match="missing"):  # the gate asks first; this is a bug
        st.add_actor("a", "h", 1, ["solver"], 0.0)
    assert not st.table.actors and not st.counters


@pytest.mark.parametrize("mode", ["global", "agent"])
def test_group_advantages_reach_the_samples(mode):
    st = make_state(f"algorithm.advantage.mode={mode}")
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    for lease in st.lease("a", 2, {}, 0.0).leases:
        st.accept("a", result(lease, rewards=(1.0, 0.0)), 0.0)
    shard = st.batch("solver", 0, 1, 0, 0.0)
    # rewards (1, 0) in each group: unbiased std = 0.7071, advantages ±0.7071
    assert sorted(round(s.advantage, 4) for s in shard.samples) == [
        -0.7071,
        -0.7071,
        0.7071,
        0.7071,
    ]


def test_actors_behind_the_learner_get_a_republish_of_its_version():
    st = make_state("train.steps=10")
    now = time.monotonic()
    st.add_actor("a", "h", 1, ["solver", "verifier"], now)
    st.versions["solver"] = 4
    hold(st, "a", solver=2, verifier=4)  # its sync of v3 failed
    reply = st.batch("solver", 0, 1, 4, now)
    assert isinstance(reply, NoBatch) and reply.republish
    plan, joins = st.weights.plan(
        "solver", 4, "h:1", now=time.monotonic()
    )  # first plan of v4: everyone
    assert plan.members == ["a"] and joins[0][1].rank == 1
    assert not st.batch("solver", 0, 1, 4, now).republish  # a publish is in flight
    st.weights.done("solver", 4, 0.1, ok=False)
    # it failed, but a may still be receiving the failed one: no re-publish to it yet
    assert not st.batch("solver", 0, 1, 4, now).republish
    plan, _ = st.weights.plan("solver", 4, "h:1", now=time.monotonic())
    assert plan.members == []  # nor is it planned in
    st.weights.loaded("a", "solver", 4, ok=False)  # its load failed too: now it is free
    assert st.batch("solver", 0, 1, 4, now).republish  # ask again
    plan, _ = st.weights.plan(
        "solver", 4, "h:1", now=time.monotonic()
    )  # a re-plan: only stale actors
    assert plan.members == ["a"] and st.counters["weight_republishes"] == 2
    st.weights.loaded("a", "solver", 4, ok=True)
    st.weights.done("solver", 4, 0.1, ok=True)
    assert not st.batch("solver", 0, 1, 4, now).republish


def test_split_group_spans_give_back_each_models_steps_and_scores():
    from drmas.broker.buffers import batch_samples, split_group

    cfg = load_config(["group_size=2"])
    steps = [
        [step("solver"), step("verifier", version=2, valid=False), step("solver", version=3)],
        [step("verifier", version=1), step("solver")],
    ]
    for i, s in enumerate(s for ep in steps for s in ep):  # distinct ids per step
        s.prompt_ids = pack_ids([i] * (i + 1))
        s.response_ids = pack_ids([i, i + 1])
    episodes = [Episode(steps[0], 1.0), Episode(steps[1], 0.0)]
    group = pack_group("a", 1, 7, episodes)
    slices = split_group(7, None, group, {"solver": "solver", "verifier": "verifier"}, 0.5)
    solver, verifier = slices["solver"], slices["verifier"]
    assert solver.steps == [0, 2, 4] and verifier.steps == [1, 3]
    assert (solver.min_version, verifier.min_version) == (0, 1)
    assert verifier.columns.scores == [0.5, 0.0]  # the invalid step pays the penalty
    assert verifier.columns.episode_ids == [0, 1]
    samples = batch_samples([solver], cfg.algorithm.advantage)
    expected = [steps[0][0], steps[0][2], steps[1][1]]
    assert [(s.prompt_ids, s.response_ids, s.logprobs) for s in samples] == [
        (e.prompt_ids, e.response_ids, e.logprobs) for e in expected
    ]
    assert [s.version for s in samples] == [0, 3, 0]


class ListSink:
    """A metrics sink that keeps the lines it is given."""

    def __init__(self):
        self.lines = []

    def write(self, record):
        self.lines.append(record)

    def close(self):
        pass


def test_a_step_line_is_written_once_even_when_parts_of_it_come_late():
    from drmas.broker.metrics import StepMetrics

    sink = ListSink()
    metrics = StepMetrics(sink, ["m"])  # type: ignore[arg-type]
    metrics.report(1, "m", "step", {"loss/m": 0.5}, {})
    metrics.report(1, "m", "publish", {"weight_sync_s/m": 0.1}, {})
    assert [x["step"] for x in sink.lines] == [1]
    # a re-publish of version 1 to a late actor, and a resumed run's restored steps
    metrics.report(1, "m", "publish", {"weight_sync_s/m": 0.2}, {})
    metrics.flushed.update({2})
    metrics.report(2, "m", "publish", {"weight_sync_s/m": 0.3}, {})
    metrics.close({})
    assert [x["step"] for x in sink.lines] == [1]


def test_episode_metrics_become_rollout_means_per_line_and_val_means_per_round():
    from drmas.broker.evaluation import EvalRound
    from drmas.broker.metrics import StepMetrics
    from drmas.protocol.messages import EpisodeHeader, Task

    sink = ListSink()
    metrics = StepMetrics(sink, ["m"])  # type: ignore[arg-type]
    metrics.count_episodes(
        [
            EpisodeHeader([], 1.0, {"search_calls": 2.0, "em": 1.0}),
            EpisodeHeader([], 0.0, {"search_calls": 1.0, "em": 0.0}),
            EpisodeHeader([], 0.0),  # a workflow without metrics still counts its reward
        ]
    )
    metrics.report(1, "m", "step", {}, {})
    metrics.report(1, "m", "publish", {}, {})
    metrics.report(2, "m", "step", {}, {})
    metrics.report(2, "m", "publish", {}, {})
    first, second = sink.lines
    assert first["rollout/search_calls"] == 1.5 and first["rollout/em"] == 0.5
    assert first["rollout/reward"] == pytest.approx(1 / 3)
    assert not any(k.startswith("rollout/") for k in second)  # nothing accepted since

    rnd = EvalRound(step=0, tasks=[Task("a", "q", "x"), Task("b", "q", "y")], n=2, k=2)
    rnd.record(Task("a", "q", "x"), [1.0, 0.0], [{"f1": 1.0}, {"f1": 0.5}])
    rnd.record(Task("a", "q", "x"), [0.0, 0.0], [{"f1": 0.0}, {"f1": 0.0}])  # duplicate: kept first
    assert not rnd.complete
    rnd.record(Task("b", "q", "y"), [0.0, 0.0], [{"f1": 0.0}, {"f1": 0.5}])
    out = rnd.metrics()
    assert out["val/f1"] == 0.5 and out["val/avg@2"] == 0.25 and out["val/pass@2"] == 0.5
    # Standard errors over the 2 tasks: avg@2 per task 0.5, 0 -> sample std sqrt(0.125),
    # se = sqrt(0.125 / 2) = 0.25; f1 per task 0.75, 0.25 -> se 0.25 as well.
    assert out["val/avg@2/se"] == pytest.approx(0.25)
    assert out["val/pass@2/se"] == pytest.approx(0.5)  # pass@2 per task 1, 0
    assert out["val/f1/se"] == pytest.approx(0.25)
    assert not any(k.count("/") > 2 or k.startswith("val/default") for k in out)  # one source


def test_validation_reports_each_data_source_when_there_are_several():
    from drmas.broker.evaluation import EvalRound
    from drmas.protocol.messages import Task

    tasks = [Task("a", "q", "1", "math500"), Task("b", "q", "2", "math500"),
             Task("c", "q", "3", "aime24")]  # fmt: skip
    rnd = EvalRound(step=0, tasks=tasks, n=2, k=2)
    for task, rewards in zip(tasks, ([1.0, 1.0], [0.0, 1.0], [0.0, 0.0])):
        rnd.record(task, rewards)
    out = rnd.metrics()
    assert out["val/avg@2"] == pytest.approx(0.5)  # over all 3 tasks
    assert out["val/math500/avg@2"] == 0.75 and out["val/math500/pass@2"] == 1.0
    assert out["val/math500/tasks"] == 2.0 and out["val/math500/avg@2/se"] == pytest.approx(0.25)
    assert out["val/aime24/avg@2"] == 0.0 and out["val/aime24/tasks"] == 1.0


def test_a_model_called_in_few_episodes_still_gets_all_its_batches():
    """The search team's Search Agent is skipped when the Verifier approves at once: its
    model's batches fill more slowly. The models that finish first must not keep counting
    against admission control, or the slow one would starve (a deadlock)."""
    st = make_state("experiment=search_tiny", "algorithm.max_staleness=1")
    models = ["answerer", "searcher", "verifier"]
    st.add_actor("a", "h", 1, models, 0.0)
    versions = dict.fromkeys(models, 0)
    groups = 0
    for _ in range(200):
        for lease in st.lease("a", 4, dict(versions), 0.0).leases:
            groups += 1
            agents = (
                ["verifier", "searcher", "answerer"]
                if groups % 4 == 0
                else ["verifier", "answerer"]
            )
            episodes = [Episode([step(a, versions[a]) for a in agents], r) for r in (1.0, 0.0)]
            assert (
                st.accept("a", pack_group("a", lease.lease_id, lease.group_id, episodes), 0.0) == ""
            )
        for m in models:
            reply = st.batch(m, 0, 1, versions[m], 0.0)
            if not isinstance(reply, NoBatch):
                versions[m] += 1
                st.step_report(m, versions[m], {})
                hold(st, "a", **{m: versions[m]})  # published and loaded
        if st.train_done:
            break
    assert st.train_done, (versions, st.counters)
    assert versions == dict.fromkeys(models, 3)
    assert st.counters["groups_trained_twice"] == 0
    assert st.counters["slices_after_last_batch/verifier"] > 0  # groups only the searcher needed


def test_skipped_optimizer_updates_are_totalled_per_model():
    st = make_state()
    st.step_report("solver", 1, {"skipped_steps/solver": 2.0})
    st.step_report("solver", 2, {"skipped_steps/solver": 0.0})
    st.step_report("verifier", 1, {"skipped_steps/verifier": 1.0})
    st.step_report("solver", 3, {"skipped_steps/solver": 1.0})
    assert st.counters["skipped_steps/solver"] == 3
    assert st.counters["skipped_steps/verifier"] == 1


@pytest.mark.parametrize(("at_start", "rounds"), [(True, [0, 2, 3]), (False, [2, 3])])
def test_validation_rounds_are_every_n_steps_the_end_and_step_0_unless_switched_off(
    at_start, rounds
):
    st = make_state("val.every=2", f"val.at_start={str(at_start).lower()}", "val.num_tasks=2")
    st._schedule_eval()
    assert sorted(st.validation.scheduled) == ([0] if at_start else [])  # before any step
    st.versions = {"solver": 3, "verifier": 3}
    st._schedule_eval()
    assert sorted(st.validation.scheduled) == rounds


def test_nothing_is_published_to_actors_after_shutdown():
    """A learner's publish planned after the broker told the actors to stop used to wait
    the whole weights.timeout_s for them, then log a false "weight broadcast failed"."""
    st = make_state()
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    plan, joins = st.weights.plan("solver", 1, "h:1", 0.0)
    assert plan.members == ["a"] and joins
    st.weights.done("solver", 1, 0.1, ok=True)
    st.weights.closed = True  # BrokerServer.broadcast_shutdown sets it
    plan, joins = st.weights.plan("solver", 2, "h:1", 0.0)
    assert plan.members == [] and joins == [] and st.counters["weight_publishes"] == 2


def test_a_models_weight_group_is_kept_while_members_and_store_are():
    st = make_state("train.steps=20")
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    st.add_actor("b", "h", 2, ["solver", "verifier"], 0.0)
    names = []
    store = "h:1"

    def publish(version: int, ok: bool = True) -> str:
        plan, joins = st.weights.plan("solver", version, store, 0.0)
        assert all(j.group_name == plan.group_name for _, j in joins)
        st.weights.done("solver", version, 0.1, ok=ok)
        for cid in plan.members:  # they are done receiving (what they loaded: below)
            st.weights.joining.pop((cid, "solver"), None)
        names.append(plan.group_name)
        return plan.group_name

    first = publish(1)
    assert publish(2) == first and publish(3) == first  # same members, same store
    assert st.weights.plan("verifier", 1, "h:9", 0.0)[0].group_name != first  # per model
    st.add_actor("c", "h", 3, ["solver", "verifier"], 0.0)  # a new membership
    second = publish(4)
    assert second != first and publish(5) == second
    store = "h:2"  # a restarted learner has a new store
    third = publish(6)
    assert third != second
    failed = publish(7, ok=False)  # the publish failed: the next one forms a new group
    assert failed == third and publish(8) != third
    fourth = names[-1]
    st.weights.loaded("a", "solver", 8, ok=False)  # an actor's load failed: likewise
    assert publish(9) != fourth
    # a re-publish to the stale actors only is a one-off group, and retires the kept one
    for actor in ("b", "c"):
        hold(st, actor, solver=9)  # "a" still holds an old version
    before = names[-1]
    plan, _ = st.weights.plan("solver", 9, "h:2", 0.0)
    assert plan.members == ["a"] and plan.group_name != before
    st.weights.done("solver", 9, 0.1, ok=True)
    assert publish(10) not in (before, plan.group_name)
    c = st.counters
    assert c["weight_groups_kept"] == 4  # v2, v3, v5, v7
    assert c["weight_groups_formed"] == 8  # v1, the verifier's, v4, v6, v8, v9, subset, v10


def test_the_last_steps_weights_go_out_only_for_the_final_validation():
    """Without validation nothing uses them, and an actor told to stop before it joined
    would leave the learner waiting out weights.timeout_s."""
    for every, members in ((0, []), (2, ["a"])):
        st = make_state(f"val.every={every}")  # train.steps=3
        st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
        assert st.weights.plan("solver", 2, "h:1", 0.0)[0].members == ["a"]
        st.weights.done("solver", 2, 0.1, ok=True)
        st.weights.loaded("a", "solver", 2, ok=True)
        assert st.weights.plan("solver", 3, "h:1", 0.0)[0].members == members


def test_an_actor_still_receiving_a_failed_publish_is_not_planned_into_the_next():
    """A publish that fails at rank 0 leaves its members receiving until their own timeout:
    planned into the next roll call meanwhile, such an actor would miss it and, three
    times over, be dropped as one that never joins (CI saw it under load). It is planned
    again once it reports its load, or once weights.timeout_s + join_timeout_s passed."""
    st = make_state("train.steps=20")
    for cid in ("a", "b"):
        st.add_actor(cid, "h", 1, ["solver", "verifier"], 0.0)
    assert st.weights.plan("solver", 1, "h:1", 0.0)[0].members == ["a", "b"]
    st.weights.done("solver", 1, 0.1, ok=False)
    st.weights.loaded("b", "solver", 1, ok=False)  # b's receive has ended; a's has not
    assert st.weights.plan("solver", 2, "h:1", 1.0)[0].members == ["b"]
    assert st.counters["weight_joins_deferred"] == 1
    st.weights.done("solver", 2, 0.1, ok=True)
    st.weights.loaded("b", "solver", 2, ok=True)
    bound = st.cfg.weights.timeout_s + st.cfg.weights.join_timeout_s
    assert st.weights.plan("solver", 3, "h:1", bound + 0.1)[0].members == ["a", "b"]
    assert st.counters.get("weight_joins_missed", 0) == 0


def test_one_actor_holds_at_most_its_lease_cap_validation_included():
    """A fake actor took 272 leases (256 validation, 16 training) and the run made no step:
    an actor holds at most broker.max_leases_per_actor (0: actor.max_groups) at once."""
    st = make_state("val.every=1", "val.num_tasks=40", "actor.max_groups=3", "train.steps=10",
                    "algorithm.max_staleness=5")  # fmt: skip
    st.add_actor("fake", "h", 1, ["solver", "verifier"], 0.0)
    first = st.lease("fake", 1000, {}, 0.0)
    assert len(first.leases) == 3 and all(le.is_eval for le in first.leases)
    again = st.lease("fake", 1000, {}, 0.0)
    assert again.leases == [] and "the most one actor may" in again.reason
    assert st.counters["leases_capped"] == 1
    st.add_actor("honest", "h", 2, ["solver", "verifier"], 0.0)
    assert len(st.lease("honest", 3, {}, 0.0).leases) == 3  # the rest is not hoarded
    st.hand_back("fake", [first.leases[0].lease_id])
    assert len(st.lease("fake", 1000, {}, 0.0).leases) == 1  # room again: one
    wide = make_state("actor.max_groups=3", "broker.max_leases_per_actor=5")
    wide.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    assert len(wide.lease("a", 1000, {}, 0.0).leases) == 4  # (η + 1) · B binds first


def test_an_actor_dropped_for_missed_publishes_and_back_gets_no_lease_until_it_loads():
    """A hoarder that rejoins each time it is dropped for never joining a publish: welcomed
    again under its name, it takes no lease (validation included) while it waits out its
    re-publish back-off, and leases again once it loads a version."""
    from drmas.broker.publishing import MAX_MISSED_JOINS

    st = make_state("val.every=1", "val.num_tasks=40", "actor.max_groups=3", "train.steps=10")
    st.add_actor("hoarder", "h", 1, ["solver", "verifier"], 0.0)
    st.weights.missed_joins["hoarder"], st.weights.missed_at["hoarder"] = MAX_MISSED_JOINS, 0.0
    refused = st.lease("hoarder", 1000, {}, 0.0)
    assert refused.leases == [] and "missing weight publishes" in refused.reason
    st.weights.missed_joins.pop("hoarder")  # what a load that succeeds does
    assert len(st.lease("hoarder", 1000, {}, 0.0).leases) == 3


def test_balance_calls_weights_each_sample_by_its_agents_calls_in_its_group():
    """algorithm.advantage.balance_calls: the solver answers 3 times in group A's two
    episodes and twice in group B's: its samples weigh 1/3 and 1/2, divided by their
    mean over the model's batch (0.4), so 5/6 and 5/4; advantages are not changed (the
    learner scales them) and without the option every weight is 1."""
    from drmas.broker.buffers import call_weights

    assert call_weights([(0, "s"), (0, "s"), (0, "s"), (0, "v"), (1, "s"), (1, "v")]) == (
        pytest.approx([0.5, 0.5, 0.5, 1.5, 1.5, 1.5])
    )
    for balance, expected in ((True, [5 / 6] * 3 + [5 / 4] * 2), (False, [1.0] * 5)):
        st = make_state("batch_groups=2", f"algorithm.advantage.balance_calls={balance}")
        st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
        shapes = [(["solver", "solver", "verifier"], ["solver", "verifier"]),
                  (["solver", "verifier"], ["solver", "verifier"])]  # fmt: skip
        for lease, episodes in zip(st.lease("a", 2, {}, 0.0).leases, shapes, strict=True):
            eps = [Episode([step(agent) for agent in agents], r)
                   for agents, r in zip(episodes, (1.0, 0.0))]  # fmt: skip
            assert st.accept("a", pack_group("a", lease.lease_id, lease.group_id, eps), 0.0) == ""
        batch = st.buffers["solver"].batch_for(0, 1)
        assert batch is not None
        weights = sorted(s.loss_weight for s in batch.samples)
        assert weights == pytest.approx(sorted(expected))
        assert sum(weights) == pytest.approx(len(weights))


def test_a_learner_past_its_last_step_re_publishes_until_the_final_validation_is_done() -> None:
    """An actor that missed the last publish could never run the final validation: the
    learners had left, nobody re-published, and the run waited for ever (seen beside a
    member that broke its group). Until the run is done, a learner past train.steps is
    told to re-publish to actors behind, not that training is over."""
    st = make_state("train.steps=2", "val.every=2")
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    st.versions.update(solver=2, verifier=2)
    reply = st.batch("solver", 0, 1, 2, now=100.0)
    assert isinstance(reply, NoBatch) and not reply.done and reply.republish  # "a" is at v0
    st.validation.scheduled.add(2)  # the final round ran and closed
    st.validation.rounds.clear()
    assert st.done
    reply = st.batch("solver", 0, 1, 2, now=100.0)
    assert isinstance(reply, NoBatch) and reply.done
