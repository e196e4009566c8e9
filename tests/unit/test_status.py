"""`drmas status` takes a run folder as well as an address: the broker's address (and a
CURVE broker's keys folder) are read from RUN_DIR/config.yaml. Anything else is refused
with a message saying what to pass (it used to crash with a ZMQError)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import zmq

from drmas.config import load_config, to_yaml
from drmas.launch.cli import main
from drmas.launch.status import Broker, StatusError, find_broker
from drmas.protocol import decode_to_broker, encode
from drmas.protocol.messages import StatusReply, StatusRequest


def write_run(run_dir: Path, *overrides: str) -> Path:
    """A run folder as `drmas train` leaves it: its resolved config.yaml."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(load_config(list(overrides))))
    return run_dir


def test_a_run_folder_names_its_broker_and_keys(tmp_path: Path) -> None:
    assert find_broker("tcp://10.0.0.5:5555") == Broker("tcp://10.0.0.5:5555")
    run = write_run(tmp_path / "run", "broker.address=tcp://10.0.0.5:5601")
    assert find_broker(str(run)) == Broker("tcp://10.0.0.5:5601", "", run)
    assert find_broker(str(run / "config.yaml")) == Broker("tcp://10.0.0.5:5601", "", run)
    # a wildcard bind is reached on this machine; a CURVE run's keys come along
    curve = write_run(
        tmp_path / "curve",
        "broker.address=tcp://0.0.0.0:5602",
        "security.curve=true",
        f"security.keys_dir={tmp_path / 'keys'}",
    )
    assert find_broker(str(curve)) == Broker("tcp://127.0.0.1:5602", str(tmp_path / "keys"), curve)
    assert find_broker(str(curve), "/mine").keys_dir == "/mine"  # --keys wins


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("nothing", "is neither a broker address nor a run folder"),
        ("empty folder", r"config\.yaml does not exist"),
        ("port 0", r"names no broker address to reach \(broker\.address='tcp://127\.0\.0\.1:0'\)"),
        ("not yaml", "is not a drmas config"),
    ],
)
def test_what_is_not_a_run_folder_is_refused_saying_what_to_pass(
    tmp_path: Path, setup: str, expected: str
) -> None:
    target = tmp_path / "run"
    if setup == "empty folder":
        target.mkdir()
    elif setup == "port 0":  # a config written before a port was chosen
        write_run(target)
    elif setup == "not yaml":
        target.mkdir()
        (target / "config.yaml").write_text("just text\n")
    with pytest.raises(StatusError, match=expected):
        find_broker(str(target))


def test_the_command_exits_2_with_a_message_instead_of_a_zmq_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", str(tmp_path / "nowhere")]) == 2
    assert "Pass the run folder `drmas train` printed" in capsys.readouterr().err
    assert main(["status", "tcp://127.0.0.1:notaport"]) == 2
    err = capsys.readouterr().err
    assert "cannot connect to 'tcp://127.0.0.1:notaport'" in err and "or a run folder" in err


def test_status_of_a_run_folder_asks_its_broker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    reply = StatusReply("run7", 3.0, [], {}, 0, 0, {"refused/too_big": 2}, False)
    received: list[object] = []  # what reached the router, for the failure message

    def answer_once() -> None:
        if router.poll(20_000):
            identity, payload = router.recv_multipart()
            received.append(decode_to_broker(payload))
            if isinstance(received[-1], StatusRequest):
                router.send_multipart([identity, encode(reply)])

    broker = threading.Thread(target=answer_once, daemon=True)
    broker.start()
    run = write_run(tmp_path / "run", f"broker.address=tcp://*:{port}")
    try:
        code = main(["status", str(run), "--json", "--timeout", "10"])
    finally:
        broker.join(timeout=30)
        router.close(linger=0)
    out, err = capsys.readouterr()
    assert code == 0, f"exit {code}; stderr {err!r}; the router received {received!r}"
    assert received and isinstance(received[0], StatusRequest)
    shown = json.loads(out)
    assert shown["run_id"] == "run7" and shown["counters"] == {"refused/too_big": 2}


def test_names_from_clients_are_printed_as_text_never_as_markup(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An actor's host or id is whatever its Hello said: rich markup in it crashed the
    table (a closing tag without an opening one) or would have styled the output."""
    from drmas.launch.status import print_tables
    from drmas.protocol.messages import ActorStatus, ModelStatus

    monkeypatch.setenv("COLUMNS", "400")  # one line per row: the names stay whole
    host = "[/bold][link=http://x]evil[/link]"
    actor = ActorStatus("actor-[red]1[/red]", host, 7, {"m[b]": 1}, 0, 0, 0, 1.0)
    reply = StatusReply(
        "run[/]", 3.0, [actor], {"m[/i]": ModelStatus(1, 0, 0, 1)}, 0, 0, {"c[/u]": 1}, False
    )
    print_tables(reply)  # raised rich.errors.MarkupError before
    out = capsys.readouterr().out
    for text in (host, "actor-[red]1[/red]", "run[/]", "m[/i]", "m[b]=v1", "c[/u]"):
        assert text in out


def test_status_at_a_connection_cap_says_so_instead_of_did_not_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from drmas.transports.channel import BrokerClient
    from tests.fixtures.broker_server import serving_broker

    with serving_broker(tmp_path, "broker.max_connections_per_host=1") as srv:
        learner = BrokerClient(srv.address, "learner-solver-0")  # the host's one connection
        try:
            learner.hello("learner", ["solver"], timeout_s=30, rank=0, world_size=1)
            code = main(["status", srv.address, "--timeout", "3"])  # asked on, then refused
        finally:
            learner.close()
    err = capsys.readouterr().err
    assert code != 0 and "broker.max_connections_per_host" in err, err


def test_status_refused_at_a_cap_asks_again_on_a_fresh_connection_until_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's one connection is the learner's: the first ask is closed three times
    and refused. Once the learner has gone, the next ask, on a fresh connection, is
    answered within the same --timeout (it used to give up at the first refusal: a flood
    of connections from `drmas status`'s own host kept it from ever being answered)."""
    import drmas.launch.status as status
    from drmas.transports.channel import BrokerClient, BrokerRefused
    from tests.fixtures.broker_server import serving_broker

    refused, asks = threading.Event(), []
    ask_once = status._ask_once

    def watched(*args: object) -> StatusReply:
        asks.append(args[1])
        try:
            return ask_once(*args)  # type: ignore[arg-type]
        except BrokerRefused:
            refused.set()
            raise

    monkeypatch.setattr(status, "_ask_once", watched)
    with serving_broker(tmp_path, "broker.max_connections_per_host=1") as srv:
        learner = BrokerClient(srv.address, "learner-solver-0")  # the host's one connection
        learner.hello("learner", ["solver"], timeout_s=30, rank=0, world_size=1)
        codes: list[int] = []
        asker = threading.Thread(
            target=lambda: codes.append(main(["status", srv.address, "--timeout", "120"]))
        )
        asker.start()
        try:
            assert refused.wait(120), "the first ask was never refused"
        finally:
            learner.close()
        asker.join(150)
    assert codes == [0] and len(asks) >= 2 and len(set(asks)) == len(asks), (codes, asks)
