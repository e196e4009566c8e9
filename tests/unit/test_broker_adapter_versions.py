"""Per-adapter versions in the broker (drmas/broker/adapter_versions.py): the history U(v)
the learners report, staleness counted in each step's own adapter, and publishes that
carry only the adapters some member lacks. Every expected value is worked out by hand in
the comments beside it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from drmas.broker.adapter_versions import AdapterVersions
from drmas.broker.buffers import ModelBuffer, split_group
from drmas.broker.metrics import StepMetrics
from drmas.broker.server import BrokerServer
from drmas.broker.state import BrokerState
from drmas.config import load_config
from drmas.protocol import PROTOCOL_VERSION, ProtocolError, pack_ids, pack_logprobs
from drmas.protocol.messages import (
    BatchRequest,
    BatchShard,
    Episode,
    Hello,
    NoBatch,
    PublishDone,
    PublishRequest,
    Step,
    StepReport,
    pack_group,
)
from drmas.tasks.source import TaskSource
from tests.fixtures.broker_server import broker_server
from tests.fixtures.holding import hold

SHARED = ["experiment=tiny_math_shared", "group_size=2", "batch_groups=2", "val.every=0"]
"""Solver and verifier on one model, `policy`; with lora.rank > 0 two adapters of it."""
LORA = [*SHARED, "models.policy.lora.rank=8"]


def lora_history(*more: str, keep: int = 1024) -> AdapterVersions:
    return AdapterVersions(load_config([*LORA, *more]), keep)


def u(solver: int, verifier: int) -> dict[str, int]:
    return {"solver": solver, "verifier": verifier}


class ListSink:
    """A metrics sink that keeps the lines it is given."""

    def __init__(self) -> None:
        self.lines: list[dict[str, float]] = []

    def write(self, record: dict[str, float]) -> None:
        self.lines.append(record)

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ history
def test_history_keeps_what_learners_report_and_version_0_is_all_zeros() -> None:
    h = lora_history()
    assert h.at("policy", 0) == u(0, 0)  # known before any report
    assert h.at("policy", 1) is None
    h.record("policy", 1, u(1, 0))
    h.record("policy", 2, u(1, 1))
    assert h.at("policy", 1) == u(1, 0) and h.at("policy", 2) == u(1, 1)
    h.record("policy", 0, u(0, 0))  # the learner's first BatchRequest: nothing to keep
    assert set(h.history["policy"]) == {1, 2}


@pytest.mark.parametrize(
    ("version", "versions", "says"),
    [
        (1, {}, "send every one of them"),  # an old learner that sends none
        (1, {"solver": 1}, "send every one of them"),  # one adapter missing
        (1, {**u(1, 0), "critic": 0}, "send every one of them"),  # one too many
        (1, u(2, 0), "integer 0..1"),  # an adapter cannot have changed more often than v
        (0, u(1, 0), "integer 0..0"),  # U(0) is all zeros
        (3, u(-1, 0), "integer 0..3"),
        (3, {"solver": 1.0, "verifier": 0}, "integer 0..3"),  # not an int
        (3, {"solver": True, "verifier": 0}, "integer 0..3"),  # a bool is no version either
    ],
)
def test_invalid_adapter_versions_are_refused_with_what_to_send(
    version: int, versions: dict[str, int], says: str
) -> None:
    h = lora_history()
    with pytest.raises(ProtocolError, match=says) as refused:
        h.record("policy", version, versions)
    assert refused.value.code == "invalid"
    assert h.history["policy"] == {}  # nothing was kept


def test_a_whole_model_takes_only_an_empty_map() -> None:
    h = AdapterVersions(load_config(["models.verifier.lora.rank=8"]))  # solver trains whole
    h.record("solver", 2, {})  # nothing to keep
    assert "solver" not in h.history
    with pytest.raises(ProtocolError, match="send an empty adapter_versions"):
        h.check("solver", 2, {"solver": 1})
    with pytest.raises(ProtocolError, match="send every one"):
        h.check("verifier", 2, {})  # the LoRA base beside it needs its map
    h.check("verifier", 2, {"verifier": 2})


def test_a_learner_that_rewinds_overwrites_and_forgets_the_lineage_after() -> None:
    h = lora_history()
    for v, versions in enumerate([u(1, 0), u(1, 1), u(2, 1), u(2, 2)], start=1):
        h.record("policy", v, versions)
    h.record("policy", 2, u(1, 1))  # a lagging rank repeats v2 as it was: nothing changes
    assert h.at("policy", 4) == u(2, 2)
    h.record("policy", 2, u(2, 0))  # resumed from v1, v2 trained the solver this time
    assert h.at("policy", 2) == u(2, 0)
    assert h.at("policy", 3) is None and h.at("policy", 4) is None  # the old lineage
    assert h.at("policy", 1) == u(1, 0)  # shared by both lineages


def test_the_history_is_bounded() -> None:
    h = lora_history(keep=3)
    for v in range(1, 6):
        h.record("policy", v, u(v, 0))
    assert sorted(h.history["policy"]) == [3, 4, 5]  # the newest 3
    assert h.at("policy", 2) is None and h.at("policy", 0) == u(0, 0)


# ---------------------------------------------------------------- staleness
def test_staleness_counts_the_samples_own_adapter_when_both_maps_are_known() -> None:
    h = lora_history()
    for v in (1, 2, 3):
        h.record("policy", v, u(v, 0))  # three steps that trained only the solver
    assert h.staleness("policy", "verifier", 3, 0) == 0  # U(3) - U(0) = 0 - 0
    assert h.staleness("policy", "solver", 3, 1) == 2  # 3 - 1
    assert h.staleness("policy", "solver", 7, 3) == 4  # U(7) unknown: 7 - 3, in model versions
    shared = lora_history("agents.verifier.adapter=solver")  # one adapter for both agents
    shared.record("policy", 3, {"solver": 3})
    assert shared.staleness("policy", "verifier", 3, 0) == 3  # the solver's adapter moved
    whole = AdapterVersions(load_config(SHARED))
    assert whole.staleness("policy", "verifier", 3, 0) == 3 and whole.staleness_of("policy") is None


# ------------------------------------------------------------------ to_send
def test_to_send_names_the_adapters_some_member_lacks() -> None:
    h = lora_history()
    h.record("policy", 1, u(1, 0))
    h.record("policy", 2, u(1, 1))
    h.record("policy", 3, u(2, 1))
    assert h.to_send("policy", 3, [2, 2]) == ["solver"]  # kept group, both at v2: 2 != 1
    assert h.to_send("policy", 2, [1]) == ["verifier"]  # 1 != 0; solver 1 == 1
    assert h.to_send("policy", 3, [2, 0]) == ["solver", "verifier"]  # a new actor holds v0
    assert h.to_send("policy", 1, [0]) == ["solver"]  # the verifier is still the initial one
    assert h.to_send("policy", 3, [3]) == []  # every member holds it: an empty publish
    assert h.to_send("policy", 3, []) == []  # no members
    assert h.to_send("policy", 5, [3]) == ["solver", "verifier"]  # U(5) unknown
    h.history["policy"].pop(1)
    assert h.to_send("policy", 3, [2, 1]) == ["solver", "verifier"]  # U(1) no longer held
    assert AdapterVersions(load_config(SHARED)).to_send("policy", 3, [0]) == []  # whole model


# ------------------------------------------------------ staleness at the cut
def step(agent: str, version: int) -> Step:
    return Step(
        agent=agent,
        model="policy",
        prompt_ids=pack_ids([1, 2, 3]),
        response_ids=pack_ids([4, 5]),
        logprobs=pack_logprobs([-0.5, -0.25]),
        version=version,
        valid=True,
        finish_reason="stop",
    )


@pytest.mark.parametrize(
    ("lora", "reported", "dropped"),
    [
        (True, 3, 1),  # only the group whose solver step is 2 adapter versions stale
        (True, 2, 3),  # U(3) not reported: counted in model versions, every group is 3 stale
        (False, 3, 3),  # a whole model: 3 > η for each group, as always
    ],
)
def test_a_slice_is_dropped_when_any_step_is_too_stale_in_its_own_adapter(
    lora: bool, reported: int, dropped: int
) -> None:
    """η = 1; versions 1..3 trained only the solver: U(v) = (solver v, verifier 0).
    Group K: verifier steps of v0, 3 model versions stale but 0 in the verifier's adapter.
    Group D: a solver step of v1 (U(3) - U(1) = 2 > 1) beside a verifier step of v0.
    Group K2: a solver step of v2 (1) beside a verifier step of v0 (0)."""
    cfg = load_config([*(LORA if lora else SHARED), "train.steps=10", "algorithm.max_staleness=1"])
    st = BrokerState(cfg, TaskSource(cfg.task))
    st.add_actor("a", "h", 1, ["policy"], 0.0)
    leases = st.lease("a", 3, {"policy": 0}, 0.0).leases
    episodes = [
        [step("verifier", 0)],  # K
        [step("solver", 1), step("verifier", 0)],  # D
        [step("solver", 2), step("verifier", 0)],  # K2
    ]
    for lease, steps in zip(leases, episodes, strict=True):
        group = pack_group("a", lease.lease_id, lease.group_id, [Episode(steps, r) for r in (1, 0)])
        assert st.accept("a", group, 0.0) == ""
    for v in range(1, reported + 1):
        st.adapter_versions.record("policy", v, u(v, 0) if lora else {})
    reply = st.batch("policy", 0, 1, 3, 0.0)
    assert st.counters["dropped_stale_groups"] == dropped
    if dropped == 3:
        assert isinstance(reply, NoBatch)
        return
    assert isinstance(reply, BatchShard)
    # K's 2 verifier steps and K2's 2 solver + 2 verifier steps
    assert sorted((s.agent, s.version) for s in reply.samples) == sorted(
        [("verifier", 0)] * 4 + [("solver", 2)] * 2
    )
    assert st.source.next_task().task_id == leases[1].task.task_id  # D's task comes back first
    stats = st.metrics.pending[4]
    # adapter staleness per sample: verifier 0 (x4), solver U(3) - U(2) = 1 (x2)
    assert stats["staleness/mean"] == pytest.approx(2 / 6) and stats["staleness/max"] == 1.0


def test_model_version_staleness_as_a_function_matches_the_whole_model_buffer() -> None:
    """The staleness function generalises v_l - v_b: given that function, a buffer drops
    exactly the slices and reports exactly the statistics of a whole model's buffer."""
    cfg = load_config(SHARED)
    rng = random.Random(7)
    adv = cfg.algorithm.advantage
    plain, general = (
        ModelBuffer("policy", 3, 2, adv),
        ModelBuffer("policy", 3, 2, adv, lambda agent, trained, generated: trained - generated),
    )
    agent_models = {"solver": "policy", "verifier": "policy"}
    dropped = []
    for version in range(2, 9):
        for i in range(4):  # each group's steps generated up to 0..3 versions before
            group_id, lag = 10 * version + i, rng.randrange(4)
            steps = [
                [step(rng.choice(["solver", "verifier"]), version - rng.randrange(lag + 1))
                 for _ in range(3)]
                for _ in range(2)
            ]  # fmt: skip
            group = pack_group("a", 0, group_id, [Episode(s, r) for s, r in zip(steps, (1, 0))])
            part = split_group(group_id, None, group, agent_models, 0.0)["policy"]  # type: ignore[arg-type]
            plain.add(part)
            general.add(part)
        dropped.append([p.group_id for p in plain.drop_stale(version)])
        assert dropped[-1] == [p.group_id for p in general.drop_stale(version)]
        cut = plain.batch_for(version, 1), general.batch_for(version, 1)
        assert (cut[0] is None) == (cut[1] is None)
        if cut[0] is not None and cut[1] is not None:
            assert cut[0].stats == cut[1].stats
    assert any(dropped) and plain.batches_cut == general.batches_cut > 0


# --------------------------------------------------------------- publishing
def test_a_publish_carries_only_the_adapters_some_member_lacks_and_its_bytes() -> None:
    cfg = load_config([*LORA, "train.steps=10"])
    sink = ListSink()
    st = BrokerState(cfg, TaskSource(cfg.task), StepMetrics(sink, ["policy"]))
    for actor in ("a", "b"):
        st.add_actor(actor, "h", 1, ["policy"], 0.0)

    def publish(version: int, versions: dict[str, int], sent: int = 0) -> list[str]:
        st.adapter_versions.record("policy", version, versions)
        plan, joins = st.weights.plan("policy", version, "h:1", 0.0)
        assert plan.members == [cid for cid, _ in joins]
        st.step_report("policy", version, {})
        st.weights.done("policy", version, 0.5, ok=True, sent_bytes=sent)
        return plan.adapters

    assert publish(1, u(1, 0), sent=4096) == ["solver"]  # both hold v0: the verifier is unchanged
    line = sink.lines[-1]
    assert line["step"] == 1 and line["weight_sync_bytes/policy"] == 4096.0
    assert line["publish_adapters/policy"] == 1.0 and line["weight_sync_s/policy"] == 0.5
    for actor in ("a", "b"):
        st.weights.loaded(actor, "policy", 1, ok=True)
    assert publish(2, u(1, 1), sent=2048) == ["verifier"]  # the kept group holds v1
    assert st.counters["weight_groups_kept"] == 1
    for actor in ("a", "b"):
        st.weights.loaded(actor, "policy", 2, ok=True)
    st.add_actor("c", "h", 3, ["policy"], 0.0)  # attaches holding v0
    assert publish(3, u(2, 1), sent=6144) == ["solver", "verifier"]  # c lacks both
    assert sink.lines[-1]["publish_adapters/policy"] == 2.0
    for actor in ("a", "b"):
        st.weights.loaded(actor, "policy", 3, ok=True)
    st.weights.loaded("c", "policy", 3, ok=False)
    hold(st, "c", policy=2)  # say it had loaded v2 meanwhile
    plan, _ = st.weights.plan("policy", 3, "h:1", 0.0)  # the re-publish to the one behind
    assert plan.members == ["c"] and plan.adapters == ["solver"]  # U(3) vs U(2)


def test_a_whole_model_publish_names_no_adapters_but_counts_its_bytes() -> None:
    cfg = load_config(["models.verifier.lora.rank=8", "val.every=0", "train.steps=10"])
    st = BrokerState(cfg, TaskSource(cfg.task))
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    st.adapter_versions.record("verifier", 1, {"verifier": 1})
    plans = {m: st.weights.plan(m, 1, "h:1", 0.0)[0] for m in ("solver", "verifier")}
    assert plans["solver"].adapters == [] and plans["verifier"].adapters == ["verifier"]
    st.weights.done("solver", 1, 0.1, ok=True, sent_bytes=7_983_104)
    st.weights.done("verifier", 1, 0.1, ok=True, sent_bytes=114_688)
    pending = st.metrics.pending[1]  # the line waits for both learners' step reports
    assert pending["weight_sync_bytes/solver"] == 7_983_104.0
    assert pending["weight_sync_bytes/verifier"] == 114_688.0
    assert pending["publish_adapters/verifier"] == 1.0 and "publish_adapters/solver" not in pending


def test_a_plan_without_members_carries_nothing() -> None:
    cfg = load_config([*LORA, "train.steps=3"])  # no validation: v3 is published to nobody
    st = BrokerState(cfg, TaskSource(cfg.task))
    st.add_actor("a", "h", 1, ["policy"], 0.0)
    st.adapter_versions.record("policy", 3, u(2, 1))
    plan, joins = st.weights.plan("policy", 3, "h:1", 0.0)
    assert plan.members == [] and plan.adapters == [] and joins == []
    pending = st.metrics.pending[3]
    assert pending["weight_sync_bytes/policy"] == 0.0 and pending["publish_adapters/policy"] == 0.0


# ------------------------------------------------------------ the broker loop
@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with broker_server(tmp_path, "models.verifier.lora.rank=8") as srv:
        yield srv


def test_the_broker_checks_then_records_what_learners_report(server: BrokerServer) -> None:
    """The gate refuses a bad map before anything changes; an admitted BatchRequest or
    PublishRequest is recorded; PublishDone's bytes reach the metrics. (Replies go to
    clients that are not connected: the loop drops them.)"""
    st = server.state
    for cid, role, models in (
        ("Ls", "learner", ["solver"]),
        ("Lv", "learner", ["verifier"]),
        ("A", "actor", ["solver", "verifier"]),
    ):
        server.dispatch(cid, Hello(role, cid, PROTOCOL_VERSION, models))  # type: ignore[arg-type]
    refusals = [
        ("Lv", BatchRequest("Lv", "verifier", 0, 1, 0)),  # a LoRA base without its map
        ("Lv", BatchRequest("Lv", "verifier", 0, 1, 0, {"verifier": 1})),  # 1 > v0
        ("Ls", BatchRequest("Ls", "solver", 0, 1, 0, {"solver": 0})),  # a whole model
        ("Lv", PublishRequest("verifier", 0, "h:1", {"solver": 0})),  # not its adapter
    ]
    for cid, msg in refusals:
        with pytest.raises(ProtocolError) as refused:
            server.dispatch(cid, msg)
        assert refused.value.code == "invalid"
    assert st.adapter_versions.history == {"verifier": {}}
    server.dispatch("Ls", BatchRequest("Ls", "solver", 0, 1, 0))
    server.dispatch("Lv", BatchRequest("Lv", "verifier", 0, 1, 0, {"verifier": 0}))
    server.dispatch("Lv", StepReport("verifier", 1, {}))
    server.dispatch("Lv", PublishRequest("verifier", 1, "h:1", {"verifier": 1}))
    assert st.adapter_versions.at("verifier", 1) == {"verifier": 1}
    assert st.weights.carried["verifier"] == 1  # actor A holds v0: U[verifier] 0 != 1
    server.dispatch("Lv", PublishDone("verifier", 1, 0.2, 114_688))
    assert st.metrics.pending[1]["weight_sync_bytes/verifier"] == 114_688.0
    assert st.metrics.pending[1]["publish_adapters/verifier"] == 1.0
