"""A learner rank the broker no longer knows (unknown_client) stops with an error saying why.

Issue #25: when an intruder's Hello replaced the real rank 0, the real one's next request
was answered unknown_client, which it did not handle. The seat is no longer taken over
(tests/unit/test_broker_gate.py), but a rank can still be dropped, after
broker.learner_timeout_s of silence or by a restarted broker: it must say so and stop."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from drmas.broker.server import BrokerServer
from drmas.learners.main import Heartbeats, Learner, LearnerDropped, _shutdown_requested
from drmas.protocol.messages import ErrorReply, Shutdown
from drmas.transports.channel import BrokerClient, BrokerRefused
from tests.fixtures.broker_server import serving_broker


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[BrokerServer]:
    """A broker loop in a thread that drops a learner silent for one second."""
    with serving_broker(tmp_path, "broker.learner_timeout_s=1") as srv:
        yield srv


class SilentLearner(Learner):
    """Rank 0 of the solver without torch: says Hello, then stays silent until the broker
    has dropped it, as a rank blocked far longer than broker.learner_timeout_s would."""

    def __init__(self, server: BrokerServer) -> None:
        super().__init__(server.cfg, "solver", 0, 1)
        self.server = server
        self.closed = False

    def join_group(self) -> None:
        pass

    def setup(self) -> None:
        self._client = BrokerClient(self.server.address, "learner-solver-0")
        welcome = self._client.hello("learner", ["solver"], timeout_s=20)
        self.beat = Heartbeats(self._client, "solver", 0, welcome.heartbeat_interval_s)
        self.trainer = SimpleNamespace(lora=None)  # type: ignore[assignment]
        deadline = time.monotonic() + 20
        while self.server.state.learners and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not self.server.state.learners, "the broker did not drop the silent learner"
        self.beat.next_at = time.monotonic() + 60  # the refused request comes first

    def cleanup(self) -> None:
        self.client.close()
        self.closed = True


def test_a_dropped_learner_stops_saying_why(serving: BrokerServer) -> None:
    learner = SilentLearner(serving)
    with pytest.raises(LearnerDropped) as err:
        learner.run()
    message = str(err.value)
    assert "solver rank 0 stops: the broker no longer knows this learner" in message
    assert "'learner-solver-0'" in message and "has not said Hello (or was dropped)" in message
    assert "broker.learner_timeout_s=1 s" in message and "run.resume=RUN_DIR" in message
    assert learner.closed  # cleaned up on the way out
    assert serving.state.counters["learners_lost"] == 1
    assert serving.state.counters["refused/unknown_client"] >= 1


class Inbox:
    def __init__(self, *messages: object) -> None:
        self.inbox = list(messages)


def test_an_unknown_client_refusal_of_a_heartbeat_stops_any_rank() -> None:
    """Heartbeats and step reports get no reply; their refusals wait in the inbox."""
    beat = ErrorReply("unknown_client", "'learner-solver-1' has not said Hello", "heartbeat")
    client = Inbox(ErrorReply("invalid", "something else", "heartbeat"), beat, Shutdown("x"))
    with pytest.raises(BrokerRefused, match="broker refused heartbeat: 'learner-solver-1'") as err:
        _shutdown_requested(client)  # type: ignore[arg-type]
    assert err.value.code == "unknown_client" and not client.inbox
    assert _shutdown_requested(Inbox(ErrorReply("invalid", "x"), Shutdown("done")))  # type: ignore[arg-type]
    assert not _shutdown_requested(Inbox())  # type: ignore[arg-type]
