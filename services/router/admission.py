"""Bounded admission: at most N generation requests run at once, up to Q more
wait in FIFO order, the rest get 429 with Retry-After.

Without a bound the router would accept every request and let them pile up
on the engines (and in memory) until clients time out; a prompt 429 tells a
client, or a load balancer, to go elsewhere or back off while the work that
is admitted still finishes in time.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass

from common.settings import SettingError, flag_of, setting
from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics

# Requests that generate: only these hold engine capacity, so only these
# queue. /live, /health, /metrics and /v1/models must answer under any load.
GENERATION_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}
)
_RECENT = 64  # request durations kept for the Retry-After estimate


@dataclass(frozen=True)
class AdmissionSettings:
    max_concurrent_requests: int = setting(
        256, "generation requests served at once (0: no limit, no queue)", metavar="N"
    )
    max_queued_requests: int = setting(
        512, "generation requests that may wait for a slot (0: refuse at once)", metavar="N"
    )
    queue_timeout_s: float = setting(
        30.0, "seconds a request may wait for a slot before it gets 429"
    )

    def validate(self) -> None:
        for name in ("max_concurrent_requests", "max_queued_requests"):
            if getattr(self, name) < 0:
                raise SettingError(flag_of(AdmissionSettings, name), "cannot be negative")
        if self.queue_timeout_s <= 0:
            raise SettingError(
                flag_of(AdmissionSettings, "queue_timeout_s"),
                f"{self.queue_timeout_s:g}: must be positive (use "
                "--max-queued-requests 0 to refuse instead of queueing)",
            )


class Rejected(Exception):
    """Raised by `Limiter.acquire` instead of admitting; carries the 429."""

    def __init__(self, reason: str, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.reason = reason  # metric label: queue_full or queue_timeout
        self.openai_error = error


class Slot:
    """One admitted request's place; `release` is safe to call more than once,
    so every exit path may call it without counting a slot twice."""

    def __init__(self, limiter: Limiter) -> None:
        self._limiter: Limiter | None = limiter
        self._start = time.monotonic()

    def release(self) -> None:
        limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter._release(time.monotonic() - self._start)


class Limiter:
    """A FIFO semaphore with a bounded queue and a wait timeout.

    A finishing request hands its slot straight to the oldest waiter, so a
    newcomer can never overtake the queue. ``max_running == 0`` means no
    limit (requests are still counted)."""

    def __init__(
        self, max_running: int, max_queued: int, queue_timeout_s: float, metrics: RouterMetrics
    ) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._durations: deque[float] = deque(maxlen=_RECENT)
        self._metrics = metrics

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> Slot | None:
        """A slot if one is free now and nobody waits for it, else None."""
        if not self.max_running or (self.running < self.max_running and not self._waiters):
            self.running += 1
            return self._admitted(time.monotonic())
        return None

    async def acquire(self) -> Slot:
        start = time.monotonic()
        slot = self.try_acquire()
        if slot is not None:
            return slot
        if len(self._waiters) >= self.max_queued:
            raise self._reject(
                "queue_full",
                f"the server is at capacity ({self.running} "
                f"requests running, {self.queued} queued)",
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._update_gauges()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter
        except BaseException as exc:  # timeout or cancellation (client gone)
            if waiter.done() and not waiter.cancelled():
                # The slot was handed over just as we gave up: pass it on.
                self._release(None)
            else:
                waiter.cancel()
                if waiter in self._waiters:  # `_release` may have dropped it already
                    self._waiters.remove(waiter)
                self._update_gauges()
            if isinstance(exc, TimeoutError):
                raise self._reject(
                    "queue_timeout",
                    f"no capacity freed up within {self.queue_timeout_s:g}s in the queue",
                ) from None
            raise
        return self._admitted(start)

    def _admitted(self, start: float) -> Slot:
        self._metrics.queue_wait.observe(time.monotonic() - start)
        self._update_gauges()
        return Slot(self)

    def _release(self, duration: float | None) -> None:
        if duration is not None:
            self._durations.append(duration)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves on; `running` is unchanged
                self._update_gauges()
                return
        self.running -= 1
        self._update_gauges()

    def retry_after_s(self) -> int:
        """Seconds for the queue as it stands to drain at the recent pace:
        mean request duration × (queued + 1) / slots, at least 1."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, math.ceil(mean * (self.queued + 1) / max(self.max_running, 1)))

    def _reject(self, reason: str, message: str) -> Rejected:
        self._metrics.rejected.labels(reason).inc()
        seconds = self.retry_after_s()
        return Rejected(
            reason,
            OpenAIError(
                429,
                f"{message}; retry after {seconds}s",
                code="too_many_requests",
                headers={"Retry-After": str(seconds)},
            ),
        )

    def _update_gauges(self) -> None:
        self._metrics.running.set(self.running)
        self._metrics.queued.set(len(self._waiters))


async def _read_body(receive) -> bytes | None:
    """The whole request body, or None if the client left before sending it."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class AdmissionMiddleware:
    """Pure ASGI, so a slot stays held until the app returns: for a streaming
    response that is after its last chunk or the client's disconnect.

    The body is read before queueing: once it is in, the only message left
    on the connection is the disconnect, so a queued request can watch for
    its client leaving without stealing body chunks from the endpoint."""

    def __init__(self, app, limiter: Limiter, paths=GENERATION_PATHS) -> None:
        self.app = app
        self.limiter = limiter
        self.paths = paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        if body is None:
            return
        # Fast path without watcher tasks: the common case is a free slot.
        slot = self.limiter.try_acquire() or await self._wait_for_slot(scope, receive, send)
        if slot is None:
            return
        replayed = False

        async def replay_body():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay_body, send)
        finally:
            slot.release()

    async def _wait_for_slot(self, scope, receive, send) -> Slot | None:
        """A slot, or None after answering 429 or seeing the client leave."""
        acquiring = asyncio.ensure_future(self.limiter.acquire())
        gone = asyncio.ensure_future(_disconnected(receive))
        waited = False
        try:
            await asyncio.wait({acquiring, gone}, return_when=asyncio.FIRST_COMPLETED)
            waited = True
        finally:
            # A request still queued leaves the queue; one admitted in this
            # very instant passes its slot on (see Limiter.acquire).
            gone.cancel()
            acquiring.cancel()
            await asyncio.gather(acquiring, gone, return_exceptions=True)
            slot = _slot_of(acquiring)
            if slot is not None and (not waited or not gone.cancelled()):
                slot.release()  # the client left, or we are being torn down
                slot = None
        if slot is not None or acquiring.cancelled() or acquiring.exception() is None:
            return slot
        rejected = acquiring.exception()
        if not isinstance(rejected, Rejected):
            raise rejected
        await rejected.openai_error.response(scope["path"])(scope, receive, send)
        return None


def _slot_of(task: asyncio.Future) -> Slot | None:
    """The slot an acquire task got, if it finished with one. (It may still
    be unfinished if our cleanup was itself cancelled; cancelled, it gives
    its slot back on its own.)"""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return None
    return task.result()
