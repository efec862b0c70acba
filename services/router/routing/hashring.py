"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

New sessions land where their key hashes on a ring of pods, so every router
replica places a session alike without talking to the others; a pod already
carrying more than ``bound_factor`` times the average load is passed over for
the next one clockwise, so affinity never piles sessions onto a hot pod.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=64)
def _ring(pods: tuple[str, ...], vnodes: int) -> tuple[list[int], list[str]]:
    points = sorted((_point(f"{pod}#{i}"), pod) for pod in pods for i in range(vnodes))
    return [p for p, _ in points], [pod for _, pod in points]


def ring_home(key: str, pods: Sequence[str], vnodes: int = 64) -> str:
    """The pod ``key`` hashes to on the ring, whatever the loads."""
    if not pods:
        raise ValueError("no pods to hash onto")
    points, owners = _ring(tuple(sorted(pods)), vnodes)
    return owners[bisect.bisect(points, _point(key)) % len(points)]


def bounded_load_choice(
    key: str,
    pods: Sequence[str],
    loads: Mapping[str, float],
    bound_factor: float = 1.25,
    vnodes: int = 64,
) -> tuple[str, bool]:
    """The pod for ``key``; second item True when its home pod was over the bound.

    The bound is ``bound_factor`` times the average load counting the request
    being placed, but never below that average rounded up (so the least loaded
    pod always fits). The bound itself is not rounded up: with few sessions
    that would let a pod take twice its share (loads 1 and 0 would give a
    bound of 2, so a second new session would join the first, and router
    replicas placing a burst of new sessions would pile them on one home).
    """
    if not pods:
        raise ValueError("no pods to hash onto")
    points, owners = _ring(tuple(sorted(pods)), vnodes)
    total = sum(max(0.0, loads.get(p, 0.0)) for p in pods)
    average = (total + 1) / len(pods)
    bound = max(math.ceil(average), bound_factor * average)
    start = bisect.bisect(points, _point(key)) % len(points)
    seen: set[str] = set()
    home = None
    for step in range(len(points)):
        pod = owners[(start + step) % len(points)]
        if pod in seen:
            continue
        seen.add(pod)
        home = home or pod
        if loads.get(pod, 0.0) + 1 <= bound:
            return pod, pod != home
        if len(seen) == len(pods):
            break
    return min(pods, key=lambda p: loads.get(p, 0.0)), True
