"""Per-agent variation diagnostics of a batch and algorithm.skip_zero_variance: which groups
carry a signal, what the step's metrics say about them, and the broker's accounting when
groups without one are left out (every model skips the same ones; none is trained twice)."""

from __future__ import annotations

import collections
import logging

import pytest

from drmas.broker.buffers import ModelBuffer, StepColumns, split_group
from drmas.broker.metrics import StepMetrics
from drmas.broker.state import BrokerState
from drmas.broker.variation import AgentVariation, ZeroVarianceFilter, agent_variation
from drmas.config import ConfigError, load_config
from drmas.config.broker import AdvantageConfig
from drmas.protocol import pack_ids, pack_logprobs
from drmas.protocol.messages import Episode, NoBatch, Step, Task, pack_group
from drmas.tasks.source import TaskSource

TASK = Task("t", "q", "a")


def step(agent: str, valid: bool = True, reward: float | None = None) -> Step:
    ids, lp = pack_ids([4, 5]), pack_logprobs([-0.5, -0.25])
    return Step(agent, agent, pack_ids([1, 2, 3]), ids, lp, 0, valid, "stop", reward)


def columns(rows: list[tuple[str, float, float]]) -> StepColumns:
    """(agent, score, reward) per step; the other columns do not matter here."""
    n = len(rows)
    return StepColumns(
        agents=[a for a, _, _ in rows],
        versions=[0] * n,
        spans=[(0, 0, 0, 0)] * n,
        scores=[s for _, s, _ in rows],
        rewards=[r for _, _, r in rows],
        episode_ids=list(range(n)),
    )


def test_agent_variation_tells_signal_penalty_only_lone_and_flat():
    out = agent_variation(
        columns([
            ("a", 1.0, 1.0), ("a", 1.0, 1.0), ("a", 0.9, 1.0),  # only the penalty moves a
            ("b", 0.0, 0.0), ("b", 1.0, 1.0),  # its rewards differ
            ("c", 0.5, 0.5),  # called once
            ("d", 1.0, 1.0), ("d", 1.0, 1.0),  # all equal
            ("e", 0.9, 1.0), ("e", 0.0, 0.1),  # rewards differ too (role rewards): a signal
        ])
    )  # fmt: skip
    assert out == {
        "a": AgentVariation(3, True, True),
        "b": AgentVariation(2, True, False),
        "c": AgentVariation(1, False, False),
        "d": AgentVariation(2, False, False),
        "e": AgentVariation(2, True, False),
    }


def test_batch_metrics_count_groups_per_agent_and_the_largest_advantage():
    # Two groups of 3 episodes, solver S and verifier V on one model:
    #   group 0: rewards (1, 1, 1), V invalid in episode 2 -> S flat, V penalty-only;
    #   group 1: rewards (1, 0, 0), S called twice in episode 0, V once in episode 1 only.
    # V in group 0: scores 1, 1, 0.9: μ = 2.9/3, σ = 0.1/√3; its smallest step gets
    #   (0.9 − 2.9/3)/(0.1/√3 + 1e-6) = −1.1547 -> |A| max of V over the batch: V's lone step
    #   in group 1 has score 0 -> advantage 0 (mean 0, std 1).
    # S in group 1: scores 1, 1, 0, 0: μ = 0.5, σ = sqrt(1/3) -> |A| = 0.5·√3 = 0.8660.
    g0 = [Episode([step("s"), step("v")], 1.0), Episode([step("s"), step("v")], 1.0),
          Episode([step("s"), step("v", valid=False)], 1.0)]  # fmt: skip
    g1 = [Episode([step("s"), step("s")], 1.0), Episode([step("s"), step("v")], 0.0),
          Episode([step("s")], 0.0)]  # fmt: skip
    buf = ModelBuffer("m", 2, 0, AdvantageConfig())
    for gid, episodes in enumerate((g0, g1)):
        result = pack_group("actor", gid, gid, episodes)
        buf.add(split_group(gid, TASK, result, {"s": "m", "v": "m"}, 0.1)["m"])
    batch = buf.batch_for(0, 1)
    assert batch is not None
    stats = batch.stats
    assert {k: stats[k] for k in stats if k.startswith("groups_")} == {
        "groups_acting/s": 2.0, "groups_lone/s": 0.0, "groups_varying/s": 1.0,
        "groups_penalty_only/s": 0.0,
        "groups_acting/v": 2.0, "groups_lone/v": 1.0, "groups_varying/v": 1.0,
        "groups_penalty_only/v": 1.0,
    }  # fmt: skip
    assert stats["advantage/v/max_abs"] == pytest.approx((0.2 / 3) / (0.1 / 3**0.5 + 1e-6))
    assert stats["advantage/s/max_abs"] == pytest.approx(0.5 * 3**0.5, rel=1e-5)
    assert stats["steps/s"] == 7.0  # batch_stats is still there


def make_state(*overrides: str) -> BrokerState:
    cfg = load_config(
        ["group_size=2", "batch_groups=2", "train.steps=2", "val.every=0", *overrides]
    )
    return BrokerState(cfg, TaskSource(cfg.task))


def two_agent_group(lease, rewards, valid=(True, True)):
    episodes = [Episode([step("solver"), step("verifier", v)], r) for r, v in zip(rewards, valid)]
    return pack_group("a", lease.lease_id, lease.group_id, episodes)


def test_zero_variance_groups_are_skipped_by_every_model_and_batches_fill_from_later_ones():
    st = make_state("algorithm.skip_zero_variance=true")
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    # the groups' rewards: tied (skipped), split (kept), penalty-only for the verifier
    # (kept: its scores vary), tied again (skipped), split (kept)
    plan = [((1.0, 1.0), (True, True)), ((1.0, 0.0), (True, True)),
            ((0.0, 0.0), (True, False)), ((0.0, 0.0), (True, True)), ((0.0, 1.0), (True, True))]  # fmt: skip
    kept, skipped, tasks_of_skipped = [], [], set()
    versions = {"solver": 0, "verifier": 0}
    for rewards, valid in plan:
        (lease,) = st.lease("a", 1, dict(versions), 0.0).leases
        assert st.accept("a", two_agent_group(lease, rewards, valid), 0.0) == ""
        tied = len(set(rewards)) == 1 and all(valid)
        (skipped if tied else kept).append(lease.group_id)
        if tied:
            tasks_of_skipped.add(lease.task.task_id)
        if len(kept) == 2 and versions["solver"] == 0:
            for m in versions:  # the first batch: the first two groups with a signal
                batch = st.batch(m, 0, 1, 0, 0.0)
                assert not isinstance(batch, NoBatch)
                assert [s.group_id for s in st.buffers[m].cut[0].slices] == kept
                st.step_report(m, 1, {})
                versions[m] = 1
    assert st.counters["zero_variance_groups_skipped"] == 2
    assert isinstance(st.batch("solver", 0, 1, 1, 0.0), NoBatch)  # 1 of 2 groups buffered
    (lease,) = st.lease("a", 1, dict(versions), 0.0).leases  # a later group tops it up
    assert lease.task.task_id not in tasks_of_skipped  # skipped tasks are not requeued
    st.accept("a", two_agent_group(lease, (1.0, 0.0)), 0.0)
    kept.append(lease.group_id)
    for m in versions:
        assert not isinstance(st.batch(m, 0, 1, 1, 0.0), NoBatch)
        st.step_report(m, 2, {})
    assert st.train_done and st.counters["groups_trained_twice"] == 0
    assert st.trained_groups["solver"] == st.trained_groups["verifier"] == set(kept)
    assert st.accepted_groups == set(kept) | set(skipped)
    assert not any(st.buffers[m].untrained_groups() for m in versions)  # nothing to requeue


def test_without_the_option_a_tied_group_is_trained_as_before():
    st = make_state()
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    for lease in st.lease("a", 2, {}, 0.0).leases:
        st.accept("a", two_agent_group(lease, (1.0, 1.0)), 0.0)
    batch = st.batch("solver", 0, 1, 0, 0.0)
    assert not isinstance(batch, NoBatch) and {s.advantage for s in batch.samples} == {0.0}
    assert "zero_variance_groups_skipped" not in st.counters


def test_a_model_whose_agent_is_absent_skips_the_same_groups():
    # search_tiny: verifier, searcher and answerer on three models; the searcher acts in
    # some groups only. A group is skipped for all or for none, decided on the whole group.
    st = make_state("experiment=search_tiny", "algorithm.skip_zero_variance=true")
    models = ["answerer", "searcher", "verifier"]
    st.add_actor("a", "h", 1, models, 0.0)
    shapes = [
        (["verifier", "answerer"], (1.0, 1.0)),  # tied, no searcher: skipped
        (["verifier", "searcher", "answerer"], (0.0, 0.0)),  # tied with searcher: skipped
        (["verifier", "searcher", "answerer"], (1.0, 0.0)),  # kept by all three
        (["verifier", "answerer"], (0.0, 1.0)),  # kept (the searcher has no slice)
    ]
    for agents, rewards in shapes:
        (lease,) = st.lease("a", 1, dict.fromkeys(models, 0), 0.0).leases
        episodes = [Episode([step(a) for a in agents], r) for r in rewards]
        st.accept("a", pack_group("a", lease.lease_id, lease.group_id, episodes), 0.0)
    ids = sorted(st.accepted_groups)
    assert st.counters["zero_variance_groups_skipped"] == 2
    assert [p.group_id for p in st.buffers["verifier"].slices] == ids[2:]
    assert [p.group_id for p in st.buffers["answerer"].slices] == ids[2:]
    assert [p.group_id for p in st.buffers["searcher"].slices] == ids[2:3]


def _search_plan(by: str) -> BrokerState:
    """search_tiny (three models) takes in three groups of 2 episodes, each agent paid its
    own role reward: A, every agent's pay differs between the episodes; B, the verifier's
    pay differs, the answerer's ties (no searcher); C, every pay ties."""
    st = make_state(
        "experiment=search_tiny", "algorithm.skip_zero_variance=true",
        f"algorithm.zero_variance_by={by}",
    )  # fmt: skip
    models = ["answerer", "searcher", "verifier"]
    st.add_actor("a", "h", 1, models, 0.0)
    plan = [
        {"verifier": (1.0, 0.0), "searcher": (0.0, 1.0), "answerer": (1.0, 0.0)},
        {"verifier": (1.0, 0.0), "answerer": (1.0, 1.0)},
        {"verifier": (1.0, 1.0), "answerer": (0.0, 0.0)},
    ]
    for pay in plan:
        (lease,) = st.lease("a", 1, dict.fromkeys(models, 0), 0.0).leases
        episodes = [
            Episode([step(agent, reward=r[e]) for agent, r in pay.items()], 0.0) for e in (0, 1)
        ]
        st.accept("a", pack_group("a", lease.lease_id, lease.group_id, episodes), 0.0)
    return st


def test_by_model_each_model_leaves_out_its_own_slices_without_signal():
    st = _search_plan("model")
    a, b, _ = sorted(st.accepted_groups)
    assert [p.group_id for p in st.buffers["verifier"].slices] == [a, b]
    assert [p.group_id for p in st.buffers["answerer"].slices] == [a]  # B tied for it
    assert [p.group_id for p in st.buffers["searcher"].slices] == [a]
    c = st.counters
    assert c["zero_variance_slices_skipped/answerer"] == 2
    assert c["zero_variance_slices_skipped/verifier"] == 1
    assert "zero_variance_slices_skipped/searcher" not in c
    assert c["zero_variance_groups_skipped"] == 1  # C: no model kept it


def test_by_group_a_group_with_any_signal_reaches_every_model():
    st = _search_plan("group")
    a, b, _ = sorted(st.accepted_groups)
    assert [p.group_id for p in st.buffers["answerer"].slices] == [a, b]  # B, all zeros
    assert st.counters["zero_variance_groups_skipped"] == 1
    assert not [k for k in st.counters if k.startswith("zero_variance_slices_skipped")]


def test_zero_variance_by_model_needs_the_filter_on():
    with pytest.raises(ConfigError, match=r"set algorithm\.skip_zero_variance=true"):
        load_config(["algorithm.zero_variance_by=model"])


def test_a_long_run_of_skipped_groups_is_logged(caplog):
    cfg = load_config(["batch_groups=2", "algorithm.skip_zero_variance=true"])
    counters: collections.Counter[str] = collections.Counter()
    zero = ZeroVarianceFilter(cfg, counters)
    tied = split_group(
        0, TASK, pack_group("a", 0, 0, [Episode([step("solver")], 1.0)] * 2),
        {"solver": "solver"}, 0.1,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="drmas.broker"):
        assert all(zero.skip(tied) for _ in range(40))
    assert counters["zero_variance_groups_skipped"] == 40
    assert len([r for r in caplog.records if "skip_zero_variance" in r.getMessage()]) == 2


def test_the_step_line_carries_the_running_count():
    class Lines:
        def __init__(self) -> None:
            self.lines: list[dict[str, float]] = []

        def write(self, record: dict[str, float]) -> None:
            self.lines.append(record)

        def close(self) -> None:
            pass

    sink = Lines()
    metrics = StepMetrics(sink, ["m"])
    metrics.report(1, "m", "step", {}, {})
    metrics.report(1, "m", "publish", {}, {"zero_variance_groups_skipped": 3})
    assert sink.lines[0]["zero_variance_groups_skipped"] == 3
