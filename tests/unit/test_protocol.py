"""Protocol: every message round-trips; bad frames and invalid content are refused."""

from __future__ import annotations

import math
from typing import Any, get_args

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drmas.protocol import messages as m
from drmas.protocol.arrays import pack_ids, pack_logprobs, unpack_ids, unpack_logprobs
from drmas.protocol.codec import ProtocolError, decode_from_broker, decode_to_broker, encode
from drmas.protocol.validate import (
    Limits,
    check_group_result,
    check_hello,
    check_lease_request,
    check_step,
)

LIMITS = Limits(
    agent_models={"solver": "small", "verifier": "big"},
    vocab_sizes={"small": 100, "big": 1000},
    max_prompt_tokens=64,
    max_response_tokens=32,
    max_steps_per_episode=4,
)
TASK = m.Task(task_id="arithmetic:train:3", question="12+7", answer="19", source="arithmetic")
SAMPLING = m.SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=64)


def _step(**kw: Any) -> m.Step:
    base: dict[str, Any] = {
        "agent": "solver",
        "model": "small",
        "prompt_ids": pack_ids([1, 2, 3]),
        "response_ids": pack_ids([4, 5]),
        "logprobs": pack_logprobs([-0.5, 0.0]),
        "version": 2,
        "valid": True,
        "finish_reason": "stop",
    }
    base.update(kw)
    return m.Step(**base)


def _group(episodes: list[m.Episode] | None = None) -> m.GroupResult:
    if episodes is None:
        episodes = [
            m.Episode(
                steps=[_step(), _step(agent="verifier", model="big", valid=False)], reward=1.0
            ),
            m.Episode(steps=[_step(finish_reason="length")], reward=0.0),
        ]
    return m.pack_group("actor-1", 5, 9, episodes, generate_s=1.5)


SAMPLE = m.Sample(
    agent="verifier",
    prompt_ids=pack_ids([1, 2]),
    response_ids=pack_ids([3]),
    logprobs=pack_logprobs([-1.25]),
    advantage=-0.7,
    version=3,
)

TO_BROKER: list[Any] = [
    m.Hello(
        role="actor",
        client_id="actor-1",
        protocol_version=m.PROTOCOL_VERSION,
        models=["small"],
        pid=42,
        host="h",
    ),
    m.Hello(
        role="learner",
        client_id="learner-big-0",
        protocol_version=1,
        models=["big"],
        rank=1,
        world_size=2,
    ),
    m.Hello(role="client", client_id="cli", protocol_version=1),
    m.Heartbeat(client_id="actor-1", versions={"small": 3}, running_groups=2),
    m.Goodbye(client_id="actor-1", lease_ids=[1, 2]),
    m.LeaseRequest(client_id="actor-1", max_groups=4, versions={"small": 3, "big": 0}),
    _group(),
    m.BatchRequest(client_id="learner-big-0", model="big", rank=0, world_size=2, version=7),
    m.StepReport(model="big", version=8, metrics={"loss": 0.25, "grad_norm": 1.5}),
    m.PublishRequest(model="big", version=8, store_address="127.0.0.1:29500"),
    m.PublishDone(model="big", version=8, seconds=0.5, bytes=1 << 33),
    m.PublishDone(model="big", version=8, seconds=0.5, bytes=0, ok=False, error="timeout"),
    m.WeightsLoaded(client_id="actor-1", model="big", version=8, seconds=0.25),
    m.StatusRequest(),
]
FROM_BROKER: list[Any] = [
    m.Welcome(
        run_id="run",
        model_versions={"small": 0},
        agent_models={"solver": "small"},
        heartbeat_interval_s=1.0,
    ),
    m.Leases(
        leases=[
            m.Lease(
                lease_id=1,
                group_id=2,
                task=TASK,
                group_size=8,
                is_eval=False,
                sampling=SAMPLING,
                timeout_s=60.0,
            )
        ]
    ),
    m.Leases(leases=[], retry_after_s=0.5, reason="admission control"),
    m.Accepted(lease_id=1, accepted=False, reason="stale"),
    m.BatchShard(
        model="big",
        version=3,
        rank=0,
        world_size=1,
        samples=[SAMPLE, SAMPLE],
        weights=[1.0, 0.0],
        total_samples=1,
        total_tokens=1,
    ),
    m.NoBatch(retry_after_s=0.1, reason="waiting", done=False),
    m.WeightGroupPlan(
        model="big", version=3, group_name="w-big-3", members=["a1", "a2"], timeout_s=30.0
    ),
    m.JoinWeightGroup(
        model="big",
        version=3,
        group_name="w-big-3",
        store_address="127.0.0.1:1",
        rank=1,
        world_size=3,
        timeout_s=30.0,
    ),
    m.StatusReply(
        run_id="run",
        uptime_s=3.5,
        actors=[m.ActorStatus("a1", "host", 7, {"big": 3}, 1, 2, 16, 0.25)],
        models={"big": m.ModelStatus(version=3, buffered_groups=1, batches_cut=3, learner_ranks=2)},
        queued_tasks=5,
        in_flight_groups=2,
        counters={"refused": 1},
        done=False,
    ),
    m.ErrorReply(code="invalid", reason="why"),
    m.Shutdown(reason="done"),
]
if hasattr(m, "LeaseReturn"):
    TO_BROKER.append(m.LeaseReturn(client_id="actor-1", lease_ids=[3], reason="engine failed"))

TO_BROKER_TYPES = get_args(m.ToBroker)
FROM_BROKER_TYPES = get_args(m.FromBroker)


def _builtins(msg: Any) -> Any:
    """A message as plain msgpack values (bytes stay bytes, unlike msgspec.to_builtins)."""
    return msgspec.msgpack.decode(encode(msg))


def _tag(cls: type) -> str:
    return str(getattr(cls, "__struct_config__").tag)  # noqa: B009 (msgspec adds it at runtime)


# ------------------------------------------------------------------ round trips
def test_every_message_type_has_a_sample() -> None:
    tagged = {
        c
        for c in vars(m).values()
        if isinstance(c, type) and issubclass(c, m._Msg) and c is not m._Msg
    }
    assert set(TO_BROKER_TYPES) | set(FROM_BROKER_TYPES) == tagged, (
        "a message is in neither direction"
    )
    assert not set(TO_BROKER_TYPES) & set(FROM_BROKER_TYPES)
    missing = tagged - {type(x) for x in TO_BROKER + FROM_BROKER}
    assert not missing, f"add a sample of {sorted(c.__name__ for c in missing)} to this test"
    tags = [_tag(c) for c in tagged]
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize("msg", TO_BROKER, ids=lambda x: type(x).__name__)
def test_to_broker_round_trip(msg: Any) -> None:
    frame = encode(msg)
    assert isinstance(frame, bytes)
    assert decode_to_broker(frame) == msg
    with pytest.raises(ProtocolError) as info:  # the other direction's decoder refuses it
        decode_from_broker(frame)
    assert info.value.code == "bad_frame"


@pytest.mark.parametrize("msg", FROM_BROKER, ids=lambda x: type(x).__name__)
def test_from_broker_round_trip(msg: Any) -> None:
    frame = encode(msg)
    assert decode_from_broker(frame) == msg
    with pytest.raises(ProtocolError) as info:
        decode_to_broker(frame)
    assert info.value.code == "bad_frame"


def test_arrays_travel_as_raw_little_endian_bytes() -> None:
    ids = np.array([0, 1, 151_935, 2**31 - 1], dtype=np.int64)
    lp = [-0.0, -1.5, -1e-8, -88.0]
    step = _step(prompt_ids=pack_ids(ids), response_ids=pack_ids(ids), logprobs=pack_logprobs(lp))
    assert step.prompt_ids == b"".join(int(i).to_bytes(4, "little", signed=True) for i in ids)
    back = decode_to_broker(encode(_group([m.Episode([step], 1.0)])))
    assert isinstance(back, m.GroupResult)
    got = back.unpack()[0].steps[0]
    np.testing.assert_array_equal(unpack_ids(got.response_ids), ids)
    np.testing.assert_array_equal(unpack_logprobs(got.logprobs), np.asarray(lp, dtype=np.float32))
    assert unpack_ids(got.response_ids).dtype == np.dtype("<i4")
    # raw bytes on the wire, not a msgpack array of numbers
    raw = msgspec.msgpack.decode(encode(_group([m.Episode([step], 1.0)])))
    assert isinstance(raw["response_ids"], bytes) and len(raw["response_ids"]) == 16
    assert raw["episodes"][0]["steps"][0]["response_len"] == 4


def test_unpack_refuses_ragged_buffers() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack_ids(b"\x00" * 5)
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack_logprobs(b"\x00" * 3)


# ------------------------------------------------------------------- bad frames
def _bad_frame(frame: bytes, decode: Any = decode_to_broker) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code == "bad_frame"
    assert info.value.reason
    return info.value


def _raw(msg: Any, **changes: Any) -> bytes:
    d = _builtins(msg)
    d.update(changes)
    return msgspec.msgpack.encode(d)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        b"\xff\xff\xff",
        b"garbage that is not msgpack",
        b"\x92\x01",
        b"\xdd\xff\xff\xff\xff",
    ],
)
def test_garbage_bytes(frame: bytes) -> None:
    _bad_frame(frame)
    _bad_frame(frame, decode_from_broker)


def test_not_a_tagged_record() -> None:
    _bad_frame(msgspec.msgpack.encode([1, 2, 3]))
    _bad_frame(msgspec.msgpack.encode({"client_id": "a"}))  # no type tag
    _bad_frame(msgspec.msgpack.encode("hello"))


def test_unknown_type_tag() -> None:
    err = _bad_frame(msgspec.msgpack.encode({"type": "launch_missiles", "client_id": "a"}))
    assert "launch_missiles" in err.reason
    _bad_frame(msgspec.msgpack.encode({"type": 7}))


def test_wrong_field_types() -> None:
    req = m.LeaseRequest(client_id="a", max_groups=2, versions={})
    err = _bad_frame(_raw(req, max_groups="2"))
    assert "max_groups" in err.reason
    _bad_frame(_raw(req, max_groups=True))
    _bad_frame(_raw(req, versions={"small": 1.5}))
    _bad_frame(_raw(req, client_id=None))
    _bad_frame(_raw(m.Hello(role="actor", client_id="a", protocol_version=1), role="emperor"))
    # token ids must be raw bytes, not a list of numbers
    group = _builtins(_group())
    group["episodes"][0]["steps"][0]["response_ids"] = [4, 5]
    err = _bad_frame(msgspec.msgpack.encode(group))
    assert "response_ids" in err.reason


def test_missing_required_field() -> None:
    d = _builtins(m.LeaseRequest(client_id="a", max_groups=2, versions={}))
    del d["max_groups"]
    err = _bad_frame(msgspec.msgpack.encode(d))
    assert "max_groups" in err.reason


def test_unknown_fields() -> None:
    err = _bad_frame(_raw(m.Heartbeat(client_id="a"), surprise=1))
    assert "surprise" in err.reason
    group = _builtins(_group())
    group["episodes"][0]["steps"][0]["extra"] = 1  # nested records refuse them too
    _bad_frame(msgspec.msgpack.encode(group))
    reply = _builtins(FROM_BROKER[-3])  # StatusReply
    reply["actors"][0]["extra"] = 1
    _bad_frame(msgspec.msgpack.encode(reply), decode_from_broker)
    reply = _builtins(FROM_BROKER[-3])
    reply["models"]["big"]["extra"] = 1
    _bad_frame(msgspec.msgpack.encode(reply), decode_from_broker)


# ----------------------------------------------------------------- validation
def _invalid(fn: Any, *args: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match) as info:
        fn(*args)
    assert info.value.code == "invalid"


def test_valid_group_passes() -> None:
    check_group_result(_group(), LIMITS, group_size=2)


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (_step(agent="critic"), r"unknown agent 'critic'.*\['solver', 'verifier'\]"),
        (_step(model="big"), r"agent 'solver' is bound to model 'small', step says 'big'"),
        (_step(logprobs=pack_logprobs([-0.5])), r"1 log-probs for 2 response tokens"),
        (_step(response_ids=b"", logprobs=b""), r"response of 0 tokens"),
        (_step(prompt_ids=b""), r"prompt of 0 tokens"),
        (_step(prompt_ids=pack_ids(range(65))), r"prompt of 65 tokens outside 1..64"),
        (
            _step(response_ids=pack_ids([1] * 33), logprobs=pack_logprobs([0.0] * 33)),
            r"response of 33",
        ),
        (
            _step(response_ids=pack_ids([4, 100])),
            r"response token id outside the vocabulary of 'small' \(size 100\)",
        ),
        (_step(response_ids=pack_ids([-1, 4])), r"response token id outside the vocabulary"),
        (_step(prompt_ids=pack_ids([1, 1000])), r"prompt token id outside the vocabulary"),
        (_step(logprobs=pack_logprobs([-0.5, math.nan])), r"finite and <= 0"),
        (_step(logprobs=pack_logprobs([-math.inf, -0.5])), r"finite and <= 0"),
        (_step(logprobs=pack_logprobs([-0.5, 0.01])), r"finite and <= 0"),
        (_step(response_ids=b"\x00" * 7), r"not a multiple of 4"),
        (_step(version=-1), r"negative weight version"),
        (_step(finish_reason="eos"), r"finish_reason must be 'stop' or 'length', got 'eos'"),
        (_step(finish_reason=""), r"finish_reason"),
    ],
)
def test_check_step_refusals(step: m.Step, match: str) -> None:
    _invalid(check_step, step, LIMITS, match=match)


def test_vocab_is_per_model() -> None:
    # id 500 is fine for the verifier's big model, not for the solver's small one
    check_step(_step(agent="verifier", model="big", response_ids=pack_ids([4, 500])), LIMITS)
    _invalid(check_step, _step(response_ids=pack_ids([4, 500])), LIMITS, match="'small'")


def test_check_group_result_refusals() -> None:
    _invalid(check_group_result, _group(), LIMITS, 3, match=r"has 2 episodes, lease asked 3")
    for bad in (math.nan, math.inf, -2e6):
        episodes = [m.Episode(steps=[_step()], reward=bad)]
        _invalid(
            check_group_result, _group(episodes), LIMITS, 1,
            match=r"episode 0: reward .* is not finite or beyond ±1e\+06",
        )  # fmt: skip
        step = _step(reward=bad)  # a step's own (role) reward: the same bound
        _invalid(
            check_group_result, _group([m.Episode(steps=[step], reward=1.0)]), LIMITS, 1,
            match=r"step 0: step reward .* is not finite or beyond ±1e\+06",
        )  # fmt: skip
    at_bound = _group([m.Episode(steps=[_step(reward=-1e6)], reward=0.5)])
    check_group_result(at_bound, LIMITS, 1)  # the bound itself is accepted, and travels
    decoded = decode_to_broker(encode(at_bound))
    assert isinstance(decoded, m.GroupResult)
    (episode,) = decoded.unpack()
    assert episode.steps[0].reward == -1e6 and episode.reward == 0.5
    episodes = [m.Episode(steps=[_step()], reward=1.0), m.Episode(steps=[], reward=1.0)]
    _invalid(
        check_group_result, _group(episodes), LIMITS, 2, match=r"episode 1: 0 steps outside 1..4"
    )
    episodes = [m.Episode(steps=[_step()] * 5, reward=1.0)]
    _invalid(check_group_result, _group(episodes), LIMITS, 1, match=r"5 steps")
    episodes = [m.Episode(steps=[_step(), _step(agent="critic")], reward=1.0)]
    _invalid(check_group_result, _group(episodes), LIMITS, 1, match=r"unknown agent")


def test_check_hello_and_lease_request_refusals() -> None:
    check_hello(TO_BROKER[0], LIMITS)
    _invalid(
        check_hello,
        m.Hello(role="actor", client_id="", protocol_version=1),
        LIMITS,
        match="client_id",
    )
    _invalid(
        check_hello,
        m.Hello(role="actor", client_id="x" * 300, protocol_version=1),
        LIMITS,
        match="client_id",
    )
    for field, bad in (("client_id", "a\n2026 broker INFO forged"), ("host", "h\x1b[2J")):
        _invalid(
            check_hello,
            m.Hello(**{"role": "actor", "client_id": "a", "protocol_version": 1, field: bad}),
            LIMITS,
            match=f"{field} .* holds control characters",
        )
    _invalid(
        check_hello,
        m.Hello(role="actor", client_id="a", protocol_version=1, models=["huge"]),
        LIMITS,
        match=r"unknown model\(s\) \['huge'\]",
    )
    _invalid(
        check_hello,
        m.Hello(
            role="learner", client_id="l", protocol_version=1, models=["big"], rank=2, world_size=2
        ),
        LIMITS,
        match="rank 2 outside world size 2",
    )
    check_lease_request(m.LeaseRequest(client_id="a", max_groups=1, versions={}), LIMITS)
    _invalid(
        check_lease_request,
        m.LeaseRequest(client_id="a", max_groups=0, versions={}),
        LIMITS,
        match="max_groups",
    )
    _invalid(
        check_lease_request,
        m.LeaseRequest(client_id="a", max_groups=10**6, versions={}),
        LIMITS,
        match="max_groups",
    )


# ------------------------------------------------------------------- properties
def _decodes_or_refuses(frame: bytes) -> None:
    for decode, types in (
        (decode_to_broker, TO_BROKER_TYPES),
        (decode_from_broker, FROM_BROKER_TYPES),
    ):
        try:
            msg = decode(frame)
        except ProtocolError as exc:
            assert exc.code == "bad_frame"
        else:
            assert isinstance(msg, types)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_raise_protocol_error(frame: bytes) -> None:
    _decodes_or_refuses(frame)


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
_TAGS = [_tag(c) for c in (*TO_BROKER_TYPES, *FROM_BROKER_TYPES)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(_TAGS),
    st.sampled_from([_builtins(x) for x in TO_BROKER + FROM_BROKER]),
    st.dictionaries(st.text(max_size=14), _values, max_size=4),
)
def test_random_records_with_real_tags_decode_or_raise(
    tag: str, base: dict[str, Any], noise: dict[str, Any]
) -> None:
    """Frames that look like real messages (a real tag, real or mutated fields) get deeper
    into the decoder than random bytes; they must still decode or be refused cleanly."""
    record = {**base, **noise, "type": tag}
    _decodes_or_refuses(msgspec.msgpack.encode(record))
    # and every truncation of a real frame is refused, never crashes
    frame = msgspec.msgpack.encode(base)
    _decodes_or_refuses(frame[: len(frame) // 2])


def test_group_travels_columnar_and_unpacks_to_the_same_steps() -> None:
    episodes = [
        m.Episode(
            [_step(prompt_ids=pack_ids([7] * k)), _step(agent="verifier", model="big")], float(k)
        )
        for k in (1, 2, 3)
    ]
    group = decode_to_broker(encode(_group(episodes)))
    assert isinstance(group, m.GroupResult)
    assert [[h.prompt_len for h in e.steps] for e in group.episodes] == [[1, 3], [2, 3], [3, 3]]
    assert len(group.prompt_ids) == 4 * (1 + 2 + 3 + 3 * 3)
    assert group.unpack() == episodes


def test_step_headers_must_agree_with_the_buffers() -> None:
    group = _group()
    group.episodes[0].steps[0].response_len += 1  # the header claims a token the buffer lacks
    _invalid(check_group_result, group, LIMITS, 2, match=r"response_ids holds 24 bytes.* 7 tokens")
    group = _group()
    group.prompt_ids = memoryview(bytes(group.prompt_ids) + b"\0\0\0\0")
    _invalid(check_group_result, group, LIMITS, 2, match=r"prompt_ids holds")


def test_shared_vocabulary_groups_are_checked_in_one_pass() -> None:
    same = Limits(agent_models=LIMITS.agent_models, vocab_sizes={"small": 100, "big": 100})
    ok = [m.Episode([_step(), _step(agent="verifier", model="big")], 1.0)]
    check_group_result(_group(ok), same, 1)
    for bad in (pack_ids([4, -1]), pack_ids([4, 100])):
        episodes = [
            m.Episode([_step(), _step(agent="verifier", model="big", response_ids=bad)], 1.0)
        ]
        _invalid(
            check_group_result,
            _group(episodes),
            same,
            1,
            match=r"step 1: response token id outside the vocabulary of 'big'",
        )


def test_episode_metrics_travel_with_the_group_and_are_checked() -> None:
    episodes = [m.Episode([_step()], 1.0, {"em": 1.0, "search_calls": 2.0})]
    group = decode_to_broker(encode(_group(episodes)))
    assert isinstance(group, m.GroupResult)
    assert group.episodes[0].metrics == {"em": 1.0, "search_calls": 2.0}
    assert group.unpack()[0].metrics == {"em": 1.0, "search_calls": 2.0}
    check_group_result(group, LIMITS, 1)
    bad = [m.Episode([_step()], 1.0, {"f1": math.inf})]
    _invalid(check_group_result, _group(bad), LIMITS, 1, match=r"metric 'f1'=inf")
    many = [m.Episode([_step()], 1.0, {f"x{i}": 0.0 for i in range(33)})]
    _invalid(check_group_result, _group(many), LIMITS, 1, match=r"33 metrics")


def test_a_step_longer_than_its_models_context_is_refused() -> None:
    """32,768-token prompts for a model of 512 positions were accepted and crashed the
    learner: prompt + response must fit the context of the step's own model."""
    from drmas.protocol.validate import context_from_config

    limits = msgspec.structs.replace(LIMITS, contexts={"small": 6})
    check_group_result(m.pack_group("a", 5, 9, [m.Episode([_step()], 1.0)]), limits, 1)  # 3 + 2
    long = _step(prompt_ids=pack_ids([1, 2, 3, 4, 5]))  # 5 + 2 > 6
    _invalid(
        check_group_result,
        m.pack_group("a", 5, 9, [m.Episode([long], 1.0)]),
        limits,
        1,
        match=r"prompt of 5 \+ response of 2 tokens exceed model 'small''s context of 6",
    )
    big = _step(agent="verifier", model="big", prompt_ids=pack_ids([1, 2, 3, 4, 5]))
    check_group_result(m.pack_group("a", 5, 9, [m.Episode([big], 1.0)]), limits, 1)  # no context
    assert context_from_config({"max_position_embeddings": 512}) == 512
    assert context_from_config({"n_positions": 1024, "vocab_size": 5}) == 1024
    assert context_from_config({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert context_from_config({"vocab_size": 5}) is None
