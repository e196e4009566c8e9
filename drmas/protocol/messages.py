"""Every message that crosses a process boundary, as typed msgspec records.

Who talks to whom (all over ZeroMQ, one broker ROUTER socket, clients use DEALER):

    actor   -> broker : Hello, Heartbeat, LeaseRequest, GroupResult, WeightsLoaded, LeaseReturn,
                        Goodbye
    learner -> broker : Hello, Heartbeat, BatchRequest, StepReport, PublishRequest, PublishDone
    client  -> broker : Hello, StatusRequest
    broker  -> actor  : Welcome, Leases, Accepted, JoinWeightGroup, Shutdown, ErrorReply
    broker  -> learner: Welcome, BatchShard, NoBatch, WeightGroupPlan, Shutdown, ErrorReply
    broker  -> client : Welcome, StatusReply, ErrorReply

Weights themselves never travel here: they go learner rank 0 -> actors over a
torch.distributed group (see drmas/transports/weights/); these messages only
announce and coordinate it.

Token ids and log-probs are raw little-endian bytes (see arrays.py); how actors sample is
in sampling.py. This module imports nothing of the project but those.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from drmas.protocol.sampling import SamplingParams
from drmas.protocol.wire_limits import (
    MAX_ADAPTERS,
    MAX_EPISODE_STEPS,
    MAX_GROUP_EPISODES,
    MAX_LEASE_IDS,
    MAX_LIST,
    MAX_METRICS,
    MAX_MODELS,
    MAX_WIRE_EPISODE_METRICS,
    AdapterVersions,
    Id,
    LeaseIds,
    LongText,
    Models,
    Name,
    Names,
    Text,
    Versions,
)

PROTOCOL_VERSION = 8  # 8: PublishDone.broke; 7: SamplingParams.stop and .agents

Role = Literal["actor", "learner", "client"]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    """Base of all tagged messages; `type` on the wire names the record.

    Messages are trees (never reference cycles), so the high-volume records (groups and
    their steps) are built with gc=False: the cyclic garbage collector does not track
    them, which keeps a broker holding thousands of buffered groups from spending its
    time in collections.
    """


# ---------------------------------------------------------------- handshake
# any -> broker: first message of a connection. Refused if protocol_version differs.
class Hello(_Msg, tag="hello"):
    role: Role
    client_id: Id
    protocol_version: int
    models: Models = []  # actor: models it serves; learner: [its model]
    rank: int = 0  # learner: rank within its model's learner group
    world_size: int = 1  # learner: ranks in its model's learner group
    pid: int = 0
    host: Id = ""
    # learner: HMAC of (client_id, model, rank) under the run's learner secret
    # (drmas/transports/learner_secret.py); the broker seats no learner without it
    proof: Id = ""


# broker -> any: answer to Hello.
class Welcome(_Msg, tag="welcome"):
    run_id: Id
    model_versions: Versions  # model -> current weight version (batches trained)
    agent_models: Annotated[
        dict[Name, Name], msgspec.Meta(max_length=MAX_ADAPTERS)
    ]  # agent -> model
    heartbeat_interval_s: float
    # the client id this connection is welcomed under: the Hello's, or `<id>~<n>` when a
    # live connection already speaks for that one (drmas/broker/routes.py)
    client_id: Id = ""


# actor/learner -> broker, every heartbeat_interval_s; no reply.
class Heartbeat(_Msg, tag="heartbeat"):
    client_id: Id
    versions: Versions = {}  # model -> weight version held
    running_groups: int = 0
    # actor: seconds spent in each of ACTOR_TIME_STATES since it started (cumulative)
    time_s: Annotated[dict[Name, float], msgspec.Meta(max_length=16)] = {}


ACTOR_TIME_STATES = ("generating", "waiting_for_leases", "loading_weights")
"""Where an actor's time goes: a leased group in flight, none, a weight load in progress."""


# actor -> broker on clean exit: leases it hands back unfinished; no reply.
class Goodbye(_Msg, tag="goodbye"):
    client_id: Id
    lease_ids: LeaseIds = []
    reason: Text = ""  # why it leaves (a learner's signal and Slurm job); "" = done


# actor -> broker: leases it cannot finish (a failed group); they are re-issued. No reply.
class LeaseReturn(_Msg, tag="lease_return"):
    client_id: Id
    lease_ids: LeaseIds
    reason: Text = ""


# ------------------------------------------------------------------- rollout
class Task(msgspec.Struct, forbid_unknown_fields=True):
    """One prompt of the task source, carried in a lease."""

    task_id: Id
    question: LongText
    answer: LongText  # gold answer, graded on the actor
    source: Id = ""
    # every accepted answer when there are several (QA); [] = [answer]
    answers: Annotated[list[LongText], msgspec.Meta(max_length=MAX_LEASE_IDS)] = []


# actor -> broker: ask for up to max_groups leases.
class LeaseRequest(_Msg, tag="lease_request"):
    client_id: Id
    max_groups: int
    versions: Versions  # model -> weight version the actor holds now


class Lease(msgspec.Struct, forbid_unknown_fields=True):
    """One group of `group_size` episodes of one task, owned by one actor."""

    lease_id: int
    group_id: int
    task: Task
    group_size: int
    is_eval: bool
    sampling: SamplingParams
    timeout_s: float  # broker re-issues the task after this long


# broker -> actor: answer to LeaseRequest; an empty list means "ask again later".
class Leases(_Msg, tag="leases"):
    leases: Annotated[list[Lease], msgspec.Meta(max_length=MAX_LIST)]
    retry_after_s: float = 0.0
    reason: Text = ""  # why fewer than asked (admission control, stale weights, done)


class Step(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One call of one agent inside an episode, as a workflow produces it.

    On the wire a group's steps travel columnar (see GroupResult): this record is the
    actor's (and the tests') view; `pack_group` turns episodes of Steps into a
    GroupResult and `GroupResult.unpack` turns it back.
    """

    agent: str
    model: str
    prompt_ids: bytes  # [P] int32 LE
    response_ids: bytes  # [T] int32 LE
    logprobs: bytes  # [T] float32 LE, behaviour log-probs of response tokens (<= 0)
    version: int  # weight version of `model` when the step started generating
    valid: bool  # the agent's action parsed (else the invalid-action penalty applies)
    finish_reason: str  # "stop" | "length"
    # this step's own reward (a role reward); None = the episode's team reward, as before.
    # Finite, |reward| <= MAX_ABS_REWARD.
    reward: float | None = None


MAX_ABS_REWARD = 1e6
"""The largest |reward| an episode or a step may carry (the gate refuses more)."""


class Episode(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    steps: list[Step]
    reward: float  # team reward of the episode
    # workflow measurements of the episode (e.g. search_calls, em, f1): averaged by the
    # broker into rollout/<name> (training) and val/<name> (validation) metrics
    metrics: dict[str, float] = {}


class StepHeader(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A Step without its arrays: those are spans of the GroupResult's buffers."""

    agent: Name
    model: Name
    prompt_len: int  # tokens of this step in GroupResult.prompt_ids
    response_len: int  # tokens of this step in GroupResult.response_ids / logprobs
    version: int
    valid: bool
    finish_reason: Annotated[str, msgspec.Meta(max_length=16)]
    reward: float | None = None  # Step.reward


class EpisodeHeader(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    steps: Annotated[list[StepHeader], msgspec.Meta(max_length=MAX_EPISODE_STEPS)]
    reward: float
    metrics: Annotated[dict[Name, float], msgspec.Meta(max_length=MAX_WIRE_EPISODE_METRICS)] = {}


# actor -> broker: all episodes of one lease. Answered by Accepted.
# Columnar: the token ids and log-probs of every step of the group are concatenated
# (episode by episode, step by step) into three buffers, so the broker decodes three
# byte strings and validates them in one vectorised pass instead of three per step.
class GroupResult(_Msg, tag="group_result", gc=False):
    client_id: Id
    lease_id: int
    group_id: int
    episodes: Annotated[list[EpisodeHeader], msgspec.Meta(max_length=MAX_GROUP_EPISODES)]
    # Decoded as views into the received frame (no copy of the group's tokens); the
    # frame lives as long as a view does.
    prompt_ids: memoryview  # int32 LE, sum of prompt_len
    response_ids: memoryview  # int32 LE, sum of response_len
    logprobs: memoryview  # float32 LE, sum of response_len
    generate_s: float = 0.0  # wall seconds the actor spent on the group

    def unpack(self) -> list[Episode]:
        """The episodes as Steps with their own arrays (copies; not the broker's hot path)."""
        episodes, p, r = [], 0, 0
        for episode in self.episodes:
            steps = []
            for h in episode.steps:
                p_end, r_end = p + 4 * h.prompt_len, r + 4 * h.response_len
                steps.append(
                    Step(
                        h.agent,
                        h.model,
                        bytes(self.prompt_ids[p:p_end]),
                        bytes(self.response_ids[r:r_end]),
                        bytes(self.logprobs[r:r_end]),
                        h.version,
                        h.valid,
                        h.finish_reason,
                        h.reward,
                    )
                )
                p, r = p_end, r_end
            episodes.append(Episode(steps, episode.reward, dict(episode.metrics)))
        return episodes


def pack_group(
    client_id: str, lease_id: int, group_id: int, episodes: list[Episode], generate_s: float = 0.0
) -> GroupResult:
    """Episodes of Steps -> one columnar GroupResult (what an actor sends).

    Raises ValueError for a step whose buffers cannot be spans (a bug of its producer).
    """
    steps = [s for e in episodes for s in e.steps]
    for s in steps:
        p, r, lp = len(s.prompt_ids), len(s.response_ids), len(s.logprobs)
        for what, size in (("prompt id", p), ("response id", r), ("log-prob", lp)):
            if size % 4:
                raise ValueError(f"{what} buffer of {size} bytes is not a multiple of 4")
        if lp != r:
            raise ValueError(f"{lp // 4} log-probs for {r // 4} response tokens")
    return GroupResult(
        client_id=client_id,
        lease_id=lease_id,
        group_id=group_id,
        episodes=[
            EpisodeHeader(
                [
                    StepHeader(
                        s.agent,
                        s.model,
                        len(s.prompt_ids) // 4,
                        len(s.response_ids) // 4,
                        s.version,
                        s.valid,
                        s.finish_reason,
                        s.reward,
                    )
                    for s in e.steps
                ],
                e.reward,
                e.metrics,
            )
            for e in episodes
        ],
        prompt_ids=memoryview(b"".join(s.prompt_ids for s in steps)),
        response_ids=memoryview(b"".join(s.response_ids for s in steps)),
        logprobs=memoryview(b"".join(s.logprobs for s in steps)),
        generate_s=generate_s,
    )


# broker -> actor: answer to GroupResult.
class Accepted(_Msg, tag="accepted"):
    lease_id: int
    accepted: bool
    reason: Text = ""


# ------------------------------------------------------------------ learning
# learner rank -> broker: "give me my shard of the batch for `version`".
class BatchRequest(_Msg, tag="batch_request"):
    client_id: Id
    model: Name
    rank: int
    world_size: int
    version: int  # learner's current weight version = the step it is about to take
    # LoRA base: adapter -> its own version at `version` (the optimizer steps that changed
    # it); the broker's staleness bound counts those. Empty for a whole model.
    adapter_versions: AdapterVersions = {}


class Sample(msgspec.Struct, forbid_unknown_fields=True):
    """One step turned into a training sequence."""

    agent: Name
    prompt_ids: bytes  # [P] int32 LE
    response_ids: bytes  # [T] int32 LE
    logprobs: bytes  # [T] float32 LE behaviour log-probs
    advantage: float  # broadcast to every response token
    version: int  # behaviour weight version
    # scales this sample's advantage, so its loss (1.0 unless balance_calls: broker/buffers.py)
    loss_weight: float = 1.0


# broker -> learner rank: its shard. Every rank of a step gets the same number of samples
# (padded with zero-weight copies), so FSDP collectives line up.
class BatchShard(_Msg, tag="batch_shard"):
    model: Name
    version: int
    rank: int
    world_size: int
    samples: Annotated[list[Sample], msgspec.Meta(max_length=MAX_LIST)]
    # per sample: 1.0, or 0.0 for a padding copy
    weights: Annotated[list[float], msgspec.Meta(max_length=MAX_LIST)]
    total_samples: int  # real samples over all ranks (for sequence-mean losses)
    total_tokens: int  # real response tokens over all ranks (for token-mean losses)


# broker -> learner rank: no batch yet (retry later) or training is over (done=True).
class NoBatch(_Msg, tag="no_batch"):
    retry_after_s: float
    reason: Text = ""
    done: bool = False
    republish: bool = False  # some actors hold older weights: publish the current version again


# learner rank 0 -> broker after each trained batch (its PPO updates); no reply.
class StepReport(_Msg, tag="step_report"):
    model: Name
    version: int  # new version after the step
    metrics: Annotated[dict[Name, float], msgspec.Meta(max_length=MAX_METRICS)]


# learner rank 0 -> broker: wants to broadcast `version`; its weight-group store listens
# at store_address ("host:port"). Answered by WeightGroupPlan.
class PublishRequest(_Msg, tag="publish_request"):
    model: Name
    version: int
    store_address: Text
    adapter_versions: AdapterVersions = {}  # LoRA base: as in BatchRequest, at `version`


# broker -> learner rank 0: who receives. Learner is rank 0, members[i] is rank i + 1.
class WeightGroupPlan(_Msg, tag="weight_group_plan"):
    model: Name
    version: int
    group_name: Id
    members: Annotated[list[Id], msgspec.Meta(max_length=MAX_LIST)]
    timeout_s: float
    # LoRA base: the adapters this publish carries, those whose version differs from what
    # some member holds (the others every member holds already). Unused for a whole model.
    adapters: Names = []
    token: Text = ""  # the group's secret, members prove it at join ("" = no check)


# broker -> actor, unsolicited: join this weight group and receive `version` of `model`.
class JoinWeightGroup(_Msg, tag="join_weight_group"):
    model: Name
    version: int
    group_name: Id
    store_address: Text
    rank: int
    world_size: int
    timeout_s: float
    token: Text = ""  # the group's secret (as in its WeightGroupPlan), proven at join
    adapters: Names = []  # LoRA base: what the publish carries (the header must match)


# actor -> broker after a JoinWeightGroup: loaded (ok) or failed (error says why).
class WeightsLoaded(_Msg, tag="weights_loaded"):
    client_id: Id
    model: Name
    version: int
    seconds: float
    ok: bool = True
    error: Text = ""
    digest: Text = ""  # fingerprint of the engine's weights after loading ("" = not computed)


# learner rank 0 -> broker after the broadcast of a WeightGroupPlan.
class PublishDone(_Msg, tag="publish_done"):
    model: Name
    version: int
    seconds: float
    bytes: int
    ok: bool = True
    error: Text = ""
    # fingerprint of the weights sent ("" = not computed); on a LoRA base, of every adapter
    # at `version`, also those the publish did not carry (what each actor must then hold)
    digest: Text = ""
    # members of the plan that did not check in with the token in time (the roll call):
    # nothing was sent to them; the broker re-publishes to them, or drops one that never comes
    left_out: Annotated[list[Id], msgspec.Meta(max_length=MAX_LIST)] = []
    # a failed publish: members that checked in and then never wrote their rendezvous
    # entry (they broke the group); the broker counts it against them, no one else
    broke: Annotated[list[Id], msgspec.Meta(max_length=MAX_LIST)] = []


# ------------------------------------------------------------------- control
# client -> broker.
class StatusRequest(_Msg, tag="status_request"):
    pass


class ActorStatus(msgspec.Struct, forbid_unknown_fields=True):
    client_id: Id
    host: Id
    pid: int
    versions: Versions
    leases: int  # leases held now
    groups_done: int
    episodes_done: int
    last_seen_s: float  # seconds since its last message


class ModelStatus(msgspec.Struct, forbid_unknown_fields=True):
    version: int  # batches trained
    buffered_groups: int
    batches_cut: int
    learner_ranks: int


# broker -> client.
class StatusReply(_Msg, tag="status_reply"):
    run_id: Id
    uptime_s: float
    actors: Annotated[list[ActorStatus], msgspec.Meta(max_length=MAX_LIST)]
    models: Annotated[dict[Name, ModelStatus], msgspec.Meta(max_length=MAX_MODELS)]
    queued_tasks: int
    in_flight_groups: int
    counters: Annotated[
        dict[Text, int], msgspec.Meta(max_length=MAX_LIST)
    ]  # refused messages, re-issued leases, dropped groups, ...
    done: bool


# broker -> sender of a message it refused.
class ErrorReply(_Msg, tag="error"):
    code: Name  # "bad_frame" | "protocol_version" | "invalid" | "unknown_client" | ...
    reason: Text
    refused: Name = ""  # type tag of the refused message ("" when it could not be decoded)


# broker -> actors and learners: training is over, exit cleanly.
class Shutdown(_Msg, tag="shutdown"):
    reason: Text


ToBroker = (
    Hello
    | Heartbeat
    | Goodbye
    | LeaseReturn
    | LeaseRequest
    | GroupResult
    | BatchRequest
    | StepReport
    | PublishRequest
    | PublishDone
    | WeightsLoaded
    | StatusRequest
)
FromBroker = (
    Welcome
    | Leases
    | Accepted
    | BatchShard
    | NoBatch
    | WeightGroupPlan
    | JoinWeightGroup
    | StatusReply
    | ErrorReply
    | Shutdown
)
