"""Free TCP ports on loopback for drmas train, for a process that binds them seconds later
(a learner group's MASTER_PORT: the learner imports torch first).

The port is drawn at random from below the kernel's ephemeral range
(net.ipv4.ip_local_port_range), so no port-0 bind and no outgoing connection of any
process can be handed the same port in the meantime; only another explicit chooser
could, which is unlikely and fails loudly at bind. Falls back to a kernel-chosen port.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000
"""Ports below this are left alone (well-known and registered services)."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port-0 binds and outgoing connections (Linux default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    low, _ = ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(attempts if low - LOWEST > 100 else 0):
        port = rng.randrange(LOWEST, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
