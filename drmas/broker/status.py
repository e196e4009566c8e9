"""Read-only views of the broker's state (drmas/broker/state.py) for people and checks.

`status_reply` is what a `drmas status` client gets for a StatusRequest (the broker loop,
drmas/broker/server.py, sends it); `run_summary` is broker_summary.json, written at the
end of a run, with `lease_accounting`, which tests check balances.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from drmas.protocol.messages import ActorStatus, ModelStatus, StatusReply

if TYPE_CHECKING:
    from drmas.broker.state import BrokerState


def status_reply(state: BrokerState, now: float) -> StatusReply:
    """Every actor, every model and the counters, as of `now` (monotonic seconds)."""
    actors = [
        ActorStatus(
            a.client_id,
            a.host,
            a.pid,
            dict(a.versions),
            len(a.leases),
            a.groups_done,
            a.episodes_done,
            now - a.last_seen,
        )
        for a in state.table.actors.values()
    ]
    models = {
        m: ModelStatus(
            version=state.versions[m],
            buffered_groups=len(state.buffers[m].slices),
            batches_cut=state.buffers[m].batches_cut,
            learner_ranks=sum(1 for r in state.learners.values() if r.model == m),
        )
        for m in state.models
    }
    return StatusReply(
        run_id=state.run_id,
        uptime_s=now - state.started,
        actors=actors,
        models=models,
        queued_tasks=len(state.validation.queue),
        in_flight_groups=state.table.in_flight(),
        counters=dict(state.counters),
        done=state.done,
    )


def lease_accounting(state: BrokerState) -> dict[str, int]:
    """Every issued lease ended exactly one way (or is still out): `balanced` must be 1."""
    c = state.counters
    ended = {
        "accepted": c["groups_accepted"] + c["eval_groups_accepted"],
        "reissued": c["leases_reissued"],
        "handed_back": c["leases_handed_back"],
        "expired": c["leases_expired"],
        "requeued_on_resume": c["leases_requeued_on_resume"],
        "outstanding": len(state.table.leases),
    }
    ended["issued"] = c["leases_issued"]
    ended["balanced"] = int(c["leases_issued"] == sum(v for k, v in ended.items() if k != "issued"))
    return ended


def run_summary(state: BrokerState, cpu: dict[str, Any]) -> dict[str, Any]:
    """broker_summary.json: counters, versions, groups, leases, how the run ended, CPU."""
    return {
        "counters": dict(state.counters),
        "versions": state.versions,
        "accepted_groups": len(state.accepted_groups),
        "trained_groups": {m: len(g) for m, g in state.trained_groups.items()},
        "leases": lease_accounting(state),
        "done": state.done,
        "learner_lost": state.learners.lost,  # why the run stopped early, or ""
        "cpu": cpu,
    }
