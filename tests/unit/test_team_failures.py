"""Failures of the team's own code: shown once in full with the user's file and line,
counted in a row, and after actor.max_failed_groups of them the actor stops naming the
team, the exception and where it was raised; `drmas train` prints what the actors
report. A transient failure only hands its lease back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from drmas.actors.engines.base import Engine
from drmas.actors.failures import FailureWatch, describe, read_report, report_path
from drmas.actors.main import Actor
from drmas.config import load_config
from drmas.launch.team_failures import FailureReports
from drmas.plugins import load_object
from drmas.protocol.messages import (
    Accepted,
    Episode,
    GroupResult,
    Lease,
    LeaseReturn,
    Task,
)
from drmas.teams.math import MathTeam
from drmas.teams.resolve import team_class
from tests.fixtures.engines import CharTokenizer, ScriptedEngine
from tests.unit.test_teams import SAMPLING, asker_config

USER_CODE = """\
import json


def broken(state):
    return state.missing_attribute  # line 5


def parses(text):
    return json.loads(text)  # line 9


async def tool(argument):
    raise KeyError(argument)  # line 13


def reward(task, answer):
    raise ZeroDivisionError("reward of " + str(answer))  # line 17
"""


def user_code(tmp_path: Path, name: str) -> Callable[..., Any]:
    """A function of a file outside drmas, loaded as `workflow.target` would load it."""
    file = tmp_path / "my_team.py"
    file.write_text(USER_CODE)
    return cast(Callable[..., Any], load_object(f"{file}:{name}", "test"))


def raised(fn: Callable[..., Any], *args: object) -> BaseException:
    try:
        fn(*args)
    except Exception as exc:
        return exc
    raise AssertionError("did not raise")


def test_a_failure_names_the_line_in_the_users_code(tmp_path: Path) -> None:
    exc = raised(user_code(tmp_path, "broken"), None)
    failure = describe(exc, "mine", "actor-0")
    file = tmp_path / "my_team.py"
    assert failure.where == f"{file}:5 in broken"
    assert failure.exception.startswith("AttributeError: 'NoneType' object has no attribute")
    assert f'File "{file}", line 5, in broken' in failure.traceback
    assert failure.traceback.startswith("Traceback (most recent call last)")
    # raised inside the standard library: the user's line that called it is named
    exc = raised(user_code(tmp_path, "parses"), "{")
    assert describe(exc, "mine", "actor-0").where == f"{file}:9 in parses"
    assert "json" in describe(exc, "mine", "actor-0").traceback  # the full chain is kept


def test_failed_groups_in_a_row_stop_a_success_resets_the_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    report = tmp_path / "actor-0.failure.json"
    watch = FailureWatch("mine", "actor-0", limit=3, report=report)
    exc = raised(user_code(tmp_path, "broken"), None)
    with caplog.at_level(logging.ERROR, logger="drmas.actor"):
        assert not watch.failed(exc, 1)
        assert not watch.failed(exc, 2)
        watch.succeeded()  # transient: the count starts again
        assert not watch.failed(exc, 3)
        assert not watch.failed(exc, 4)
        first = read_report(report)
        assert first is not None and not first.stopped and first.failed_groups == 1
        assert watch.failed(exc, 5)  # the third in a row
    tracebacks = [r for r in caplog.records if "Traceback (most recent call last)" in r.message]
    assert len(tracebacks) == 1  # the first failure in full, the other four one line each
    assert len(caplog.records) == 5
    stopped = watch.gave_up()
    assert read_report(report) == stopped
    assert stopped.stopped and stopped.failed_groups == 3
    message = stopped.stop_message()
    assert "the mine team failed 3 groups in a row in 0 s on actor-0" in message
    assert "AttributeError" in message and f"{tmp_path / 'my_team.py'}:5 in broken" in message


def test_zero_never_stops(tmp_path: Path) -> None:
    watch = FailureWatch("mine", "actor-0", limit=0, report=None)
    exc = raised(user_code(tmp_path, "broken"), None)
    assert not any(watch.failed(exc, i) for i in range(100))


def test_a_short_outage_does_not_stop_the_actor(tmp_path: Path) -> None:
    """Many groups failing within min_seconds (a tool down for a moment) are not enough;
    the same failures going on past it are. Meanwhile leases are asked for more slowly."""
    now = [100.0]
    watch = FailureWatch("mine", "a", 3, None, min_seconds=10.0, clock=lambda: now[0])
    exc = raised(user_code(tmp_path, "broken"), None)
    assert watch.backoff_s() == 0.0
    assert not any(watch.failed(exc, i) for i in range(50))  # 50 failures at t=100
    assert watch.backoff_s() == 1.0
    now[0] = 109.0
    watch.succeeded()  # the tool is back
    assert watch.backoff_s() == 0.0
    assert not watch.failed(exc, 51)  # a new row starts at t=109
    assert watch.backoff_s() == 0.1
    now[0] = 118.0
    assert not watch.failed(exc, 52) and not watch.failed(exc, 53)  # 3 in a row, 9 s
    now[0] = 119.0
    assert watch.failed(exc, 54)  # 4 in a row, 10 s
    assert watch.gave_up().failing_s == 10.0


def test_a_raising_tool_or_reward_is_named(tmp_path: Path) -> None:
    tool = user_code(tmp_path, "tool")
    cfg = asker_config(tmp_path, f"workflow.tools.calc={tmp_path / 'my_team.py'}:tool")
    engine = ScriptedEngine([" <calc>1+1</calc>"], CharTokenizer())
    engines = cast(dict[str, Engine], {"m": engine})
    team = team_class(cfg.workflow).build(cfg, {"asker": "m"}, engines, {"m": engine.tokenizer})
    assert team.tool_fns["calc"].__code__ is tool.__code__
    task = Task("t:0", "1+1", "2", "t")
    with pytest.raises(KeyError) as info:
        asyncio.run(team.run_episode(task, SAMPLING))
    failure = describe(info.value, team.name, "actor-0")
    assert failure.where == f"{tmp_path / 'my_team.py'}:13 in tool"
    assert "raised by the asker team's tool 'calc', argument '1+1'" in failure.exception

    engine = ScriptedEngine([" \\boxed{5}", " <verify>yes</verify>"], CharTokenizer())
    reward = user_code(tmp_path, "reward")
    target = f"{tmp_path / 'my_team.py'}:reward"
    math_cfg = load_config([f"workflow.reward={target}"]).workflow
    bind = {"solver": "m", "verifier": "m"}
    engines = cast(dict[str, Engine], {"m": engine})
    math = MathTeam(math_cfg, bind, engines, {"m": engine.tokenizer}, reward=reward)
    with pytest.raises(ZeroDivisionError) as info:
        asyncio.run(math.run_episode(Task("a:0", "2+3", "5", "a"), SAMPLING))
    failure = describe(info.value, "math", "actor-0")
    assert failure.where == f"{tmp_path / 'my_team.py'}:17 in reward"
    assert f"raised by workflow.reward={target}" in failure.exception


def lease(lease_id: int) -> Lease:
    return Lease(lease_id, 100 + lease_id, Task("t", "q", "a", "s"), 1, False, SAMPLING, 60.0)


def test_the_actor_hands_leases_back_and_stops_after_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(
        ["actor.engine.name=sim", "actor.max_failed_groups=3", "actor.min_failing_s=0",
         f"run.dir={tmp_path}"]
    )  # fmt: skip
    actor = Actor(cfg, "actor-0")
    sent: list[object] = []
    monkeypatch.setattr(actor.client, "send", sent.append)

    async def accepted(message: GroupResult, expect: type) -> Accepted:
        sent.append(message)
        return Accepted(message.lease_id, True)

    monkeypatch.setattr(actor, "ask", accepted)
    broken = user_code(tmp_path, "broken")

    async def group(ok: bool) -> list[Episode]:
        if not ok:
            broken(None)
        return []

    async def finish(*outcomes: bool) -> None:
        """Groups that fail (False) or succeed (True), each finished in that order."""
        for ok in outcomes:
            i = len(sent) + 1
            actor.leases[i], actor.started_at[i] = lease(i), 0.0
            actor.running[i] = asyncio.create_task(group(ok))
            await asyncio.sleep(0)
            await actor.send_finished()

    async def main() -> None:
        await finish(False, False, True, False, False)
        assert not actor.stopping and actor.gave_up is None  # the success reset the count
        returned = [m for m in sent if isinstance(m, LeaseReturn)]
        assert [m.lease_ids for m in returned] == [[1], [2], [4], [5]]
        assert "AttributeError" in returned[0].reason
        await finish(False)
        assert actor.gave_up is not None and actor.stopping

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert actor.gave_up is not None and actor.gave_up.failed_groups == 3
    path = report_path(str(tmp_path), "actor-0")
    assert path is not None and read_report(path) == actor.gave_up


def test_a_group_task_cancelled_from_inside_hands_its_lease_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A team coroutine that ends cancelled (it cancelled itself, or awaited something that
    was) is a failed group: its lease goes back and it counts toward the limit; the actor
    does not crash asking the task for its exception."""
    cfg = load_config(["actor.engine.name=sim", f"run.dir={tmp_path}"])
    actor = Actor(cfg, "actor-0")
    sent: list[object] = []
    monkeypatch.setattr(actor.client, "send", sent.append)

    async def cancelled() -> list[Episode]:
        raise asyncio.CancelledError

    async def main() -> None:
        actor.leases[1], actor.started_at[1] = lease(1), 0.0
        actor.running[1] = asyncio.create_task(cancelled())
        await asyncio.sleep(0)
        assert actor.running[1].cancelled()
        await actor.send_finished()

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    (returned,) = sent
    assert isinstance(returned, LeaseReturn) and returned.lease_ids == [1]
    assert "CancelledError" in returned.reason and "cancelled before it returned" in returned.reason
    assert actor.failures.in_a_row == 1 and not actor.running and not actor.leases


def test_drmas_train_prints_the_first_failure_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exc = raised(user_code(tmp_path, "broken"), None)
    logs = tmp_path / "logs"
    logs.mkdir()
    earlier = FailureWatch("mine", "actor-0", 1, report_path(str(tmp_path), "actor-0"))
    earlier.failed(exc, 1)
    earlier.gave_up()  # a report an earlier drmas train left in this run folder
    reports = FailureReports(logs)
    reports.poll()
    assert capsys.readouterr().err == "" and reports.gave_up("actor-0") is None
    watches = [FailureWatch("mine", f"actor-{i}", 2, report_path(str(tmp_path), f"actor-{i}"))
               for i in range(2)]  # fmt: skip
    watches[0].failed(exc, 1)
    reports.poll()
    reports.poll()
    err = capsys.readouterr().err
    assert err.count("Traceback (most recent call last)") == 1
    assert f'File "{tmp_path / "my_team.py"}", line 5, in broken' in err
    assert reports.gave_up("actor-0") is None  # failing, not stopped
    watches[1].failed(exc, 1)
    reports.poll()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "actor-1: the same failure" in err
    watches[1].failed(exc, 2)
    stopped = watches[1].gave_up()
    assert reports.gave_up("actor-1") == stopped and reports.gave_up("actor-0") is None
