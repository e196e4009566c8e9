"""The run's secrets: how a learner rank, and an actor, prove to the broker that they
belong to the run.

A learner seat (model, rank) decides who may ask for that rank's shards, report steps and
publish weights (drmas/broker/seats.py), so a client that took a free seat first could
stop the run or point the actors at a weight store of its own. `drmas train` and `drmas
prepare` write a random secret to RUN_DIR/learner.secret (mode 600) and name it in
security.learner_secret; the learner ranks read it (drmas/learners/main.py) and their
Hello carries `proof`, an HMAC-SHA256 of the seat they ask for under it; the broker's gate
(drmas/broker/gate.py) seats a learner only with the right proof. Actors never read it:
copy the file to learner nodes only.

Actors prove themselves the same way with a second secret, RUN_DIR/actor.secret
(security.actor_secret): their Hello carries an HMAC of their client id under it, and the
broker welcomes no actor without it, so a client on the network that holds neither file
cannot lease tasks, hand in groups or join a publish's roll call. It is a separate file
because an actor node needs its secret and must not hold the learners' (with it, a
compromised actor could take a learner seat).

What they do not do: without CURVE the Hello travels in clear, so whoever can read the
broker's traffic can replay a proof for that one seat (it names the client id, the model
and the rank). Across networks that are not trusted, use CURVE (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from drmas.config.transport import SecurityConfig
from drmas.transports.security import SecurityError

FILE_NAME = "learner.secret"
"""Its name in the run folder."""
ACTOR_FILE_NAME = "actor.secret"
"""The actors' secret's name in the run folder."""
SECRET_BYTES = 32


def ensure_secret(path: Path) -> Path:
    """Write a fresh secret to `path` (mode 600) unless one is there: a run prepared again
    (a restart under Slurm) keeps the secret its learners already hold."""
    path = path.resolve()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return path


def load_secret(security: SecurityConfig) -> bytes | None:
    """The run's learner secret, or None when security.learner_secret is empty;
    SecurityError when it names a file that is missing or holds no secret."""
    return _read(security.learner_secret, "learner_secret", "the broker or a learner rank")


def load_actor_secret(security: SecurityConfig) -> bytes | None:
    """The run's actor secret, or None when security.actor_secret is empty (as above)."""
    return _read(security.actor_secret, "actor_secret", "the broker or an actor")


def _read(setting: str, key: str, who: str) -> bytes | None:
    if not setting:
        return None
    path = Path(setting)
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise SecurityError(
            f"cannot read the secret {path} (security.{key}): {exc}. `drmas prepare` writes "
            f"it in the run folder; copy it to every node that runs {who}"
        ) from None
    if len(text) < 2 * SECRET_BYTES:
        raise SecurityError(
            f"{path} holds no secret ({len(text)} characters, expected "
            f"{2 * SECRET_BYTES}); delete it and run `drmas prepare` again"
        )
    return text.encode()


def proof(secret: bytes, client_id: str, model: str, rank: int) -> str:
    """What a learner's Hello carries: an HMAC of the seat it asks for."""
    seat = f"drmas-learner-seat\n{client_id}\n{model}\n{rank}".encode()
    return hmac.new(secret, seat, hashlib.sha256).hexdigest()


def proves(secret: bytes, given: str, client_id: str, model: str, rank: int) -> bool:
    return hmac.compare_digest(given.encode(), proof(secret, client_id, model, rank).encode())


def actor_proof(secret: bytes, client_id: str) -> str:
    """What an actor's Hello carries: an HMAC of the client id it says Hello as."""
    return hmac.new(secret, f"drmas-actor\n{client_id}".encode(), hashlib.sha256).hexdigest()


def actor_proves(secret: bytes, given: str, client_id: str) -> bool:
    return hmac.compare_digest(given.encode(), actor_proof(secret, client_id).encode())
