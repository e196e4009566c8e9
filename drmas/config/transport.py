"""Weight-sync settings (learner rank 0 -> actors). Plain dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from drmas.config.types import PositiveFloat, Seconds, WeightsBackend


@dataclass
class WeightSyncConfig:
    """How new weights reach the actors."""

    bucket_mb: PositiveFloat = 8.0
    """Parameters are flattened into buckets of about this many MiB per broadcast."""
    timeout_s: Seconds = 60.0
    """Every rendezvous and broadcast of the weight group times out after this."""
    join_timeout_s: Seconds = 5.0
    """How long learner rank 0 waits for a publish's members to check in (each proves the
    group's token through the weight store) before it sends to those that did: a member
    that is late, said Goodbye or never comes is left out of that publish and gets the
    version at a later one, so one such actor costs a publish at most this long."""
    backend: WeightsBackend = "auto"
    """auto: nccl when the learner is on CUDA, else gloo."""
    host: str = "127.0.0.1"
    """Address the learner's weight-group store binds and advertises to actors; "auto" =
    this node's address on the route to the broker (multi-node deployments)."""
    verify_digest: bool = True
    """Fingerprint weights on both sides of every publish: each receiver checks the sender's
    digest before the weights go live (a mismatch rolls back or quarantines), and the broker
    compares what every engine reports it holds. false: neither check."""


@dataclass
class SecurityConfig:
    """Authentication and encryption of the broker's ZeroMQ socket (docs/security.md).

    Covers broker <-> actor/learner/status traffic only; the weight and learner groups
    (gloo/NCCL over TCP) are not covered: keep them on a private network.
    """

    curve: bool = False
    """ZeroMQ CURVE: encrypt every broker connection and admit only keys in authorized/."""
    keys_dir: str = ""
    """Folder written by `drmas keys DIR`: broker.key(_secret), clients/<name>.key(_secret),
    authorized/ (public keys the broker accepts; roles.json binds each to what it may do).
    Empty = ./keys in the working directory; `drmas train`/`prepare` write it as an
    absolute path into RUN_DIR/config.yaml."""
    client_name: str = ""
    """Which client key pair this process uses (clients/<name>.key_secret); empty = "default"."""
    allow_insecure: bool = False
    """Bind the broker to a non-loopback address without CURVE (warns). Only on networks
    where every host is trusted: anyone who can reach the port can read and inject."""
    learner_secret: str = ""
    """File holding the run's learner secret: a learner's Hello carries an HMAC of its
    seat under it, and the broker seats no learner rank without one, so no other client
    can take (or take back) a learner seat. `drmas train` and `drmas prepare` write it as
    RUN_DIR/learner.secret (mode 600) and put its path here; copy it to the learner nodes
    only, never to actor nodes. Empty = learner seats are open to any client that says
    Hello first (the broker warns)."""
    actor_secret: str = ""
    """File holding the run's actor secret: an actor's Hello carries an HMAC of its client
    id under it, and the broker welcomes no actor without one, so a client that holds
    neither secret cannot act as an actor at all. `drmas train` and `drmas prepare` write
    it as RUN_DIR/actor.secret (mode 600); copy it to the actor nodes (an actor attached
    later with --config RUN_DIR/config.yaml reads it from there). Empty = any client may
    say Hello as an actor (the broker warns)."""
