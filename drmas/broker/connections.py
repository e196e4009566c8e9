"""A cap on the broker's open connections per peer host.

libzmq accepts every TCP connection to the ROUTER and keeps each one (its buffers, ~25 KB)
until the peer closes it; it has no per-peer limit. The broker loop (server.py) owns one
ConnectionCap: it watches the ROUTER's monitor socket, counts accepted connections per
peer address, and shuts down (SHUT_RDWR on a duplicate of the file descriptor libzmq
reports) each connection beyond `max_per_host`. libzmq then sees the peer gone and
closes its side cleanly, so no file descriptor is ever closed under libzmq's feet.
Connections not over TCP (ipc://, inproc://) have no peer host and are not counted.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("drmas.broker")

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


class ConnectionCap:
    def __init__(self, router: zmq.Socket, max_per_host: int) -> None:
        self.max_per_host = max_per_host
        self.monitor = router.get_monitor_socket(_EVENTS)
        self.open: dict[int, str] = {}  # fd -> peer host
        self.per_host: collections.Counter[str] = collections.Counter()
        self.refused = 0

    def poll(self) -> None:
        """Handle the monitor events waiting now (non-blocking)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            else:  # disconnected or closed
                host = self.open.pop(fd, None)
                if host is not None:
                    self.per_host[host] -= 1
                    if self.per_host[host] <= 0:
                        del self.per_host[host]

    def _accepted(self, fd: int) -> None:
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            return  # already gone
        with dup:
            try:
                host = str(dup.getpeername()[0])
            except (OSError, IndexError, TypeError):
                return  # not a TCP peer
            if self.per_host[host] >= self.max_per_host:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.warning(
                        "%s holds %d connections (broker.max_connections_per_host): closing "
                        "new ones (%d so far)", host, self.per_host[host], self.refused,
                    )  # fmt: skip
                with contextlib.suppress(OSError):
                    dup.shutdown(socket.SHUT_RDWR)
                return
        self.open[fd] = host
        self.per_host[host] += 1

    def close(self) -> None:
        self.monitor.close(linger=0)
