"""Per-client rate limits: requests per second and tokens per minute, each a
token bucket per client, 429 with ``Retry-After`` beyond them.

A client is its API key when keys are configured (the key's digest, never
the key), else the connection's peer address — behind a proxy or an
Ingress that is the proxy's, so every client behind it shares one bucket
(docs/operate.md, "Rate limits").

Requests: each request (but /health and /metrics) takes one from a bucket
holding --rate-limit-burst and refilled at --rate-limit-requests-per-s.

Tokens: a request's size is not known when it arrives (its prompt is not
yet tokenized, its completion not generated), so the tokens bucket is
charged afterwards and may go into debt: a generation request is admitted
while the client's bucket holds a token, then charged its prompt tokens
once tokenized and each completion token as it is generated. A client in
debt gets 429 until the refill (--rate-limit-tokens-per-min / 60 per
second) has paid it back and one token more. One request can so overshoot the limit by its own
size, never more; streams already running are never cut.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Any

from common.proto import engine_pb2 as pb
from common.router import RateLimitSettings
from services.router.admission import GENERATION_PATHS
from services.router.auth import OPEN_PATHS
from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics
from services.router.pd import EngineRequest

# What the request being served charges its tokens to (None: no token limit).
_METER: ContextVar[Callable[[int], None] | None] = ContextVar("tandem_rate_meter", default=None)


class TokenBucket:
    """Holds up to `capacity`, refilled at `rate` per second; may go below
    zero (debt) when charged more than it holds."""

    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.level = capacity
        self.stamp = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, amount: float, now: float) -> float:
        """Takes `amount` if the bucket holds it and returns 0, else returns
        the seconds until it will (taking nothing)."""
        self._refill(now)
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def in_debt_for(self, now: float) -> float:
        """0 if the bucket holds a whole token, else the seconds until it does."""
        self._refill(now)
        return 0.0 if self.level >= 1 else (1 - self.level) / self.rate

    def charge(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount


class _Client:
    __slots__ = ("requests", "tokens")

    def __init__(self, requests: TokenBucket | None, tokens: TokenBucket | None) -> None:
        self.requests = requests
        self.tokens = tokens


class RateLimiter:
    """The buckets of every client seen, the least recently seen forgotten
    beyond `rate_limit_max_clients` (it comes back with full buckets)."""

    def __init__(
        self,
        settings: RateLimitSettings,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._metrics = metrics
        self._clock = clock
        self._clients: OrderedDict[str, _Client] = OrderedDict()
        self.evictions = 0
        rps = settings.rate_limit_requests_per_s
        self._burst = settings.rate_limit_burst or max(1, math.ceil(rps))

    @property
    def clients(self) -> int:
        return len(self._clients)

    def _client(self, client: str, now: float) -> _Client:
        entry = self._clients.get(client)
        if entry is not None:
            self._clients.move_to_end(client)
            return entry
        s = self.settings
        entry = _Client(
            TokenBucket(self._burst, s.rate_limit_requests_per_s, now)
            if s.rate_limit_requests_per_s > 0
            else None,
            TokenBucket(s.rate_limit_tokens_per_min, s.rate_limit_tokens_per_min / 60, now)
            if s.rate_limit_tokens_per_min > 0
            else None,
        )
        self._clients[client] = entry
        while len(self._clients) > s.rate_limit_max_clients:
            self._clients.popitem(last=False)
            self.evictions += 1
        return entry

    def admit(self, client: str, generation: bool) -> tuple[OpenAIError | None, TokenBucket | None]:
        """(the 429 to answer, None) or (None, the tokens bucket to charge
        if this is a generation request under a token limit)."""
        now = self._clock()
        entry = self._client(client, now)
        tokens = entry.tokens if generation else None
        # Tokens first: a client in token debt does not spend a request too.
        if tokens is not None:
            wait = tokens.in_debt_for(now)
            if wait > 0:
                return self._refuse(
                    "tokens",
                    f"{self.settings.rate_limit_tokens_per_min} tokens per minute",
                    wait,
                ), None
        if entry.requests is not None:
            wait = entry.requests.take(1, now)
            if wait > 0:
                return self._refuse(
                    "requests",
                    f"{self.settings.rate_limit_requests_per_s:g} requests per second",
                    wait,
                ), None
        return None, tokens

    def charge(self, bucket: TokenBucket, tokens: int) -> None:
        bucket.charge(tokens, self._clock())

    def _refuse(self, limit: str, what: str, wait_s: float) -> OpenAIError:
        self._metrics.rate_limited.labels(limit).inc()
        seconds = max(1, math.ceil(wait_s))
        return OpenAIError(
            429,
            f"rate limit exceeded: this client may use {what}; retry after {seconds}s",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(seconds)},
        )


def client_of(scope: dict[str, Any], keyed: bool) -> str:
    """The key's digest when API keys are on (ApiKeyAuth already accepted the
    header), else the peer's address."""
    if keyed:
        header = dict(scope["headers"]).get(b"authorization", b"")
        token = header.partition(b" ")[2].strip()
        return "key:" + hashlib.sha256(token).hexdigest()[:32]
    peer = scope.get("client")
    return "addr:" + (peer[0] if peer else "unknown")


class RateLimits:
    """Pure ASGI middleware, inside ApiKeyAuth (only accepted keys have
    buckets) and outside admission (a refused request takes no queue place)."""

    def __init__(
        self,
        app: Any,
        limiter: RateLimiter,
        keyed: bool,
        open_paths: frozenset[str] = OPEN_PATHS,
        generation_paths: frozenset[str] = GENERATION_PATHS,
    ) -> None:
        self.app = app
        self.limiter = limiter
        self.keyed = keyed
        self.open_paths = open_paths
        self.generation_paths = generation_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        generation = scope["method"] == "POST" and scope["path"] in self.generation_paths
        refusal, bucket = self.limiter.admit(client_of(scope, self.keyed), generation)
        if refusal is not None:
            return await refusal.response(scope["path"])(scope, receive, send)
        if bucket is None:
            return await self.app(scope, receive, send)
        limiter = self.limiter
        token = _METER.set(lambda n: limiter.charge(bucket, n))
        try:
            await self.app(scope, receive, send)
        finally:
            _METER.reset(token)


class MeteredOrchestrator:
    """The orchestrator as the responder sees it, charging each request's
    prompt tokens when its engine request starts and each completion token
    as it arrives to the client's tokens bucket (set by RateLimits in the
    request's context). Everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def stream(self, ereq: EngineRequest) -> AsyncIterator[pb.GenerateResponse]:
        meter = _METER.get()
        if meter is None:
            return self._inner.stream(ereq)  # type: ignore[no-any-return]
        return self._metered(meter, ereq)

    async def _metered(
        self, meter: Callable[[int], None], ereq: EngineRequest
    ) -> AsyncIterator[pb.GenerateResponse]:
        meter(len(ereq.token_ids))
        # aclosing: the inner stream's own clean-up (abort, KV release) runs
        # when the client leaves, not whenever it is garbage-collected.
        async with contextlib.aclosing(self._inner.stream(ereq)) as messages:
            async for message in messages:
                if message.token_ids:
                    meter(len(message.token_ids))
                yield message
