"""Free ports for services started on this machine."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_handed_out: set[int] = set()
_LOWEST_PORT = 10_000


def free_port() -> int:
    """A port nothing listens on, chosen below the OS's ephemeral range.

    Ports the OS assigns by itself (bind to port 0, as vLLM does for its
    internal ZMQ sockets; the source ports of outgoing connections) come from
    the ephemeral range, so a port picked there can be taken between choosing
    it and the service binding it: CI saw an engine's KV-event socket fail
    with "Address already in use". Below that range only explicit choices
    compete, and this process never hands out a port twice.
    """
    low = _ephemeral_range()[0]
    if low - _LOWEST_PORT < 1000:  # an unusual range: take what the OS gives
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(1000):
        port = random.randrange(_LOWEST_PORT, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))  # all interfaces: services bind tcp://*:PORT
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_LOWEST_PORT}-{low - 1}")


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (free_port never hands one out twice)."""
    return [free_port() for _ in range(n)]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
