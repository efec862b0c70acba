"""The request path across engines: the routing core chooses the pods, then
Prefill on the prefill pod and Generate on the decode pod with the prefill's
KV hand-off parameters (or Generate alone on a decode or aggregated pod that
computes the prompt itself).

Failure rules, in one place:
* No decode pod can serve → 503 before anything runs (a prefill would only
  strand KV).
* A pod that fails before the first byte is marked unhealthy, counts against
  its circuit breaker, and the request is routed again without it.
* No prefill pod can serve → the decode pod computes the prompt itself.
* No decode pod can serve after a prefill succeeded, or the client leaves
  between prefill and decode → the prefill's leased KV is released at once
  through a decode engine (ReleaseKv), not left until its lease expires.
* A client that leaves mid-request cancels the gRPC call; the engine aborts
  the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import grpc

from common.proto import engine_pb2 as pb
from services.router.errors import OpenAIError
from services.router.metrics import RouterMetrics
from services.router.pods import EnginePod, PodPool
from services.router.retention import SessionRetention
from services.router.routing import NoPodAvailable, RouteDecision, RouteRequest, RoutingCore

log = logging.getLogger("tandem.router")

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.CANCELLED}
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
    def __init__(self, pool: PodPool, core: RoutingCore, metrics: RouterMetrics,
                 retention: SessionRetention | None = None) -> None:
        self._pool = pool
        self._core = core
        self._metrics = metrics
        self._retention = retention
        self._background: set[asyncio.Task] = set()
        self._split = bool(pool.of_role("decode"))  # P/D, else aggregated pods

    def _first_call(self, req: EngineRequest) -> None:
        self._metrics.overhead.observe(time.perf_counter() - req.arrival)

    async def _route(self, routing: _Routing, role: str, tried: int = 0) -> RouteDecision:
        try:
            decision = await self._core.route(routing.request, time.monotonic())
        except NoPodAvailable:
            raise OpenAIError(503, f"no healthy {role} pod is available ({tried} tried)"
                              if tried else f"no healthy {role} pod is available") from None
        routing.decision = decision
        routing.decisions.append(decision)
        return decision

    async def _failed(self, routing: _Routing, pod: EnginePod, step: str,
                      exc: grpc.aio.AioRpcError) -> None:
        self._pool.mark_failed(pod.address, f"{step} failed: {exc.code().name}")
        await self._core.report_failure(routing.decision, pod.address, time.monotonic())
        await self._core.release(routing.decision)
        routing.exclude(pod.address)

    async def stream(self, req: EngineRequest) -> AsyncIterator[pb.GenerateResponse]:
        """Run a request; yields the decode's messages, the last one final."""
        routing = _Routing(RouteRequest(req.token_ids, session=req.session,
                                        cache_salt=req.cache_salt,
                                        session_end=req.session_end))
        role = "decode" if self._split else "both"
        try:
            # Decode first: without a decode pod, a prefill would only strand KV.
            decision = await self._route(routing, role)
            hint = self._retention_hint(req, decision)
            kv_params = await self._prefill(req, routing, hint) if self._split else ""
            if not self._split:
                self._first_call(req)
            async for message in self._generate(req, routing, role, kv_params, hint):
                yield message
        finally:
            for decision in routing.decisions:
                await self._core.release(decision)

    def _retention_hint(self, req: EngineRequest,
                        decision: RouteDecision) -> pb.RetentionHint | None:
        """What the engine that writes this request's KV to the store should
        keep (services/router/retention.py); once per request, not per retry."""
        if self._retention is None:
            return None
        hint = self._retention.hint(req.session, req.session_source, decision.block_hashes,
                                    end=req.session_end)
        self._metrics.retention_sessions.set(self._retention.active_sessions)
        if hint is None:
            return None
        self._metrics.retention_hints.labels("release" if hint.release else "pin").inc()
        return pb.RetentionHint(session=hint.session, pin_ttl_ms=hint.pin_ttl_ms,
                                release=hint.release, keep_tokens=hint.keep_tokens)

    async def _prefill(self, req: EngineRequest, routing: _Routing,
                       hint: pb.RetentionHint | None = None) -> str:
        """KV hand-off parameters from a prefill pod, or "" for local prefill."""
        tried = 0
        while (address := routing.decision.prefill_pod) is not None:
            pod = self._pool.pod(address)
            tried += 1
            if tried == 1:
                self._first_call(req)
            else:
                self._metrics.retries.labels("prefill").inc()
            pod.acquire()
            started = time.perf_counter()
            try:
                reply = await pod.stub.Prefill(pb.PrefillRequest(
                    request_id=req.request_id, token_ids=req.token_ids,
                    sampling_params=req.sampling, cache_salt=req.cache_salt,
                    retention=hint))
                await self._core.report_prefill(routing.decision, reply.cached_tokens,
                                                time.monotonic(), pod=address)
                self._metrics.count_prompt(pod.role, len(req.token_ids), reply.cached_tokens)
                return reply.kv_transfer_params_json
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise _to_openai_error(exc, pod) from None
                await self._failed(routing, pod, "Prefill", exc)
            finally:
                pod.release()
                self._metrics.pool_busy.labels(pod.role).inc(time.perf_counter() - started)
            await self._route(routing, "decode")
        if not tried:
            self._first_call(req)
        self._metrics.local_prefill.labels(self._local_prefill_reason(routing)).inc()
        return ""

    def _local_prefill_reason(self, routing: _Routing) -> str:
        prefill = self._pool.of_role("prefill")
        if not prefill:
            return "no_prefill_pods"
        now = time.monotonic()
        if not any(self._core.available(p.address, now)
                   and p.address not in routing.request.exclude for p in prefill):
            log.warning("no prefill pod can serve; the decode pod prefills locally")
            return "prefill_unavailable"
        return "short_uncached"  # the decode pod lacks too little to be worth a transfer

    async def _generate(self, req: EngineRequest, routing: _Routing, role: str,
                        kv_params: str, hint: pb.RetentionHint | None = None,
                        ) -> AsyncIterator[pb.GenerateResponse]:
        tried: set[str] = set()
        first_byte = False
        try:
            while True:
                if tried:
                    # Retry on another pod of the role, keeping the prefill's
                    # KV (or local prefill): no second prefill.
                    routing.exclude(*(p.address for p in self._pool.of_role("prefill")))
                    await self._route(routing, role, len(tried))
                    self._metrics.retries.labels(role).inc()
                decision = routing.decision
                pod = self._pool.pod(decision.decode_pod)
                tried.add(pod.address)
                pod.acquire()
                started = time.perf_counter()
                # The hint goes along when this pod computes the prompt (no
                # prefill pod, or an aggregated pod): then it writes the KV.
                call = pod.stub.Generate(pb.GenerateRequest(
                    request_id=req.request_id, token_ids=req.token_ids,
                    sampling_params=req.sampling, kv_transfer_params_json=kv_params,
                    cache_salt=req.cache_salt, retention=None if kv_params else hint))
                try:
                    async for message in call:
                        if not first_byte:
                            first_byte = True
                            self._metrics.ttft.observe(time.perf_counter() - req.arrival)
                            if not kv_params:
                                # The prompt is computed: it no longer queues
                                # ahead of others there (its count comes last).
                                await self._core.report_prefill(
                                    decision, None, time.monotonic(), pod=pod.address)
                        if message.finish_reason and not kv_params:
                            # This pod computed the prompt: its count is the truth.
                            await self._core.report_prefill(
                                decision, message.usage.cached_tokens, time.monotonic(),
                                pod=pod.address)
                            self._metrics.count_prompt(pod.role, message.usage.prompt_tokens,
                                                       message.usage.cached_tokens)
                        if message.finish_reason:
                            self._metrics.count_generation(pod.role,
                                                           message.usage.completion_tokens)
                        yield message
                    return
                except grpc.aio.AioRpcError as exc:
                    if first_byte or exc.code() not in _RETRYABLE:
                        raise _to_openai_error(exc, pod) from None
                    await self._failed(routing, pod, "Generate", exc)
                finally:
                    call.cancel()  # no-op when finished; aborts the request otherwise
                    pod.release()
                    self._metrics.pool_busy.labels(pod.role).inc(time.perf_counter() - started)
        finally:
            if kv_params and not first_byte:
                # The KV the prefill holds for this request will never be pulled.
                self._release_kv_soon(req.request_id, kv_params, exclude=tried)

    def _release_kv_soon(self, request_id: str, kv_params: str, exclude: set[str]) -> None:
        """Free a prefill's leased KV in the background (works while cancelled)."""
        task = asyncio.get_running_loop().create_task(
            self._release_kv(request_id, kv_params, exclude))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_kv(self, request_id: str, kv_params: str, exclude: set[str]) -> None:
        # Prefer a pod that did not just fail; the one the request was on is
        # fine too if it is still up (a client disconnect, not a pod failure).
        pods = sorted(self._pool.of_role("decode"),
                      key=lambda p: (not p.available, p.address in exclude))
        for pod in pods:
            try:
                await pod.stub.ReleaseKv(pb.ReleaseKvRequest(
                    request_id=request_id, kv_transfer_params_json=kv_params),
                    timeout=_RELEASE_TIMEOUT_S)
                self._metrics.kv_released.inc()
                log.info("request %s: released prefill KV via %s", request_id, pod.address)
                return
            except grpc.aio.AioRpcError as exc:
                log.debug("ReleaseKv via %s failed: %s", pod.address, exc.code().name)
        log.warning("request %s: could not release prefill KV early; its lease will expire",
                    request_id)

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=_RELEASE_TIMEOUT_S)
