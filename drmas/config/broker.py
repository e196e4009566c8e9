"""Broker and advantage settings. Plain dataclasses: importing this loads no torch."""

from __future__ import annotations

from dataclasses import dataclass

from drmas.config.types import (
    AdvantageMode,
    NonNegative,
    NonNegativeFloat,
    Positive,
    Scope,
    Seconds,
    StdKind,
    StdPool,
)


@dataclass
class AdvantageConfig:
    """How step scores become advantages (docs/algorithm.md)."""

    mode: AdvantageMode = "agent"
    """agent = Dr. MAS (default); global = vanilla GRPO; step_global = one baseline over all
    steps; agent_turn = per agent and turn; agent_mean/agent_std = ablations against
    global's statistics; agent_centred/agent_shifted = step_global without its offset /
    without its rescaling (docs/algorithm.md)."""
    norm_by_std: bool = True
    """False: x - mean only (Dr. GRPO style)."""
    eps: NonNegativeFloat = 1e-6
    """Added to the standard deviation."""
    std: StdKind = "unbiased"
    """unbiased (n-1, reference code) or population (n, paper)."""
    scope: Scope = "group"
    """group: statistics per prompt group; batch: pooled over the whole groups (every
    agent's steps) of the model's training batch (one model only: refused otherwise)."""
    agent_std_pool: StdPool = "group"
    """agent modes: an agent's sigma from its steps in the group (group, Dr. MAS as
    written), or from its group-centred scores pooled over the batch's groups (batch: the
    per-group mean is kept; steadier for an agent with few steps per group): modes agent
    and agent_std with norm_by_std only (refused otherwise). The batch is that of the
    agent's model, so with several models it pools over its own model's groups."""
    std_floor: NonNegativeFloat = 0.0
    """A floor under every sigma, on the reward scale (0 = none): a difference smaller
    than it (e.g. only the invalid-action penalty) is not blown up to unit size."""
    balance_calls: bool = False
    """Weight each sample's policy-gradient loss by 1/n, n = its agent's calls in its group
    (all G episodes), normalised to mean 1 over the model's batch: an agent called three
    times per episode then weighs as much per group as one called once (the reference
    code's balance_loss_by_agent_freq; it normalises over the whole team's batch, drmas
    over each model's). Entropy and KL terms are not weighted."""


@dataclass
class BrokerConfig:
    """The coordinator: task source, leases, buffers, batches, versions."""

    address: str = "tcp://127.0.0.1:0"
    """ROUTER endpoint. Port 0 picks a free port (drmas train only). Default bind is loopback."""
    lease_timeout_s: Seconds = 600.0
    """A lease not returned after this long goes back to the queue."""
    heartbeat_interval_s: Seconds = 1.0
    """How often clients send a Heartbeat."""
    heartbeat_timeout_s: Seconds = 15.0
    """A client silent this long is dead: its leases are re-issued."""
    learner_timeout_s: Seconds = 600.0
    """A learner rank silent this long is dropped (it heartbeats between micro-batches;
    a weight-group rendezvous can block it for weights.timeout_s)."""
    learner_rejoin_s: Seconds = 60.0
    """A learner rank that leaves before its model's last step (a Goodbye, e.g. its Slurm
    job cancelled, or learner_timeout_s of silence) may take its seat back within this
    long (a restart says Hello under its own id); otherwise the broker stops the run,
    naming the rank and why it left, and exits non-zero: the other learners save a
    checkpoint, and `run.resume=RUN_DIR` continues the run."""
    stop_grace_s: Seconds = 60.0
    """Stopped by SIGTERM/SIGINT, the broker tells every client Shutdown, then waits this
    long at most for the learners to save and say Goodbye (a second signal: at once)."""
    max_actors: Positive = 1024
    """Actors registered at once; a Hello beyond it is refused."""
    max_leases_per_actor: NonNegative = 0
    """Leases (training and validation together) one actor may hold at once; 0 = the run's
    actor.max_groups, what an actor of this config asks for at most. A misbehaving actor
    cannot take every task of a batch or a validation round. Raise it for actors started
    with a larger actor.max_groups."""
    max_connections_per_host: Positive = 256
    """Open connections one peer host may hold; more are closed as they arrive (every
    actor, learner rank and `drmas status` of a host holds one). Every loopback address
    (127.0.0.0/8, ::1) is one host."""
    max_connections: Positive = 4096
    """Open connections in all, whatever their hosts; more are closed as they arrive."""
    max_unwelcomed_connections: Positive = 64
    """Open connections that have not said Hello (and observers) at once: each may make
    ZeroMQ hold about 1.5 MB before its Hello. Beyond it a new connection closes the
    oldest of them silent for over a second, or is closed itself (its client reconnects)."""
    max_connections_per_key: Positive = 1024
    """With CURVE: connections one client key may hold (all actors may share one key);
    a key that may only observe holds at most 8."""
    max_message_bytes: Positive = 256 * 1024 * 1024
    """Ceiling of an actor's GroupResult, the one large message; ZeroMQ drops a larger
    frame before it is read. The broker lowers it to the largest group the run can make
    (group_size x steps per episode x tokens)."""
    max_control_bytes: Positive = 1024 * 1024
    """Largest frame of a registered actor or learner other than a GroupResult; a larger
    one is refused (`too_large`) before decoding."""
    max_hello_bytes: Positive = 16 * 1024
    """Largest frame before a Hello, and from an observer (a Hello or a StatusRequest)."""
    max_held_bytes: Positive = 48 * 1024 * 1024
    """What all connections together may make ZeroMQ hold for messages the broker has not
    read yet, counted at the worst case: 32 bytes per unread byte without CURVE, 2 with.
    Over it, while the broker's memory also grew past it, the connections holding the most
    (never a learner's) are shut (`dropped/memory_budget`; they may reconnect). A flood
    peaks at about this plus what libzmq assembles before the shut takes effect (+40 to
    +60 MB on 2 cores), so the 48 MiB default keeps it under 128 MB (64 MiB reached
    +122 to +131 MB). Raise it if honest actors send groups larger than this / 32 at once
    (CURVE: / 2), or together more than this while the broker is slow to read them."""
    max_peer_bytes_per_s: Positive = 64 * 1024 * 1024
    """Bytes per second one peer may send, sustained (bursts up to twice its largest
    frame, or two seconds of it); beyond it frames are refused (`over_budget`) before
    decoding."""
