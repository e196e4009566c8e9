"""Learner seats belong to the run's learners (issue #36, item 1): a Hello for a learner
seat must prove, under the run's learner secret, the seat it asks for. Here on a real
broker loop on loopback; the whole-run case is tests/integration/test_learner_seats.py."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from drmas.broker.server import BrokerServer
from drmas.config import load_config
from drmas.config.transport import SecurityConfig
from drmas.protocol.messages import ErrorReply, Welcome
from drmas.transports.learner_secret import ensure_secret, load_secret, proof, proves
from drmas.transports.security import SecurityError
from tests.fixtures.broker_server import broker_server
from tests.unit.test_broker_gate import Peer


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    return ensure_secret(tmp_path / "run" / "learner.secret")


@pytest.fixture
def server(tmp_path: Path, secret_file: Path) -> Iterator[BrokerServer]:
    with broker_server(tmp_path, f"security.learner_secret={secret_file}") as srv:
        yield srv


def test_the_secret_is_written_once_private_and_kept(tmp_path: Path) -> None:
    path = ensure_secret(tmp_path / "a" / "learner.secret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_text()
    assert len(first.strip()) == 64
    assert ensure_secret(path).read_text() == first  # a run prepared again keeps it
    assert ensure_secret(tmp_path / "b" / "learner.secret").read_text() != first


def test_a_named_secret_that_is_missing_or_empty_is_a_security_error(tmp_path: Path) -> None:
    assert load_secret(SecurityConfig()) is None
    with pytest.raises(SecurityError, match="copy it to every node"):
        load_secret(SecurityConfig(learner_secret=str(tmp_path / "nowhere")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecurityError, match="holds no secret"):
        load_secret(SecurityConfig(learner_secret=str(tmp_path / "empty")))


def test_a_proof_names_one_seat_and_one_secret() -> None:
    a, b = b"a" * 64, b"b" * 64
    p = proof(a, "learner-solver-0", "solver", 0)
    assert proves(a, p, "learner-solver-0", "solver", 0)
    assert not proves(b, p, "learner-solver-0", "solver", 0)
    assert not proves(a, p, "learner-solver-1", "solver", 0)  # another id
    assert not proves(a, p, "learner-solver-0", "verifier", 0)  # another model
    assert not proves(a, p, "learner-solver-0", "solver", 1)  # another rank
    assert not proves(a, "", "learner-solver-0", "solver", 0)


def test_a_learner_hello_without_the_proof_is_refused_and_seats_nobody(
    server: BrokerServer, secret_file: Path
) -> None:
    secret = secret_file.read_text().strip().encode()
    squatter = Peer(server, "intruder")
    # no proof, a made-up one, the real rank 0's proof (another id), one for rank 1
    for given in ("", "0" * 64, proof(secret, "learner-solver-0", "solver", 0),
                  proof(secret, "intruder", "solver", 1)):  # fmt: skip
        reply = squatter.hello("learner", ["solver"], rank=0, world_size=1, proof=given)
        assert isinstance(reply, ErrorReply) and reply.code == "forbidden", reply
        assert "did not prove it is a learner of this run" in reply.reason
        assert "RUN_DIR/learner.secret" in reply.reason
    assert not server.state.learners.world_sizes("solver", "")  # no seat was taken
    real = Peer(server, "learner-solver-0")
    given = proof(secret, "learner-solver-0", "solver", 0)
    assert isinstance(real.hello("learner", ["solver"], rank=0, proof=given), Welcome)
    # actors and observers need no proof: the secret is the learners' alone
    assert isinstance(Peer(server, "actor-0").hello("actor", ["solver", "verifier"]), Welcome)
    for peer in (squatter, real):
        peer.close()


def test_drmas_prepare_writes_the_secret_and_names_it_in_config_yaml(tmp_path: Path) -> None:
    from drmas.launch.train import prepare_run

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"vocab_size": 64}')
    cfg = load_config(
        [f"models.solver.path={folder}", f"models.verifier.path={folder}",
         f"run.dir={tmp_path / 'run'}"]
    )  # fmt: skip
    resolved, run_dir, _ = prepare_run(cfg)
    assert resolved.security.learner_secret == str(run_dir / "learner.secret")
    assert load_secret(resolved.security) is not None
    again = load_config([], str(run_dir / "config.yaml"))
    assert again.security.learner_secret == str(run_dir / "learner.secret")
    # the actors' secret beside it, a different one (an actor node never holds the learners')
    from drmas.transports.learner_secret import load_actor_secret

    assert again.security.actor_secret == str(run_dir / "actor.secret")
    assert load_actor_secret(again.security) not in (None, load_secret(again.security))
