"""Composition root of the router: builds every part once and wires them.

Request path: middleware (`auth.ApiKeyAuth` checks API keys,
`admission.AdmissionMiddleware` bounds concurrency and queueing) →
`serving.OpenAIServing` (validate, session, tokenize, shape
responses) → `pd.Orchestrator` (asks the routing core for pods, runs prefill
then decode, with retries and KV release) → gRPC to the engines.
`pods.PodPool` polls health and load and feeds them to the routing core.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.router.admission import AdmissionMiddleware, Limiter
from services.router.auth import ApiKeyAuth
from services.router.config import RouterSettings
from services.router.errors import OpenAIError, install_error_handlers
from services.router.metrics import RouterMetrics
from services.router.pd import Orchestrator
from services.router.pods import EnginePod, PodPool
from services.router.protocol import ChatCompletionRequest, CompletionRequest
from services.router.retention import SessionRetention
from services.router.routing import PodSpec, RoutingCore, RoutingSettings
from services.router.serving import ModelCard, OpenAIServing
from services.router.tokenizer import ChatTokenizer

log = logging.getLogger("tandem.router")
_STARTUP_WAIT_S = 600.0


class RequestAccounting:
    """ASGI middleware: stamps each request's arrival (for the overhead metric)
    and counts responses by path and status. Pure ASGI, so streaming responses
    and client disconnects pass through untouched."""

    def __init__(self, app, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.perf_counter()

        async def send_counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(scope["path"], str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_counted)


async def _model_info(pods: list[EnginePod]):
    """Ask the engines what they serve (waiting for the first to answer)."""
    deadline = time.monotonic() + _STARTUP_WAIT_S
    while True:
        for pod in pods:
            try:
                return await pod.model_info(timeout=2.0)
            except grpc.aio.AioRpcError:
                continue
        if time.monotonic() > deadline:
            raise RuntimeError("no engine pod answered GetModelInfo; are they running?")
        log.info("waiting for engine pods %s", [p.address for p in pods])
        await asyncio.sleep(1.0)


def _routing_settings(routing: RoutingSettings, engine_block_size: int) -> RoutingSettings:
    """The prefix index must hash blocks of the engines' size: theirs wins."""
    if engine_block_size and engine_block_size != routing.block_size:
        log.warning("engines use KV blocks of %d tokens, not --block-size %d: using %d",
                    engine_block_size, routing.block_size, engine_block_size)
        return replace(routing, block_size=engine_block_size)
    return routing


def install_middleware(app: FastAPI, settings: RouterSettings,
                       metrics: RouterMetrics) -> Limiter:
    """Outermost first: accounting (so 401s and 429s are counted too), then
    API keys (an unauthenticated request never takes a queue place), then
    admission. Starlette wraps in reverse order of `add_middleware`."""
    limiter = Limiter(settings.max_concurrent_requests, settings.max_queued_requests,
                      settings.queue_timeout_s, metrics)
    app.add_middleware(AdmissionMiddleware, limiter=limiter)
    app.add_middleware(ApiKeyAuth, keys=settings.api_keys, metrics=metrics)
    app.add_middleware(RequestAccounting, metrics=metrics)
    return limiter


def create_app(settings: RouterSettings) -> FastAPI:
    metrics = RouterMetrics()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # gRPC channels belong to the serving event loop: create them here.
        pods = ([EnginePod(a, "prefill", metrics) for a in settings.prefill]
                + [EnginePod(a, "decode", metrics) for a in settings.decode]
                + [EnginePod(a, "both", metrics) for a in settings.engines])
        info = await _model_info(pods)
        card = ModelCard(name=settings.served_model_name or info.served_model_name,
                         max_model_len=info.max_model_len, created=int(time.time()))
        routing = _routing_settings(settings.routing, info.block_size)
        core = RoutingCore(routing, [PodSpec(p.address, p.role) for p in pods],
                           registry=metrics.registry)
        pool = state["pool"] = PodPool(pods, settings.poll_interval_s, core)
        retention = SessionRetention(settings.retention, routing.block_size)
        orchestrator = Orchestrator(pool, core, metrics, retention)
        tokenizer = await asyncio.to_thread(ChatTokenizer, Path(settings.model or info.model_path))
        await core.start()
        await pool.poll_once()
        pool.start()
        state["serving"] = OpenAIServing(card, tokenizer, orchestrator, metrics,
                                         settings.request_timeout_s, routing.session_header,
                                         settings.retention.end_header)
        log.info("router ready on http://%s:%d serving %s (prefill=%s decode=%s engines=%s, "
                 "policy %s, KV events from %d pods; KV retention %s, pins %gs; "
                 "admission %s running, %d queued; API keys %s)", settings.host,
                 settings.port, card.name, settings.prefill, settings.decode, settings.engines,
                 routing.policy.policy, len(routing.kv_events), settings.retention.policy,
                 settings.retention.ttl_s, settings.max_concurrent_requests or "unlimited",
                 settings.max_queued_requests,
                 f"required ({len(settings.api_keys)})" if settings.api_keys else "off")
        try:
            yield
        finally:
            await orchestrator.drain_background()
            await pool.close()
            await core.close()

    app = FastAPI(title="Tandem router", lifespan=lifespan)
    install_middleware(app, settings, metrics)
    install_error_handlers(app)

    def serving() -> OpenAIServing:
        return state["serving"]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await serving().chat(request, body)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await serving().completions(request, body)

    @app.get("/v1/models")
    async def models():
        return serving().models()

    @app.get("/health")
    async def health():
        pool: PodPool = state["pool"]
        ready = {role: sum(p.available for p in pool.of_role(role))
                 for role in ("prefill", "decode", "both")}
        can_serve = ready["decode"] > 0 or ready["both"] > 0
        body = {"status": "ok" if can_serve else "unavailable", "pods": {
            p.address: {"role": p.role, "healthy": p.state.healthy,
                        "draining": p.state.draining, "in_flight": p.state.in_flight}
            for p in pool.pods}}
        return JSONResponse(body, status_code=200 if can_serve else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


__all__ = ["create_app", "OpenAIError"]
