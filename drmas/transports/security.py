"""CURVE keys for the broker socket: where they live, how they are made and loaded.

Layout of a keys folder (written by `drmas keys DIR --clients a,b`; zmq certificate files):

    DIR/broker.key                 broker public key: every client needs it
    DIR/broker.key_secret          broker key pair (mode 600): only the broker's node
    DIR/clients/<name>.key_secret  a client's key pair (mode 600): copy to its node
    DIR/clients/<name>.key         the same client's public key
    DIR/authorized/<name>.key      public keys the broker accepts; nothing else gets in
    DIR/authorized/roles.json      {name: binding}: what each key may be (see BINDINGS);
                                   a key not listed there may be nothing, and a broker
                                   whose authorized/ has no roles.json refuses to start

So the broker's node needs broker.key_secret and authorized/; a client's node needs
broker.key and its own clients/<name>.key_secret. The broker reads authorized/ when it
binds: to admit a new client or revoke one, change authorized/ and restart the broker.

What CURVE covers, and what it does not: only the broker's ZeroMQ connections (actors,
learner ranks, `drmas status`). New weights travel from learner rank 0 to the actors over
torch.distributed groups (gloo or NCCL over plain TCP, drmas/transports/weights/), and
learner ranks talk to each other the same way: those connections are neither
authenticated nor encrypted. Keep the weight-group and learner networks
(`weights.host`, MASTER_ADDR/MASTER_PORT) private to the run's hosts: a firewall or a
private subnet.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from drmas.config.transport import SecurityConfig

log = logging.getLogger("drmas.transports.security")

DEFAULT_CLIENT = "default"
"""The client key pair used when security.client_name is empty."""
DEFAULT_KEYS_DIR = "keys"
"""security.keys_dir when empty, relative to the working directory."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

KEY_ROLES = {"actor": "actor", "learner": "learner", "observer": "client"}
"""Role given to a key at `drmas keys --clients NAME:ROLE` -> the Hello role it allows."""
ANY_ROLE = frozenset(KEY_ROLES.values())
ANY = "any"

BINDINGS = (
    "actor, observer (drmas status), learner (of any model), learner:M1+M2 (of those "
    "models only) or any (every role: one key shared by all of a run's processes)"
)
"""What a key may be bound to (`drmas keys --clients NAME:BINDING`, authorized/roles.json)."""

NAMED_ROLES = {
    "actor": "actor",
    "actors": "actor",
    "learner": "learner",
    "learners": "learner",
    "observer": "observer",
    "observers": "observer",
    "status": "observer",
    "ops": "observer",
}
"""A client named after a role is bound to it when `drmas keys` is given no binding
(`--clients actors,learners`); any other name without one gets `any`, written out."""


class SecurityError(ValueError):
    """Keys missing or unusable, or an insecure bind; the message says what to run."""


def keys_dir(security: SecurityConfig) -> Path:
    """The keys folder as an absolute path: security.keys_dir, or ./keys when empty."""
    return Path(security.keys_dir or DEFAULT_KEYS_DIR).expanduser().resolve()


def client_name(security: SecurityConfig) -> str:
    return security.client_name or DEFAULT_CLIENT


def _make_hint(root: Path) -> str:
    return (
        f"create keys with `drmas keys {root}` (security.keys_dir; empty means "
        f"./keys in the working directory)"
    )


# ---------------------------------------------------------------- writing keys
def write_keys(
    root: Path,
    clients: Sequence[str],
    *,
    force: bool = False,
    roles: dict[str, str] | None = None,
) -> list[Path]:
    """Write a broker key pair and one key pair per client; returns the files written.
    Every key is bound (authorized/roles.json): `roles` names a key's binding (name ->
    one of BINDINGS); a key without one gets its name's role (NAMED_ROLES), else `any`.

    Refuses (SecurityError) when any key already exists there, unless force: then the
    whole key set is replaced and every key issued before stops working (old client
    keys are removed from authorized/ too, so a leaked old key cannot get back in).
    """
    names = _client_names(clients)
    existing = _existing_keys(root, force)
    roles = bindings(names, roles or {})
    for p in [*existing, root / "authorized" / "roles.json"]:
        p.unlink(missing_ok=True)
    (root / "clients").mkdir(parents=True, exist_ok=True)
    (root / "authorized").mkdir(exist_ok=True)
    written = _make_pairs(root, names)
    (root / "authorized" / "roles.json").write_text(json.dumps(roles, indent=2) + "\n")
    written.append(root / "authorized" / "roles.json")
    return written


def _client_names(clients: Sequence[str]) -> list[str]:
    """The client names, duplicates dropped, each checked to be a plain file name."""
    names = list(dict.fromkeys(clients))
    if not names:
        raise SecurityError("drmas keys: give at least one client name (--clients a,b)")
    for name in names:
        if not _NAME.fullmatch(name):
            raise SecurityError(
                f"drmas keys: client name {name!r} must be letters, digits, '_', '.', '-' "
                "(up to 64, starting with a letter or digit)"
            )
    return names


def _existing_keys(root: Path, force: bool) -> list[Path]:
    """Key files already under `root`; refuses to go on when there are any, unless force."""
    candidates = [
        root / "broker.key",
        root / "broker.key_secret",
        *(root / "clients").glob("*.key*"),
        *(root / "authorized").glob("*.key"),
    ]
    existing = sorted(p for p in candidates if p.exists())
    if existing and not force:
        shown = ", ".join(str(p) for p in existing[:4]) + (" ..." if len(existing) > 4 else "")
        raise SecurityError(
            f"drmas keys: {root} already holds keys ({shown}); refusing to overwrite. "
            "Pass --force to replace the whole key set (every issued key stops working)."
        )
    return existing


def bindings(names: list[str], roles: dict[str, str]) -> dict[str, str]:
    """Every name's binding: its own from `roles` (checked), else its name's role, else any."""
    for name, binding in roles.items():
        if name not in names:
            raise SecurityError(f"drmas keys: a binding for {name!r}, which is not a listed client")
        grants(binding, f"drmas keys: {name}:{binding}")
    return {n: roles.get(n) or NAMED_ROLES.get(n, ANY) for n in names}


def grants(binding: str, where: str) -> frozenset[str]:
    """The Hello roles a binding allows, as the broker's gate checks them: "actor",
    "learner", "client", or "learner:<model>" for a learner of that model only."""
    if binding == ANY:
        return ANY_ROLE
    role, colon, models = binding.partition(":")
    named = models.split("+") if colon else []
    ok = role in KEY_ROLES and (role == "learner" or not colon)
    if not ok or not all(_NAME.fullmatch(m) for m in named):
        raise SecurityError(f"{where}: {binding!r} is not a binding; use one of {BINDINGS}")
    if named:
        return frozenset(f"learner:{m}" for m in named)
    return frozenset({KEY_ROLES[role]})


def _make_pairs(root: Path, names: list[str]) -> list[Path]:
    """The broker's and every client's key pair, moved into place; clients' public keys
    are copied to authorized/. Keys are made in a private (0700) staging folder and
    chmod-ed before they are moved in, so a secret key is never readable by others, not
    even for a moment."""
    written = []
    with tempfile.TemporaryDirectory(dir=root, prefix=".staging-") as tmp:
        staging = Path(tmp)
        for name, dest in [("broker", root)] + [(n, root / "clients") for n in names]:
            public, secret = (Path(f) for f in zmq.auth.create_certificates(staging, name))
            secret.chmod(0o600)
            public.chmod(0o644)
            os.replace(secret, dest / secret.name)
            os.replace(public, dest / public.name)
            written += [dest / public.name, dest / secret.name]
            if dest != root:  # a public key: nothing secret is copied
                shutil.copyfile(dest / public.name, root / "authorized" / public.name)
                written.append(root / "authorized" / public.name)
    return written


def key_roles(root: Path) -> dict[str, frozenset[str]]:
    """z85 public key of every authorized client -> what it may do (`grants` of its binding
    in authorized/roles.json; nothing when it has none). The broker reads the key of each
    message from its ZAP User-Id and checks it against the sender's role and, for a
    learner, its model. Without roles.json every key once took any role, so a broker now
    refuses to start (SecurityError saying what to run)."""
    folder = root / "authorized"
    path = folder / "roles.json"
    if not path.is_file():
        raise SecurityError(
            f"security.curve=true but {path} does not exist: every key must be bound to what "
            f"it may do ({BINDINGS}). Write the key set again with `drmas keys {root} --clients "
            "NAME[:BINDING],... --force` (names such as actors, learners bind themselves), or "
            'write roles.json as {"NAME": "BINDING"} for each key in authorized/'
        )
    try:
        named = json.loads(path.read_text())
    except ValueError as exc:
        raise SecurityError(f"{path} is not JSON ({exc}); rewrite it with `drmas keys`") from None
    if not isinstance(named, dict) or not all(isinstance(v, str) for v in named.values()):
        raise SecurityError(f'{path} must map each key name to a binding: {{"NAME": "BINDING"}}')
    out: dict[str, frozenset[str]] = {}
    for cert in sorted(folder.glob("*.key")):
        public, _ = zmq.auth.load_certificate(cert)
        binding = named.get(cert.name.removesuffix(".key"))
        unbound = frozenset[str]()
        out[public.decode("ascii")] = grants(binding, str(path)) if binding else unbound
    return out


# ------------------------------------------------------------- bind addresses
def is_loopback(address: str) -> bool:
    """True when only this host can reach `address`: 127.0.0.0/8, ::1, localhost, ipc://,
    inproc://. Anything else (a LAN address, 0.0.0.0, *, an interface name) is not."""
    transport, _, rest = address.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp" or not rest:
        return False
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: may be reachable from outside


def check_bind(address: str, security: SecurityConfig) -> None:
    """Refuse a broker bind that anyone on the network could read and inject into."""
    if security.curve or is_loopback(address):
        return
    if not security.allow_insecure:
        raise SecurityError(
            f"refusing to bind the broker to {address} without authentication: anyone who "
            "can reach that port could read rollouts and inject messages. Either turn on "
            f"CURVE (security.curve=true; {_make_hint(keys_dir(security))}), bind to "
            "127.0.0.1, or, only on a network where every host is trusted, set "
            "security.allow_insecure=true"
        )
    log.warning(
        "broker bound to %s WITHOUT authentication or encryption (security.allow_insecure="
        "true): any host that can reach this port can read and inject messages",
        address,
    )


# ------------------------------------------------------------- loading keys
def _load(path: Path, root: Path, *, secret: bool) -> bytes:
    """The public (or secret) key in one certificate file; SecurityError naming it if not."""
    if not path.is_file():
        raise SecurityError(f"security.curve=true but {path} does not exist; {_make_hint(root)}")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(
            f"{path} is not a zmq certificate ({exc}); {_make_hint(root)}"
        ) from None
    if secret:
        if secret_key is None:
            raise SecurityError(f"{path} holds no secret key; {_make_hint(root)}")
        return secret_key
    return public


def client_names(root: Path) -> list[str]:
    """Names of the client key pairs in root/clients, sorted."""
    return sorted(
        p.name.removesuffix(".key_secret") for p in (root / "clients").glob("*.key_secret")
    )


def _client_pair(root: Path, name: str) -> tuple[bytes, bytes]:
    """(public, secret) of clients/<name>; the error lists the pairs that do exist."""
    path = root / "clients" / f"{name}.key_secret"
    if not path.is_file() and (others := client_names(root)):
        raise SecurityError(
            f"security.curve=true but {path} does not exist; {root / 'clients'} holds "
            f"{', '.join(others)}: set security.client_name to one of them, or make a new key "
            f"set with `drmas keys {root} --clients {','.join([*others, name])} --force`"
        )
    return _load(path, root, secret=False), _load(path, root, secret=True)


def authorized_keys(root: Path) -> dict[bytes, bool]:
    """The client public keys the broker accepts (authorized/*.key); never empty."""
    folder = root / "authorized"
    keys = zmq.auth.load_certificates(folder) if folder.is_dir() else {}
    if not keys:
        raise SecurityError(
            f"security.curve=true but {folder} holds no client public keys (*.key), so no "
            f"client could connect; {_make_hint(root)}"
        )
    return keys


def check_keys(security: SecurityConfig) -> None:
    """Load the keys a run needs now, so it fails before it starts anything: the broker's
    pair, authorized/ and, when security.client_name is set, that client's pair (left
    empty it may be set per node at launch, so the default pair is not required here)."""
    if not security.curve:
        return
    root = keys_dir(security)
    _load(root / "broker.key_secret", root, secret=True)
    _load(root / "broker.key", root, secret=False)
    authorized_keys(root)
    key_roles(root)
    if security.client_name:
        _client_pair(root, security.client_name)


def find_client(root: Path) -> str:
    """For `drmas status --keys` without --client: "default" if there, else the first pair."""
    names = client_names(root)
    return DEFAULT_CLIENT if DEFAULT_CLIENT in names or not names else names[0]


def secure_server(
    ctx: zmq.Context, sock: zmq.Socket, security: SecurityConfig
) -> Callable[[], None]:
    """Make `sock` (not yet bound) a CURVE server that admits only keys in authorized/.

    Starts a ZAP handler (ThreadAuthenticator) for `ctx`: libzmq asks it about every
    handshake and drops the connection of any key not listed. Without a running handler
    a CURVE server would admit every key, so this must happen before bind. Returns the
    function that stops the handler; call it after closing the socket and before
    ctx.term() (a running handler keeps the context from terminating). One per context.
    """
    root = keys_dir(security)
    secret = _load(root / "broker.key_secret", root, secret=True)
    public = _load(root / "broker.key", root, secret=False)
    allowed = authorized_keys(root)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("drmas.transports.zap"))
    try:
        auth.start()
    except zmq.ZMQError as exc:
        raise SecurityError(
            f"could not start the ZAP handler ({exc}): only one CURVE broker per zmq.Context"
        ) from None
    auth.configure_curve(domain="*", location=str(root / "authorized"))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    log.info("CURVE on: %d authorized client key(s) from %s", len(allowed), root / "authorized")
    return auth.stop


def secure_client(sock: zmq.Socket, security: SecurityConfig) -> None:
    """Make `sock` (not yet connected) a CURVE client with its key pair from clients/."""
    root = keys_dir(security)
    public, secret = _client_pair(root, client_name(security))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = _load(root / "broker.key", root, secret=False)
