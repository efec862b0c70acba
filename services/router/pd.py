"""The request path across engines: the routing core chooses the pods, then
Prefill on the prefill pod and Generate on the decode pod with the prefill's
KV hand-off parameters (or Generate alone on a decode or aggregated pod that
computes the prompt itself).

Failure rules, in one place:
* No decode pod can serve → 503 before anything runs (a prefill would only
  strand KV).
* A pod that fails before the first byte is marked unhealthy, counts against
  its circuit breaker, and the request is routed again without it; so is a
  pod removed between the decision and the call, without counting against it.
  An engine that dies or stalls fails its calls this way (UNAVAILABLE): a
  call to a hung engine ends once its host's ``--stall-timeout-s`` passes.
* No prefill pod can serve → the decode pod computes the prompt itself.
* No decode pod can serve after a prefill succeeded, or the client leaves
  between prefill and decode → the prefill's leased KV is released at once
  through a decode engine (ReleaseKv), not left until its lease expires.
* A client that leaves mid-request cancels the gRPC call; the engine aborts
  the request and frees its KV.
* A decode pod lost after tokens were streamed (UNAVAILABLE or a server-side
  CANCELLED: the engine died, stalled or was stopped; never the client's
  cancel nor an engine's deliberate error) is marked unhealthy and the
  request resumes on another pod from its prompt plus the tokens sent,
  through the normal routing path (a prefill pod may compute the new
  prefix; services/router/migration.py), at most ``--max-migrations`` times
  and only before the request's deadline; else the stream ends in an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import grpc

from common.proto import engine_pb2 as pb
from common.roles import Role
from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics
from services.router.migration import Migration
from services.router.pods import EnginePod, PodPool
from services.router.prefetch import SessionPrefetcher
from services.router.retention import SessionRetention
from services.router.routing import NoPodAvailable, RouteDecision, RouteRequest
from services.router.routing.replica import Replica

log = logging.getLogger(__name__)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}
# Codes that mean the pod is lost mid-stream (not a request it refused): the
# request may resume elsewhere. Our own cancel never arrives as an error.
_MIGRATABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
_RELEASE_TIMEOUT_S = 5.0


@dataclass
class EngineRequest:
    request_id: str
    token_ids: list[int]
    sampling: pb.SamplingParams
    cache_salt: str | None
    arrival: float  # time.perf_counter() when the HTTP request arrived
    session: str | None = None  # routing session key (sticky pod choice)
    session_source: str | None = None  # "header", "user" or "derived"
    session_end: bool = False  # the client marked this as the session's last request
    # Seconds this request spent in each stage of the router's own work
    # (template, tokenize, hash, index, state, grpc: metrics.STAGES), observed
    # at its first token.
    stages: dict[str, float] = field(default_factory=dict)


def _to_openai_error(exc: grpc.aio.AioRpcError, pod: EnginePod) -> OpenAIError:
    code, detail = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return OpenAIError(400, detail)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OpenAIError(429, detail, headers={"Retry-After": "1"})
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return OpenAIError(504, f"{pod.role} pod {pod.address} timed out")
    if code in _RETRYABLE:
        return OpenAIError(503, f"{pod.role} pod {pod.address} is unavailable: {detail}")
    return OpenAIError(502, f"{pod.role} pod {pod.address} failed: {code.name}: {detail}")


class DecodeLost(Exception):
    """The decode pod failed after its first message: the request may resume
    elsewhere; `error` is what the client gets if it does not."""

    def __init__(self, error: OpenAIError, pod: str, code: grpc.StatusCode) -> None:
        super().__init__(error.message)
        self.error, self.pod, self.code = error, pod, code


@dataclass
class _Routing:
    """One request's routing: the current decision, and every decision made
    for it (all released when the request ends)."""

    request: RouteRequest
    decision: RouteDecision | None = None
    decisions: list[RouteDecision] = field(default_factory=list)

    def exclude(self, *pods: str) -> None:
        self.request = replace(self.request, exclude=self.request.exclude | set(pods))


class Orchestrator:
    def __init__(
        self,
        pool: PodPool,
        replica: Replica,
        metrics: RouterMetrics,
        retention: SessionRetention | None = None,
        prefetcher: SessionPrefetcher | None = None,
        max_migrations: int = 0,
        request_timeout_s: float = float("inf"),
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        """``max_migrations``: how often a request may resume on another pod
        after its decode pod was lost mid-stream (0: never); not after
        ``request_timeout_s`` since it arrived. ``detokenize``: token ids to
        text as the engines do it (recovers text an engine held back for
        stop strings when it was lost)."""
        self._pool = pool
        self._max_migrations = max_migrations
        self._timeout_s = request_timeout_s
        self._detokenize = detokenize
        self._prefetcher = prefetcher
        self._replica = replica
        self._core = replica.core
        self._metrics = metrics
        self._retention = retention
        self._background: set[asyncio.Task[None]] = set()

    def _first_call(self, req: EngineRequest) -> None:
        self._metrics.overhead.observe(time.perf_counter() - req.arrival)

    async def _route(
        self, routing: _Routing, tried: int = 0, stages: dict[str, float] | None = None
    ) -> RouteDecision:
        start = time.perf_counter()
        try:
            decision = await self._replica.route(routing.request, time.monotonic(), stages)
        except NoPodAvailable as exc:
            raise OpenAIError(503, f"{exc} ({tried} tried)" if tried else str(exc)) from None
        self._metrics.count_decision(
            self._core.settings.policy.policy, decision, time.perf_counter() - start
        )
        routing.decision = decision
        routing.decisions.append(decision)
        return decision

    async def _prefill_done(
        self, decision: RouteDecision, pod: str, cached_tokens: int | None
    ) -> None:
        """``pod`` computed the prompt; ``cached_tokens``: its count, if it came."""
        await self._replica.report_prefill(decision, time.monotonic(), pod)
        if cached_tokens is not None:
            self._metrics.count_cached(decision, cached_tokens)

    async def _failed(self, routing: _Routing, pod: str, why: str) -> None:
        """A call to ``pod`` failed before its first byte: route again without it."""
        await self._replica.report_failure(routing.decision, pod, time.monotonic(), why)
        routing.exclude(pod)

    async def _gone(self, routing: _Routing, pod: str) -> None:
        """``pod`` was removed since the decision: route again without it."""
        await self._replica.release(routing.decision, time.monotonic())
        routing.exclude(pod)

    async def stream(self, req: EngineRequest) -> AsyncIterator[pb.GenerateResponse]:
        """Run a request; yields the decode's messages, the last one final.
        A decode pod lost mid-stream: the request resumes on another pod and
        the messages go on seamlessly (module docstring)."""
        prefetcher, session = self._prefetcher, req.session
        if prefetcher is not None and session:
            prefetcher.turn_started(session)
        migration = Migration(
            req.request_id, req.token_ids, req.sampling, self._max_migrations, self._detokenize
        )
        attempt, lost_pods, lost_at = req, frozenset[str](), 0.0
        loss: OpenAIError | None = None  # the last decode pod lost, once one was
        try:
            while True:
                try:
                    async with aclosing(
                        self._attempt(attempt, lost_pods, first=attempt is req)
                    ) as run:
                        async for message in run:
                            if lost_at:
                                self._metrics.migration_seconds.observe(
                                    time.perf_counter() - lost_at
                                )
                                lost_at = 0.0
                            out = migration.relay(message)
                            if out is not None:
                                yield out
                            if migration.stopped:
                                return
                    return
                except DecodeLost as lost:
                    lost_at, loss = time.perf_counter(), lost.error
                    lost_pods |= {lost.pod}
                    why = migration.refusal(lost_at, req.arrival + self._timeout_s)
                    if why is not None:
                        self._metrics.migrations.labels(why).inc()
                        log.warning(
                            "request %s: decode pod %s lost after %d tokens (%s); not resumed: %s",
                            req.request_id,
                            lost.pod,
                            len(migration.generated),
                            lost.code.name,
                            why,
                        )
                        raise lost.error from None
                    resume = migration.resume()
                    self._metrics.migrations.labels("resumed").inc()
                    self._metrics.migrated_tokens.inc(len(migration.generated))
                    log.info(
                        "request %s: decode pod %s lost after %d tokens (%s); "
                        "resuming on another pod (migration %d of at most %d)",
                        req.request_id,
                        lost.pod,
                        len(migration.generated),
                        lost.code.name,
                        migration.migrations,
                        self._max_migrations,
                    )
                    if resume is None:  # every token was sent: nothing left to generate
                        yield migration.exhausted()
                        return
                    attempt = replace(
                        req,
                        request_id=resume.request_id,
                        token_ids=resume.token_ids,
                        sampling=resume.sampling,
                    )
                except OpenAIError as exc:
                    if loss is None:
                        raise
                    self._metrics.migrations.labels("failed").inc()
                    # The client saw its tokens stop: say that its pod was lost.
                    raise OpenAIError(
                        exc.status, f"{loss.message}; not resumed on another pod: {exc}"
                    ) from None
        finally:
            if prefetcher is not None and session:
                prefetcher.turn_ended(session, req.token_ids, req.cache_salt, last=req.session_end)

    async def _attempt(
        self, req: EngineRequest, lost_pods: frozenset[str], first: bool
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One run of a request across engines: route, prefill, generate
        (``lost_pods`` excluded; the first attempt carries the retention
        hint)."""
        routing = _Routing(
            RouteRequest(
                req.token_ids,
                session=req.session,
                cache_salt=req.cache_salt,
                session_end=req.session_end,
                exclude=lost_pods,
            )
        )
        try:
            # Decode first: without a decode pod, a prefill would only strand KV.
            decision = await self._route(routing, stages=req.stages)
            hint = self._retention_hint(req, decision) if first else None
            kv_params = await self._prefill(req, routing, hint)
            async for message in self._generate(req, routing, kv_params, hint):
                yield message
        finally:
            for decision in routing.decisions:
                await self._replica.release(decision, time.monotonic())

    def _retention_hint(
        self, req: EngineRequest, decision: RouteDecision
    ) -> pb.RetentionHint | None:
        """What the engine that writes this request's KV to the store should
        keep (services/router/retention.py); once per request, not per retry."""
        if self._retention is None:
            return None
        hint = self._retention.hint(
            req.session,
            req.session_source,
            decision.block_hashes,
            time.monotonic(),
            end=req.session_end,
        )
        self._metrics.retention_sessions.set(self._retention.active_sessions)
        if hint is None:
            return None
        self._metrics.retention_hints.labels("release" if hint.release else "pin").inc()
        return pb.RetentionHint(
            session=hint.session,
            pin_ttl_ms=hint.pin_ttl_ms,
            release=hint.release,
            keep_tokens=hint.keep_tokens,
        )

    async def _prefill(
        self, req: EngineRequest, routing: _Routing, hint: pb.RetentionHint | None = None
    ) -> str:
        """KV hand-off parameters from a prefill pod, or "" when the decode
        (or aggregated) pod computes the prompt itself."""
        tried = 0
        while (address := routing.decision.prefill_pod) is not None:
            tried += 1
            if tried == 1:
                self._first_call(req)
            else:
                self._metrics.retries.labels(Role.PREFILL).inc()
            pod = self._pool.get(address)
            if pod is None:  # removed since the decision
                await self._gone(routing, address)
            else:
                started = time.perf_counter()
                try:
                    reply = await pod.stub.Prefill(
                        pb.PrefillRequest(
                            request_id=req.request_id,
                            token_ids=req.token_ids,
                            sampling_params=req.sampling,
                            cache_salt=req.cache_salt,
                            retention=hint,
                        )
                    )
                    await self._prefill_done(routing.decision, address, reply.cached_tokens)
                    self._metrics.count_prompt(pod.role, len(req.token_ids), reply.cached_tokens)
                    return reply.kv_transfer_params_json
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in _RETRYABLE:
                        raise _to_openai_error(exc, pod) from None
                    await self._failed(routing, address, f"Prefill failed: {exc.code().name}")
                finally:
                    self._metrics.pool_busy.labels(pod.role).inc(time.perf_counter() - started)
            await self._route(routing)
        if not tried:
            self._first_call(req)
        reason = routing.decision.local_prefill
        if reason is not None:
            if reason == "prefill_unavailable":
                log.warning("no prefill pod can serve; the decode pod prefills locally")
            elif reason == "class_pool_unavailable":
                log.warning(
                    "no prefill pod of the %s pool can serve; the decode pod prefills locally",
                    routing.decision.request_class,
                )
            self._metrics.local_prefill.labels(reason).inc()
        return ""

    async def _generate(
        self,
        req: EngineRequest,
        routing: _Routing,
        kv_params: str,
        hint: pb.RetentionHint | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        tried: set[str] = set()
        first_byte = False
        try:
            while True:
                if tried:
                    # Retry on another pod, keeping the prefill's KV (or local
                    # prefill): no second prefill.
                    routing.exclude(*(p.address for p in self._pool.of_role(Role.PREFILL)))
                    await self._route(routing, len(tried))
                decision = routing.decision
                tried.add(decision.decode_pod)
                pod = self._pool.get(decision.decode_pod)
                if pod is None:  # removed since the decision
                    await self._gone(routing, decision.decode_pod)
                    continue
                if len(tried) > 1:
                    self._metrics.retries.labels(pod.role).inc()
                started = time.perf_counter()
                # The hint goes along when this pod computes the prompt (no
                # prefill pod, or an aggregated pod): then it writes the KV.
                call = pod.generate(
                    pb.GenerateRequest(
                        request_id=req.request_id,
                        token_ids=req.token_ids,
                        sampling_params=req.sampling,
                        kv_transfer_params_json=kv_params,
                        cache_salt=req.cache_salt,
                        retention=None if kv_params else hint,
                    )
                )
                try:
                    async for message in call:
                        if not first_byte:
                            first_byte = True
                            now = time.perf_counter()
                            self._metrics.observe_ttft(decision, now - req.arrival)
                            req.stages["grpc"] = now - started
                            self._metrics.observe_stages(req.stages)
                            if not kv_params:
                                # The prompt is computed: it no longer queues
                                # ahead of others there (its count comes last).
                                await self._prefill_done(decision, pod.address, None)
                        if message.finish_reason and not kv_params:
                            # This pod computed the prompt: its count is the truth.
                            await self._prefill_done(
                                decision, pod.address, message.usage.cached_tokens
                            )
                            self._metrics.count_prompt(
                                pod.role, message.usage.prompt_tokens, message.usage.cached_tokens
                            )
                        if message.finish_reason:
                            self._metrics.count_generation(
                                pod.role, message.usage.completion_tokens
                            )
                        yield message
                    return
                except grpc.aio.AioRpcError as exc:
                    if first_byte and exc.code() in _MIGRATABLE:
                        why = f"Generate failed mid-stream: {exc.code().name}"
                        await self._replica.report_failure(
                            decision, pod.address, time.monotonic(), why
                        )
                        raise DecodeLost(
                            _to_openai_error(exc, pod), pod.address, exc.code()
                        ) from None
                    if first_byte or exc.code() not in _RETRYABLE:
                        raise _to_openai_error(exc, pod) from None
                    await self._failed(routing, pod.address, f"Generate failed: {exc.code().name}")
                finally:
                    call.cancel()  # no-op when finished; aborts the request otherwise
                    self._metrics.pool_busy.labels(pod.role).inc(time.perf_counter() - started)
        finally:
            if kv_params and not first_byte:
                # The KV the prefill holds for this request will never be pulled.
                self._release_kv_soon(req.request_id, kv_params, exclude=tried)

    def _release_kv_soon(self, request_id: str, kv_params: str, exclude: set[str]) -> None:
        """Free a prefill's leased KV in the background (works while cancelled)."""
        task = asyncio.get_running_loop().create_task(
            self._release_kv(request_id, kv_params, exclude)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_kv(self, request_id: str, kv_params: str, exclude: set[str]) -> None:
        # Prefer a pod that did not just fail; the one the request was on is
        # fine too if it is still up (a client disconnect, not a pod failure).
        now = time.monotonic()
        pods = sorted(
            self._pool.of_role(Role.DECODE),
            key=lambda p: (not self._core.available(p.address, now), p.address in exclude),
        )
        for pod in pods:
            try:
                await pod.stub.ReleaseKv(
                    pb.ReleaseKvRequest(request_id=request_id, kv_transfer_params_json=kv_params),
                    timeout=_RELEASE_TIMEOUT_S,
                )
                self._metrics.kv_released.inc()
                log.info("request %s: released prefill KV via %s", request_id, pod.address)
                return
            except grpc.aio.AioRpcError as exc:
                log.debug("ReleaseKv via %s failed: %s", pod.address, exc.code().name)
        log.warning(
            "request %s: could not release prefill KV early; its lease will expire", request_id
        )

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=_RELEASE_TIMEOUT_S)
