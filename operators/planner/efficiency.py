"""Phase 2: how a live pool compares with its profile, measured not fudged.

At the load a pool runs (mean requests in flight per replica, the profile's
load axis) the profile predicts a throughput; the pool delivers another. Their
ratio is the pool's efficiency: below 1 the live pool is slower than profiled
(other traffic shapes, interference, a worse hit rate inside the engine),
above 1 faster. The solver multiplies the profile's rates by it and divides
its latencies by it (at equal load, time per request scales as 1 / rate).

Throughput is read in the unit that stays put when request shapes move: a
prefill pool's uncached prompt tokens per second, a decode pool's output
tokens per second, an aggregated pool's requests per second weighted by their
cost (uncached × k + output, with k the prefill token's cost in decode tokens
when known). Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from .profiles import EngineProfile, PoolRole, ProfilePoint


@dataclass(frozen=True)
class PoolMeasurement:
    """What one pool did over the last window, per ready replica."""

    role: PoolRole
    requests: int  # finished in the window (how much to trust the rest)
    in_flight: float  # mean requests in the pool per replica
    request_rate: float
    uncached_tokens_per_s: float
    output_tokens_per_s: float


def _work(
    role: PoolRole,
    request_rate: float,
    uncached_tokens_per_s: float,
    output_tokens_per_s: float,
    token_cost: float | None,
) -> float:
    if role == "prefill":
        return uncached_tokens_per_s
    if role == "decode":
        return output_tokens_per_s
    if token_cost is None:
        return request_rate
    return uncached_tokens_per_s * token_cost + output_tokens_per_s


def _point_work(role: PoolRole, p: ProfilePoint, token_cost: float | None) -> float:
    return _work(role, p.request_rate, p.uncached_tokens_per_s, p.output_tokens_per_s, token_cost)


def predicted_work(
    profile: EngineProfile, in_flight: float, token_cost: float | None = None
) -> float:
    """The profile's throughput at this load: linear between profiled points
    (and from zero at no load), the highest profiled value beyond them; 0
    when the profile gives no load (published figures without it)."""
    role = profile.role
    curve = sorted(
        (p.in_flight, _point_work(role, p, token_cost))
        for p in profile.points
        if p.in_flight is not None
    )
    if not curve:
        return 0.0
    prev_x, prev_y = 0.0, 0.0
    for x, y in curve:
        if in_flight <= x:
            t = (in_flight - prev_x) / (x - prev_x) if x > prev_x else 1.0
            return prev_y + (y - prev_y) * t
        prev_x, prev_y = x, y
    return max(y for _, y in curve)


def measure_efficiency(
    profile: EngineProfile, m: PoolMeasurement, token_cost: float | None = None
) -> float | None:
    """Measured ÷ profiled throughput at the measured load; None when the
    pool did nothing to compare."""
    if m.in_flight <= 0:
        return None
    expected = predicted_work(profile, m.in_flight, token_cost)
    measured = _work(
        m.role, m.request_rate, m.uncached_tokens_per_s, m.output_tokens_per_s, token_cost
    )
    if expected <= 0 or measured <= 0:
        return None
    return measured / expected
