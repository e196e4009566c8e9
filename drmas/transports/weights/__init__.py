"""New weights from learner rank 0 to the actors serving a model, over torch.distributed.

    layout.py    the header and the bucket layout both sides derive from it
    group.py     the weight store, the process group (rendezvous, broadcasts, teardown)
    membership.py  who may be in a group: roll call, signed rendezvous, token proofs
    sender.py    learner rank 0 publishes (WeightSender)
    receiver.py  actors load (WeightReceiver)

A *weight group* per membership: learner rank 0 is rank 0, the actors of the broker's
WeightGroupPlan are ranks 1..n. The group is built directly from a `TCPStore` that learner
rank 0 hosts for the whole run (bound on `WeightSyncConfig.host`, free port), namespaced
by `PrefixStore(group_name)`, so it never touches the learners' own default group.

The group persists across versions: the broker names a publish's group after its
membership (drmas/broker/publishing.py), and while the name (and, on the actor side, the
store and rank) stays the same, sender and receivers broadcast the next version over the
group they already hold, with no rendezvous and no teardown. A new name (an actor
attached, detached or failed, a re-publish to a subset, a restarted learner) retires the
old group: it is aborted (never waits for a peer) by `release()`, off the sync's path,
since gloo's teardown holds the GIL for ~20 ms. A failed publish aborts its group at
once, so the next one forms a fresh group. A dead or late peer never leaves a hung group.

Protocol inside a group (broadcasts from rank 0, but for step 0's all-gather):

    store  "<group>/backend" = "gloo" | "nccl"   (set before the rendezvous)
    0. token proof        (when the plan has a token) nonce uint8 [16] from rank 0, then
                          an all-gather of each rank's HMAC of it under the group's token
    1. header length      int64 [1]
    2. header             uint8 [length]  msgpack Header: bucket_bytes + (name, shape, dtype)
    3. bucket 0 .. n-1    one flat tensor of a single dtype each, in `plan_buckets` order
    4. digest             (when the header says so) uint8 [32], of every byte sent

Every wait (store connect, rendezvous, each broadcast) has the group's timeout; running
out raises WeightSyncTimeout naming the group, the phase and the peers.

Exposure: the store listens only on `weights.host` (rank 0 binds the socket itself and
hands it to torch, which would otherwise listen on every interface); anyone who reaches it
can read and write its keys, so weights.host should be an address only the actors reach.
gloo's own pair sockets listen on the interface it picks from the host name (set
GLOO_SOCKET_IFNAME to pin it); docs/security.md has the firewall recipe. A peer that
reaches the store still gets no weights: the broker hands each group's token to its
members only, and rank 0 sends nothing until every rank proved it (step 0). A receiver
takes at most MAX_HEADER_BYTES of header, refuses one that does not cover exactly what
its engine holds (`Expected`), allocates no more than the header's tensors add up to, and
refuses bytes whose digest differs from rank 0's before they go live.
"""

from drmas.transports.weights.group import advertised_host, resolve_backend
from drmas.transports.weights.layout import (
    MAX_BUCKET_BYTES,
    MAX_HEADER_BYTES,
    Bucket,
    Expected,
    Header,
    NamedTensors,
    TensorSpec,
    WeightSyncError,
    WeightSyncTimeout,
    check_covers,
    decode_header,
    plan_buckets,
    spec_of,
)
from drmas.transports.weights.receiver import ReceiveStats, WeightReceiver
from drmas.transports.weights.sender import PublishStats, WeightSender

__all__ = [
    "MAX_BUCKET_BYTES",
    "MAX_HEADER_BYTES",
    "Bucket",
    "Expected",
    "Header",
    "NamedTensors",
    "PublishStats",
    "ReceiveStats",
    "TensorSpec",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncTimeout",
    "advertised_host",
    "check_covers",
    "decode_header",
    "plan_buckets",
    "resolve_backend",
    "spec_of",
]
