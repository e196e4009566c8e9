"""CURVE keys and the bind rules: key layout, permissions, overwrite refusal, loopback."""

from __future__ import annotations

import logging
import stat
import threading
from pathlib import Path

import pytest
import zmq
import zmq.auth

from drmas.config.transport import SecurityConfig
from drmas.launch.cli import main as cli
from drmas.transports.channel import BrokerClient, bind_router
from drmas.transports.security import (
    SecurityError,
    check_bind,
    check_keys,
    find_client,
    is_loopback,
    key_roles,
    keys_dir,
    write_keys,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_layout_and_permissions(tmp_path: Path) -> None:
    root = tmp_path / "keys"
    assert cli(["keys", str(root), "--clients", "actors,ops"]) == 0
    files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert files == {
        "broker.key",
        "broker.key_secret",
        "clients/actors.key",
        "clients/actors.key_secret",
        "clients/ops.key",
        "clients/ops.key_secret",
        "authorized/actors.key",
        "authorized/ops.key",
        "authorized/roles.json",
    }
    for secret in ["broker.key_secret", "clients/actors.key_secret", "clients/ops.key_secret"]:
        assert mode(root / secret) == 0o600, secret
        public, secret_key = zmq.auth.load_certificate(root / secret)
        assert secret_key is not None and len(secret_key) == 40  # z85 of 32 bytes
        # the matching public file holds the same public key and no secret
        assert zmq.auth.load_certificate(root / secret.replace("_secret", "")) == (public, None)
    for name in ["actors", "ops"]:
        assert zmq.auth.load_certificate(root / "authorized" / f"{name}.key") == (
            zmq.auth.load_certificate(root / "clients" / f"{name}.key")
        )
    # every key pair is distinct, and the broker's own key is not an authorized client
    publics = {zmq.auth.load_certificate(p)[0] for p in root.glob("**/*.key")}
    assert len(publics) == 3
    assert zmq.auth.load_certificate(root / "broker.key")[0] not in zmq.auth.load_certificates(
        root / "authorized"
    )
    assert not list(root.glob(".staging-*"))


def test_refuses_to_overwrite_unless_force(tmp_path: Path, capsys) -> None:
    root = tmp_path / "keys"
    write_keys(root, ["a", "b"])
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert cli(["keys", str(root), "--clients", "c"]) == 2
    assert "--force" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before

    assert cli(["keys", str(root), "--clients", "c", "--force"]) == 0
    # the whole set is replaced: old clients can no longer get in
    assert sorted(p.name for p in (root / "authorized").iterdir()) == ["c.key", "roles.json"]
    assert sorted(p.name for p in (root / "clients").iterdir()) == ["c.key", "c.key_secret"]
    assert (root / "broker.key_secret").read_bytes() != before[root / "broker.key_secret"]


@pytest.mark.parametrize("name", ["", "../x", ".hidden", "a b", "x" * 65])
def test_bad_client_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(SecurityError):
        write_keys(tmp_path / "keys", [name] if name else [])
    assert not (tmp_path / "keys" / "broker.key").exists()


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.1:0", True),
        ("tcp://127.8.9.10:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/drmas.sock", True),
        ("inproc://broker", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.0.0.5:5555", False),
        ("tcp://128.0.0.1:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://node7.cluster:5555", False),
        ("tcp://localhost.evil.com:5555", False),
    ],
)
def test_loopback_detection(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_insecure_bind_is_refused() -> None:
    ctx = zmq.Context()
    try:
        with pytest.raises(SecurityError, match="allow_insecure=true") as err:
            bind_router(ctx, "tcp://0.0.0.0:0", 1 << 20, SecurityConfig())
        assert "security.curve=true" in str(err.value) and "drmas keys" in str(err.value)
        # loopback without CURVE is the default and stays allowed, silently
        sock, address = bind_router(ctx, "tcp://127.0.0.1:0", 1 << 20, SecurityConfig())
        assert address.startswith("tcp://127.0.0.1:")
        sock.close(linger=0)
    finally:
        ctx.term()


def test_allow_insecure_binds_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="drmas.transports.security"):
            sock, address = bind_router(
                ctx, "tcp://0.0.0.0:0", 1 << 20, SecurityConfig(allow_insecure=True)
            )
        sock.close(linger=0)
    finally:
        ctx.term()
    assert address.startswith("tcp://0.0.0.0:")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "WITHOUT authentication" in warnings[0].getMessage()
    # with CURVE on, a public bind needs no permission and logs no warning
    caplog.clear()
    check_bind("tcp://0.0.0.0:5555", SecurityConfig(curve=True))
    assert not caplog.records


def test_missing_keys_name_the_file_and_the_command(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert keys_dir(SecurityConfig()) == tmp_path / "keys"  # the documented default
    with pytest.raises(SecurityError) as err:
        check_keys(SecurityConfig(curve=True))
    message = str(err.value)
    assert str(tmp_path / "keys" / "broker.key_secret") in message
    assert f"drmas keys {tmp_path / 'keys'}" in message

    write_keys(tmp_path / "keys", ["actors"])
    # client_name left empty may be set per node at launch: prepare does not demand it
    check_keys(SecurityConfig(curve=True))
    check_keys(SecurityConfig(curve=True, client_name="actors"))
    with pytest.raises(SecurityError) as err:
        check_keys(SecurityConfig(curve=True, client_name="ops"))
    assert "clients/ops.key_secret does not exist" in str(err.value)
    assert "holds actors: set security.client_name" in str(err.value)
    # a client process with the default name fails before it connects, saying the same
    ctx = zmq.Context()
    try:
        with pytest.raises(SecurityError, match=r"clients/default\.key_secret does not exist"):
            BrokerClient("tcp://127.0.0.1:9", "a-1", ctx=ctx, security=SecurityConfig(curve=True))
    finally:
        ctx.term()  # returns only if the failed client closed its socket
    assert find_client(tmp_path / "keys") == "actors"  # what `drmas status --keys` uses

    (tmp_path / "keys" / "authorized" / "actors.key").unlink()
    with pytest.raises(SecurityError, match="no client public keys"):
        check_keys(SecurityConfig(curve=True, client_name="actors"))


def test_curve_router_close_releases_the_context(tmp_path: Path) -> None:
    """The ZAP handler is stopped with the socket, so ctx.term() does not hang."""
    write_keys(tmp_path, ["default"])
    ctx = zmq.Context()
    sock, _ = bind_router(
        ctx, "tcp://127.0.0.1:0", 1 << 20, SecurityConfig(curve=True, keys_dir=str(tmp_path))
    )
    assert sock.curve_server == 1 and sock.getsockopt(zmq.MAXMSGSIZE) == 1 << 20
    sock.close(linger=0)
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(10), "ctx.term() hung: the ZAP handler outlived its socket"


def test_drmas_keys_binds_every_key_by_default(tmp_path: Path, capsys) -> None:
    """Issue #25: the documented setup (`--clients actors,learners`) gave keys no role, and
    a key without one could take any role. Now every key is bound, the documented names to
    the role they name; a learner key may be bound to its models."""
    import json

    root = tmp_path / "keys"
    clients = "actors,learners,status,solver:learner:solver,both:learner:solver+verifier,default"
    assert cli(["keys", str(root), "--clients", clients]) == 0
    assert json.loads((root / "authorized" / "roles.json").read_text()) == {
        "actors": "actor", "learners": "learner", "status": "observer",
        "solver": "learner:solver", "both": "learner:solver+verifier", "default": "any",
    }  # fmt: skip
    err = capsys.readouterr().err
    assert "actors=actor, learners=learner" in err and "Keys bound to any" in err
    by_name = {
        name: zmq.auth.load_certificate(root / "authorized" / f"{name}.key")[0].decode()
        for name in ("actors", "learners", "status", "solver", "both", "default")
    }
    granted = key_roles(root)
    assert {n: granted[k] for n, k in by_name.items()} == {
        "actors": {"actor"}, "learners": {"learner"}, "status": {"client"},
        "solver": {"learner:solver"}, "both": {"learner:solver", "learner:verifier"},
        "default": {"actor", "learner", "client"},
    }  # fmt: skip


@pytest.mark.parametrize(
    "clients", ["a:admin", "a:actor:solver", "a:learner:", "a:learner:s++v", "a:learner:../x"]
)
def test_bad_bindings_are_refused(tmp_path: Path, clients: str, capsys) -> None:
    assert cli(["keys", str(tmp_path / "keys"), "--clients", clients]) == 2
    assert "is not a binding" in capsys.readouterr().err
    assert not (tmp_path / "keys" / "broker.key").exists()


def test_a_broker_refuses_keys_without_bindings(tmp_path: Path) -> None:
    """A key set without roles.json (written before bindings existed) let every key take any
    role: the broker refuses to start, saying what to run; a key added to authorized/
    without a binding gets nothing."""
    import json

    root = tmp_path / "keys"
    write_keys(root, ["actors", "ops"])
    (root / "authorized" / "roles.json").unlink()
    for load in (lambda: key_roles(root), lambda: check_keys(
            SecurityConfig(curve=True, keys_dir=str(root)))):  # fmt: skip
        with pytest.raises(SecurityError, match=r"roles\.json does not exist") as err:
            load()
        assert f"drmas keys {root} --clients" in str(err.value)
    (root / "authorized" / "roles.json").write_text(json.dumps({"actors": "actor"}))
    ops = zmq.auth.load_certificate(root / "authorized" / "ops.key")[0].decode()
    assert key_roles(root)[ops] == frozenset()
    (root / "authorized" / "roles.json").write_text(json.dumps({"actors": "admin"}))
    with pytest.raises(SecurityError, match="'admin' is not a binding"):
        key_roles(root)
    (root / "authorized" / "roles.json").write_text(json.dumps(["actors"]))
    with pytest.raises(SecurityError, match="must map each key name"):
        key_roles(root)


def test_a_key_bound_to_a_role_cannot_take_another(tmp_path: Path) -> None:
    """`drmas keys --clients ops:observer,...`: the broker reads each message's key (ZAP
    User-Id) and refuses roles, and a learner's models, the key was not given; a key
    without a binding gets nothing, not even status."""
    import json
    import time

    from drmas.broker.server import BrokerServer
    from drmas.config import load_config
    from drmas.protocol.messages import StatusReply, StatusRequest, Welcome
    from drmas.transports.channel import BrokerRefused

    keys = tmp_path / "keys"
    clients = "ops:observer,actors:actor,any,solver:learner:solver,stray"
    assert cli(["keys", str(keys), "--clients", clients]) == 0
    roles = json.loads((keys / "authorized" / "roles.json").read_text())
    assert roles == {"ops": "observer", "actors": "actor", "any": "any",
                     "solver": "learner:solver", "stray": "any"}  # fmt: skip
    del roles["stray"]  # in authorized/, but bound to nothing
    (keys / "authorized" / "roles.json").write_text(json.dumps(roles))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 64}))
    cfg = load_config(
        [f"models.solver.path={model}", f"models.verifier.path={model}", "val.every=0",
         "security.curve=true", f"security.keys_dir={keys}"]
    )  # fmt: skip
    server = BrokerServer(cfg, None)
    loop = threading.Thread(target=server.serve, kwargs={"max_seconds": 60}, daemon=True)
    loop.start()

    opened: list[BrokerClient] = []  # closed at the end: none outlives the test

    def client(name: str, cid: str) -> BrokerClient:
        security = SecurityConfig(curve=True, keys_dir=str(keys), client_name=name)
        opened.append(BrokerClient(server.address, cid, security=security))
        return opened[-1]

    try:
        ops = client("ops", "ops-1")
        assert isinstance(ops.hello("client", [], timeout_s=20), Welcome)
        assert isinstance(ops.request(StatusRequest(), StatusReply, 10), StatusReply)
        with pytest.raises(BrokerRefused, match="not allowed the actor role"):
            ops.hello("actor", ["solver", "verifier"], timeout_s=10)
        with pytest.raises(BrokerRefused, match="not allowed the learner role"):
            client("actors", "x").hello("learner", ["solver"], timeout_s=10)
        solver = client("solver", "learner-verifier-0")
        with pytest.raises(BrokerRefused, match=r"bound to the learners of \['solver'\]"):
            solver.hello("learner", ["verifier"], timeout_s=10)
        assert isinstance(client("solver", "learner-solver-0").hello(
            "learner", ["solver"], timeout_s=10), Welcome)  # fmt: skip
        stray = client("stray", "s")
        for attempt in (lambda: stray.hello("actor", ["solver", "verifier"], timeout_s=10),
                        lambda: stray.request(StatusRequest(), StatusReply, 10)):  # fmt: skip
            with pytest.raises(BrokerRefused, match=r"no binding in authorized/roles\.json"):
                attempt()
        for name, cid in (("actors", "a1"), ("any", "a2")):
            assert isinstance(
                client(name, cid).hello("actor", ["solver", "verifier"], timeout_s=10), Welcome
            )
        counters = ops.request(StatusRequest(), StatusReply, 10).counters
        assert counters["refused/forbidden"] == 5 and counters["actors_joined"] == 2
    finally:
        for c in opened:
            c.close()
        server._stop = "the test is over"
        loop.join(timeout=10)
    time.sleep(0)
