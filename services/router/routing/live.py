"""Which KV each pod's live sessions need: the working set the cost policy
must not evict.

A session is live on the pods its latest turn went to (the aggregated pod, or
the P/D prefill and decode pods: both keep its prompt's blocks), until it has
been idle for ``window_s`` (an agent between turns: tool calls, thinking) or moves. Its
blocks are the block hashes of that latest prompt. A block shared by several
live sessions (a common system prompt, a sub-agent fork of its parent's
context) counts once per pod.

Why not the pod's whole cache: after warm-up every pod's cache is full of
blocks nobody will ask for again, and evicting those costs nothing. Evicting a
live session's blocks costs a recompute of its next turn, which is what the
policy prices (``policy.evicted_tokens``) from ``occupied_blocks``. Each router replica knows the
sessions it routed; with several replicas this is an estimate per replica.

Memory is bounded: beyond ``max_sessions`` sessions, or ``max_blocks`` block
hashes held by all of them, the least recently seen sessions are forgotten
(``evictions`` counts them) as if idle past the window: their KV is no
longer priced as live, which costs at worst a recompute of their next turn.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from services.router.routing.lru import BoundedLru

# Distinct cached prefixes ``occupied_by_pod`` remembers (a request finds most
# pods holding one of a few: the common system prompt, nothing).
_PREFIXES = 64


class LiveSessions:
    def __init__(
        self, window_s: float = 300.0, max_sessions: int = 100_000, max_blocks: int = 4_000_000
    ) -> None:
        if window_s <= 0:
            raise ValueError("live-session window must be positive")
        self.window_s = window_s
        self.max_sessions = max_sessions
        # session -> (pods, block hashes, last seen), least recently seen first
        self._sessions: BoundedLru[str, tuple[frozenset[str], frozenset[int], float]] = BoundedLru(
            max_sessions, max_blocks, weigh=lambda e: len(e[1]), on_drop=self._unindex
        )
        self._blocks: dict[str, Counter[int]] = {}  # pod -> hash -> live sessions using it
        # ``occupied_by_pod``'s memory: the one object of each recent prefix,
        # and per pod (its live blocks' version, prefix, live blocks of it).
        self._prefixes: BoundedLru[frozenset[int], frozenset[int]] = BoundedLru(_PREFIXES)
        self._versions: Counter[str] = Counter()  # pod -> changes to its live blocks
        self._overlaps: dict[str, tuple[int, frozenset[int], int]] = {}

    def touch(self, session: str, pods: Iterable[str], hashes: Sequence[int], now: float) -> None:
        """The session's latest turn went to ``pods`` with these blocks."""
        self._sessions.pop(session)
        blocks = frozenset(hashes)
        where = frozenset(pods)
        for pod in where:
            self._blocks.setdefault(pod, Counter()).update(blocks)
            self._versions[pod] += 1
        self._sessions.put(session, (where, blocks, now))

    def end(self, session: str) -> None:
        self._sessions.pop(session)

    def remove_pod(self, pod: str) -> None:
        """The pod is gone: sessions that were live there are live elsewhere only."""
        self._blocks.pop(pod, None)
        self._versions.pop(pod, None)
        self._overlaps.pop(pod, None)
        for session, (pods, blocks, seen) in self._sessions.items():
            if pod in pods:
                self._sessions.replace(session, (pods - {pod}, blocks, seen))

    def expire(self, now: float) -> None:
        while (oldest := self._sessions.oldest()) is not None and now - oldest[1][
            2
        ] >= self.window_s:
            self._sessions.pop(oldest[0])

    def occupied_blocks(self, pod: str, session: str | None, cached: Sequence[int] = ()) -> int:
        """Blocks on ``pod`` a new turn of ``session`` may not evict: other live
        sessions' blocks, plus the blocks of its prompt the pod holds
        (``cached``; in use while it runs). Each distinct block counts once."""
        counts = self._blocks.get(pod) or Counter[int]()
        entry = self._sessions.get(session) if session else None
        own = entry[1] if entry is not None and pod in entry[0] else frozenset()
        # Every live block, less the session's own blocks no one else needs
        # and its prompt leaves behind, plus its prompt's blocks no live
        # session holds. Set differences: a turn that extends the previous
        # one costs its new blocks, not its whole prompt.
        held = frozenset(cached)
        left_behind = sum(1 for h in own - held if counts.get(h) == 1)
        # In C: with many pods every one holds the common prefix, and this
        # runs for each pod on every request.
        not_own = held - own
        new = len(not_own) - len(counts.keys() & not_own)
        return len(counts) - left_behind + new

    def occupied_by_pod(
        self, session: str | None, hashes: Sequence[int], cached: Mapping[str, int]
    ) -> dict[str, int]:
        """``occupied_blocks(pod, session, hashes[:n])`` for every ``pod: n``
        of ``cached``, equal to it pod by pod. With many pods every one holds
        the common prefix, and every request asks for all of them: a pod where
        the session is not live counts its live blocks less those of the
        prefix, and the prefix's live blocks there are remembered until the
        pod's live blocks change (most pods, most requests: one touch changes
        the pods of one session)."""
        entry = self._sessions.get(session) if session else None
        prefixes: dict[int, frozenset[int]] = {}
        out = {}
        for pod, n in cached.items():
            if entry is not None and pod in entry[0]:
                out[pod] = self.occupied_blocks(pod, session, hashes[:n])
                continue
            counts = self._blocks.get(pod)
            held = prefixes.get(n)
            if held is None:
                held = prefixes[n] = self._prefix(hashes[:n])
            live = self._live_of(pod, counts, held) if counts and held else 0
            out[pod] = (len(counts) if counts else 0) + len(held) - live
        return out

    def _prefix(self, hashes: Sequence[int]) -> frozenset[int]:
        """The one object of this prefix's blocks while it is recent (what
        ``_overlaps`` compares by identity)."""
        blocks = frozenset(hashes)
        known = self._prefixes.get(blocks)
        if known is not None:
            return known
        self._prefixes.put(blocks, blocks)
        return blocks

    def _live_of(self, pod: str, counts: Counter[int], held: frozenset[int]) -> int:
        """How many of ``held`` are live on ``pod``."""
        version = self._versions[pod]
        known = self._overlaps.get(pod)
        if known is not None and known[0] == version and known[1] is held:
            return known[2]
        live = len(counts.keys() & held)
        self._overlaps[pod] = (version, held, live)
        return live

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def held_blocks(self) -> int:
        """Block hashes the sessions' entries hold, in all (what ``max_blocks`` bounds)."""
        return self._sessions.weight

    @property
    def evictions(self) -> int:
        return self._sessions.evictions

    def __contains__(self, session: object) -> bool:
        return session in self._sessions

    def _unindex(self, _session: str, entry: tuple[frozenset[str], frozenset[int], float]) -> None:
        pods, blocks, _ = entry
        for pod in pods:
            self._versions[pod] += 1
            counts = self._blocks[pod]
            for h in blocks:
                if counts[h] <= 1:
                    del counts[h]
                else:
                    counts[h] -= 1
