"""A member of a gloo weight group that sends what it should not cannot end another
member's process (round four: one bogus gloo operation aborted the actors downstream).

gloo's own broadcast forwards along a tree: with four ranks, rank 1 passes what it got
from rank 0 on to rank 3. A member that forwards more bytes than rank 3 posted for makes
gloo abort rank 3 (SIGABRT from an enforce in gloo's I/O thread; no exception reaches
Python). `Group` therefore sends over gloo from rank 0 to each member in turn, and members
receive from rank 0 only.

Real processes: this test's process is rank 0 (a `Group`, as WeightSender uses it), ranks 2
and 3 are honest members in child processes (a `Group` each, as WeightReceiver uses it),
and rank 1 is the bad member, also a child, built from the same store with gloo's own
calls. It tries both: a tree broadcast of a 400 kB tensor (forwarded to rank 3 by gloo's
own broadcast) and, beside an honest receive, the 400 kB tensor sent to every other rank
under the tags rank 0 uses.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist

from drmas.transports.weights.group import Group, Where

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]  # the children import tests.fixtures
SENDS = 3  # "broadcasts" rank 0 makes
TIMEOUT_S = 60.0  # a bound, never reached when the test passes

MEMBER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from drmas.transports.weights.group import Group, Where
    from tests.fixtures.ranks import leave
    port, rank = int(sys.argv[1]), int(sys.argv[2])
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    group = Group(Where("g", rank, 4, {timeout}, "rank 0"), dist.PrefixStore("g", client),
                  "gloo", torch.device("cpu"))
    for i in range({sends}):
        x = torch.zeros(1000)
        group.broadcast(x, f"tensor {{i}}")
        print(i, float(x.sum()), flush=True)
    group.close(ok=True)
    leave()
    """
).format(timeout=TIMEOUT_S, sends=SENDS)

BAD = textwrap.dedent(
    """
    import datetime, sys, threading, torch, torch.distributed as dist
    from tests.fixtures.ranks import leave
    port = int(sys.argv[1])
    timeout = datetime.timedelta(seconds={timeout})
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("g", client), 1, 4, timeout)
    big = torch.ones(100_000)

    def tree() -> None:  # gloo's broadcast: what rank 1 gets it forwards, 400 kB of it
        try:
            pg.broadcast([big.clone()], dist.BroadcastOptions()).wait(
                datetime.timedelta(seconds=5))
        except RuntimeError:
            pass  # nothing came by the tree: rank 0 sends to each member instead

    threading.Thread(target=tree, daemon=True).start()
    for tag in range({sends}):
        for rank in (0, 2, 3):
            pg.send([big], rank, tag)  # under the tag rank 0 uses; never waited for
        pg.recv([torch.zeros(1000)], 0, tag).wait(timeout)
        print("bad", tag, flush=True)
    sys.stdin.read()  # stay connected until the test is done
    leave()
    """
).format(timeout=TIMEOUT_S, sends=SENDS)


def test_a_member_sending_more_than_was_posted_cannot_end_another_members_process() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    prefix = dist.PrefixStore("g", store)
    python = [sys.executable, "-c"]
    members = {
        rank: subprocess.Popen(
            [*python, MEMBER, str(store.port), str(rank)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for rank in (2, 3)
    }
    bad = subprocess.Popen(
        [*python, BAD, str(store.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        group = Group(Where("g", 0, 4, TIMEOUT_S, "ranks 1-3"), prefix, "gloo", CPU)
        for i in range(SENDS):
            group.broadcast(torch.full((1000,), float(i + 1)), f"tensor {i}")
        outputs = {rank: p.communicate(timeout=TIMEOUT_S)[0] for rank, p in members.items()}
        for rank, p in members.items():
            assert p.returncode == 0, f"member {rank} ended with {p.returncode}: {outputs[rank]!r}"
            # every tensor arrived whole, from rank 0: 1000 × (i + 1)
            assert outputs[rank].split() == [
                word for i in range(SENDS) for word in (str(i), str(1000.0 * (i + 1)))
            ]
        group.close(ok=True)
    finally:
        for p in (*members.values(), bad):
            if p.poll() is None:
                p.kill()
            p.wait(TIMEOUT_S)
