"""Session KV prefetch: which idle sessions to warm where, between turns.

Between an agent's turns (tool calls, thinking) its KV may stop being where
its next turn will be served: the pod it ran on evicts it under KV pressure
(the prefix index sees the engine's removal events), or the next turn will go
to another pod (the cost policy moves it: the bound pod is overloaded, its KV
is full of other live sessions, or it is draining). A prefetch is a load-only
request on the pod the next turn would go to: the session's last prompt with
one output token, discarded, so the engine pulls the prefix from the shared
KV store (or computes it, without one) into its cache during the gap instead
of during the next turn's time to first token.

This module decides; ``services/router/prefetch.py`` runs the requests. A
candidate is an idle live session with the pod its next turn would go to
(``RoutingCore.next_turn``, the policy asked without holding anything) and
the prefix the index predicts there. It is warmed when at least
``prefetch_min_tokens`` of its prompt are missing there and the pod has room
for them without evicting what other live sessions need there (``live.py``:
warming one session must not push out another's KV), on a pod that is
available, has no real request queued (engine ``waiting`` and this router's
pending prefill tokens both zero) and fewer than ``prefetch_max_in_flight``
prefetches running. Sessions missing most go first. The runner cancels a
prefetch when the session's next turn arrives before it finishes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from common.settings import SettingError, flag_of, setting


@dataclass(frozen=True)
class PrefetchSettings:
    session_prefetch: bool = setting(
        False,
        "between a session's turns, warm its prefix on the pod its next turn will go "
        "to when that pod lacks it (evicted under KV pressure, or the session moves): a "
        "load-only request (one discarded token) at the lowest priority, only on pods with "
        "no queued request, cancelled when the next turn comes first (true/false)",
        metavar="BOOL",
    )
    prefetch_max_in_flight: int = setting(
        1, "--session-prefetch: most prefetches running on one pod", metavar="N"
    )
    prefetch_min_tokens: int = setting(
        256,
        "--session-prefetch: warm only when at least "
        "this many of the session's prompt tokens are "
        "missing on the target pod",
        metavar="TOKENS",
    )

    def validate(self) -> None:
        if self.prefetch_max_in_flight < 1:
            raise SettingError(
                flag_of(PrefetchSettings, "prefetch_max_in_flight"), "must be at least 1"
            )
        if self.prefetch_min_tokens < 1:
            raise SettingError(
                flag_of(PrefetchSettings, "prefetch_min_tokens"), "must be at least 1"
            )


@dataclass(frozen=True)
class Candidate:
    """An idle live session and where its next turn would go."""

    session: str
    num_tokens: int  # its last prompt
    target: str  # the decode or aggregated pod its next turn would go to
    cached_tokens: int  # of that prompt, predicted on ``target``
    moves: bool  # ``target`` is not the pod its last turn went to
    # KV tokens ``target`` can fill without evicting what live sessions need
    # there (live.py); None: unknown (capacity not reported).
    room_tokens: int | None = None

    @property
    def missing_tokens(self) -> int:
        return max(0, self.num_tokens - self.cached_tokens)


@dataclass(frozen=True)
class PodGate:
    """What a pod allows a prefetch."""

    available: bool  # healthy, not draining, circuit closed
    queued: int  # real requests waiting: engine-reported waiting, or tokens pending prefill
    prefetching: int  # prefetches running there


@dataclass(frozen=True)
class Prefetch:
    session: str
    pod: str
    tokens: int  # missing there when decided: what the prefetch warms
    reason: str  # "moves" or "evicted"


def plan(
    candidates: Iterable[Candidate], pods: Mapping[str, PodGate], settings: PrefetchSettings
) -> list[Prefetch]:
    """The prefetches to start now."""
    started: dict[str, int] = {}
    chosen = []
    for c in sorted(candidates, key=lambda c: (-c.missing_tokens, c.session)):
        gate = pods.get(c.target)
        if (
            c.missing_tokens < settings.prefetch_min_tokens
            or gate is None
            or not gate.available
            or gate.queued > 0
            or (c.room_tokens is not None and c.missing_tokens > c.room_tokens)
        ):
            continue
        running = gate.prefetching + started.get(c.target, 0)
        if running >= settings.prefetch_max_in_flight:
            continue
        started[c.target] = started.get(c.target, 0) + 1
        chosen.append(
            Prefetch(c.session, c.target, c.missing_tokens, "moves" if c.moves else "evicted")
        )
    return chosen
