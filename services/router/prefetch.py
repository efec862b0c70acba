"""Session KV prefetch, the I/O: remembers each idle session's last prompt,
asks the routing core where its next turn would go, and runs the load-only
requests ``routing/prefetch.py`` chooses.

A prefetch is Generate on the target pod with the session's last prompt and
``max_tokens=1``; the token is discarded. The engine computes the prompt's
KV, reading the prefix from the shared KV store where it has it, and keeps it
in its prefix cache, so the next turn finds it there. One prefetch per session
per gap: a session warmed once is not warmed again before its next turn.
A turn of the session cancels its running prefetch (the engine aborts it; the
blocks it finished stay cached). The decisions run when a turn ends and at
every ``interval_s`` (the poll interval: pods' queues and the index change).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from common.proto import engine_pb2 as pb
from services.router.metrics import RouterMetrics
from services.router.pods import PodPool
from services.router.routing.lru import BoundedLru
from services.router.routing.prefetch import Candidate, PodGate, Prefetch, PrefetchSettings, plan
from services.router.routing.replica import Replica
from services.router.routing.tasks import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass
class _Turn:
    token_ids: Sequence[int]
    cache_salt: str | None
    warmed: bool = False  # a prefetch ran (or runs) for this gap
    # Its block hashes, computed at the first sweep that considers it (a
    # long prompt takes milliseconds to hash; sweeps run every poll interval).
    hashes: list[int] | None = None


class SessionPrefetcher:
    def __init__(
        self,
        settings: PrefetchSettings,
        pool: PodPool,
        replica: Replica,
        metrics: RouterMetrics,
        interval_s: float,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._replica = replica
        self._core = replica.core
        self._metrics = metrics
        self._interval_s = interval_s
        # Idle sessions' last prompts: a session no longer live is dropped at
        # the next sweep, and there are at most as many as live sessions
        # (--live-max-sessions; least recently ended out, counted in evictions).
        self._idle: BoundedLru[str, _Turn] = BoundedLru(replica.core.live.max_sessions)
        self._turns: dict[str, int] = {}  # session -> its requests in flight
        self._running: dict[str, tuple[str, asyncio.Task[None]]] = {}  # session -> (pod, task)
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    # ----- the request path ---------------------------------------------------
    def turn_started(self, session: str) -> None:
        """A request of ``session`` arrived: it is not idle, and a prefetch
        still warming it is cancelled."""
        self._turns[session] = self._turns.get(session, 0) + 1
        self._idle.pop(session)
        running = self._running.pop(session, None)
        if running is not None:
            running[1].cancel()
            self._metrics.prefetches.labels("cancelled").inc()
            log.info(
                "prefetch of session %s on %s cancelled: its turn came first", session, running[0]
            )

    def turn_ended(
        self, session: str, token_ids: Sequence[int], cache_salt: str | None, last: bool = False
    ) -> None:
        """A request of ``session`` ended; ``last``: the client ended the session."""
        left = self._turns.get(session, 1) - 1
        if left > 0:
            self._turns[session] = left
            return
        self._turns.pop(session, None)
        if last:
            self._idle.pop(session)
            return
        self._idle.put(session, _Turn(token_ids, cache_salt))
        self._wake.set()

    @property
    def entries(self) -> int:
        """Idle sessions remembered."""
        return len(self._idle)

    @property
    def evictions(self) -> int:
        return self._idle.evictions

    # ----- deciding -------------------------------------------------------------
    async def sweep(self) -> list[Prefetch]:
        """Decide and start the prefetches due now."""
        now = time.monotonic()
        self._core.live.expire(now)
        candidates = []
        for session, turn in self._idle.items():
            if session not in self._core.live:  # idle past the live window, or ended
                self._idle.pop(session)
                continue
            if turn.warmed:
                continue
            binding = (await self._replica.state.read(session, now)).binding
            target = self._core.next_turn(
                self._hashes(turn), len(turn.token_ids), session, binding, now
            )
            if target is None:
                continue
            candidates.append(
                Candidate(
                    session,
                    len(turn.token_ids),
                    target.name,
                    target.cached_tokens,
                    binding is not None and binding.pod != target.name,
                    target.kv_free_tokens,
                )
            )
        if not candidates:
            return []
        prefetching: dict[str, int] = {}
        for pod, _ in self._running.values():
            prefetching[pod] = prefetching.get(pod, 0) + 1
        gates = {}
        for name, st in self._core.pods.items():
            queued = st.waiting + self._core.local_load(name).pending_prefill_tokens
            gates[name] = PodGate(self._core.available(name, now), queued, prefetching.get(name, 0))
        chosen = plan(candidates, gates, self._settings)
        for p in chosen:
            self._start(p, self._idle[p.session])
        return chosen

    def _hashes(self, turn: _Turn) -> list[int]:
        if turn.hashes is None:
            turn.hashes = self._core.hasher.event_hashes(turn.token_ids, turn.cache_salt)
        return turn.hashes

    def _start(self, p: Prefetch, turn: _Turn) -> None:
        turn.warmed = True
        task = asyncio.get_running_loop().create_task(
            self._run(p, turn), name=f"prefetch-{p.session}"
        )
        self._running[p.session] = (p.pod, task)
        self._metrics.prefetches.labels("started").inc()
        log.info(
            "prefetch of session %s on %s (%s): %d tokens missing there",
            p.session,
            p.pod,
            p.reason,
            p.tokens,
        )

    async def _run(self, p: Prefetch, turn: _Turn) -> None:
        pod = self._pool.get(p.pod)
        try:
            if pod is None:
                raise RuntimeError("the pod was removed")
            call = pod.stub.Generate(
                pb.GenerateRequest(
                    request_id=f"prefetch-{uuid.uuid4().hex}",
                    token_ids=list(turn.token_ids),
                    sampling_params=pb.SamplingParams(max_tokens=1),
                    cache_salt=turn.cache_salt,
                )
            )
            try:
                async for _ in call:
                    pass
            finally:
                call.cancel()  # aborts the request when cancelled; no-op when done
            self._core.note_warmed(p.pod, self._hashes(turn), time.monotonic())
            self._metrics.prefetches.labels("completed").inc()
            self._metrics.prefetch_tokens.inc(p.tokens)
        except asyncio.CancelledError:
            raise  # counted by whoever cancelled it
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            self._metrics.prefetches.labels("failed").inc()
            log.warning("prefetch of session %s on %s failed: %s", p.session, p.pod, exc)
        finally:
            if self._running.get(p.session, (None, None))[1] is asyncio.current_task():
                del self._running[p.session]

    # ----- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.create_task(self._sweep_forever(), name="session-prefetch")

    async def _sweep_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.sweep()
            except Exception:  # a bad sweep must not end prefetching for good
                log.exception("session prefetch sweep failed")

    async def close(self) -> None:
        await cancel_and_wait(self._loop)
        self._loop = None
        running = [task for _, task in self._running.values()]
        self._running.clear()
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
