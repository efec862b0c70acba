"""Composition root of the router: builds every part once, hands the routes
what they serve with on ``app.state`` (the metrics, and `api.parts.RouterParts`
built at startup), includes each API family's routes (`api/`), installs
middleware and error handlers.

A request passes, in order: `auth.ApiKeyAuth`, `rate_limits.RateLimits` and
`admission.AdmissionMiddleware` (API keys, per-client rate limits,
concurrency and queueing) → its family's route in `api/<family>/`
(`api_router.py`; a JSON body validated in one pass, `api/json_body.py`) →
that family's serving (`serving.py`: validate, translate
Messages and Responses onto chat, tokenize, build the one engine request in
`api/engine_request.py`) → `api/streaming.py`'s `Responder` (the whole
response or its event stream, in the family's shape) → `pd.Orchestrator`
(reads the shared state, asks `routing.RoutingCore` for pods, runs Prefill
then Generate over gRPC, with retries and KV release). Beside the request
path, `pods.PodPool` polls the engines and applies their KV events to the
routing core; `discovery.py` says which pods there are.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from pathlib import Path

import grpc
from fastapi import FastAPI
from starlette.routing import Match

from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc
from common.tls import TlsFiles
from services.router.admission import AdmissionMiddleware, Limiter
from services.router.api import operations
from services.router.api.chat import api_router as chat
from services.router.api.chat.reasoning import ReasoningParsers
from services.router.api.chat.serving import ChatServing
from services.router.api.chat.tools import AutoParser
from services.router.api.completions import api_router as completions
from services.router.api.completions.serving import CompletionsServing
from services.router.api.engine_request import EngineRequests, ModelCard
from services.router.api.messages import api_router as messages
from services.router.api.messages.serving import MessagesServing
from services.router.api.models import api_router as models
from services.router.api.parts import RouterParts
from services.router.api.responses import api_router as responses
from services.router.api.responses.serving import ResponsesServing, ResponseStore
from services.router.api.streaming import Responder
from services.router.api.tokenize import api_router as tokenize
from services.router.api.tokenize.serving import TokenizeServing
from services.router.auth import ApiKeyAuth
from services.router.body_limits import BodyLimits
from services.router.config import RouterSettings
from services.router.discovery import PodSource, pod_source
from services.router.errors import OpenAIError, install_error_handlers
from services.router.metrics import RouterMetrics, TableSize
from services.router.pd import Orchestrator
from services.router.pods import PodPool, open_channel
from services.router.prefetch import SessionPrefetcher
from services.router.rate_limits import MeteredOrchestrator, RateLimiter, RateLimits
from services.router.retention import SessionRetention
from services.router.routing import RoutingCore, RoutingSettings
from services.router.routing.replica import Replica
from services.router.routing.shared_state import LocalState, RedisState
from services.router.routing.tasks import cancel_and_wait
from services.router.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)
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
                endpoint = endpoint_label(scope)
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_counted)


def endpoint_label(scope) -> str:
    """The route a request's path matches, as declared (``/v1/responses/{response_id}``,
    not each id), else ``unmatched``: one label per route, however many
    distinct paths clients send. Middleware that answers before routing (401,
    429) sees no matched route in the scope, so the app's routes are matched here."""
    route = scope.get("route")
    if route is None:
        partial = None  # the path matches, the method does not (a 405)
        for candidate in getattr(scope.get("app"), "routes", ()):
            match = candidate.matches(scope)[0]
            if match == Match.FULL:
                route = candidate
                break
            if match == Match.PARTIAL and partial is None:
                partial = candidate
        route = route or partial
    return getattr(route, "path", None) or "unmatched"


# Young-generation collections every this many allocations (CPython: 700). A
# streamed request allocates thousands of short-lived objects that reference
# counting frees; collecting that often only re-walks the survivors.
_GC_YOUNG_THRESHOLD = 20_000


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """While the router serves: what startup built (the tokenizer,
    transformers, FastAPI: most of the heap) frozen out of the cyclic garbage
    collector, which otherwise re-walked it in every full collection (a
    third of the event loop's time at load: docs/benchmarks.md, "Router
    overhead"), and young collections less often. Both undone at shutdown."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, 20, 20)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


async def _model_info(
    addresses: list[str],
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
) -> pb.GetModelInfoResponse:
    """Ask the engines what they serve (waiting for the first to answer)."""
    deadline = time.monotonic() + _STARTUP_WAIT_S
    while True:
        for address in addresses:
            async with open_channel(address, credentials, server_name) as channel:
                try:
                    return await pb_grpc.EngineStub(channel).GetModelInfo(
                        pb.GetModelInfoRequest(), timeout=2.0
                    )
                except grpc.aio.AioRpcError:
                    continue
        if time.monotonic() > deadline:
            raise RuntimeError("no engine pod answered GetModelInfo; are they running?")
        log.info("waiting for engine pods %s", addresses)
        await asyncio.sleep(1.0)


def bounded_tables(
    core: RoutingCore,
    state: LocalState,
    retention: SessionRetention,
    tokenizer: ChatTokenizer,
    store: ResponseStore,
    prefetcher: SessionPrefetcher | None,
    rate_limiter: RateLimiter | None = None,
) -> list[TableSize]:
    """Every table of the router that grows with traffic, with its size and
    evictions (docs/operate.md, "Memory bounds"; in-flight tables are bounded
    by admission and are not listed)."""
    index = core.index
    tables = [
        TableSize("prefix_index", len(index), index.evictions, index.capacity),
        TableSize("predicted_index", index.predicted_entries, index.predicted_evictions),
        TableSize("live_sessions", len(core.live), core.live.evictions),
        TableSize("hash_chains", len(core.chains), core.chains.evictions),
        TableSize("session_bindings", state.entries, state.evictions),
        TableSize("retention_sessions", retention.active_sessions, retention.evictions),
        TableSize("stored_responses", store.entries, store.evictions),
    ]
    cache = tokenizer.session_cache
    if cache is not None:
        tables.append(TableSize("tokenizer_sessions", cache.cached_sessions, cache.evictions))
    if prefetcher is not None:
        tables.append(TableSize("prefetch_sessions", prefetcher.entries, prefetcher.evictions))
    if rate_limiter is not None:
        tables.append(TableSize("rate_limit_clients", rate_limiter.clients, rate_limiter.evictions))
    return tables


def shared_state(routing: RoutingSettings) -> LocalState:
    """Redis when configured (router replicas share bindings and load), else local."""
    if routing.redis_url:
        return RedisState(
            routing.redis_url,
            routing.replica_id,
            binding_ttl_s=routing.session_ttl_s,
            timeout_s=routing.redis_timeout_s,
            max_sessions=routing.max_session_bindings,
        )
    return LocalState(routing.session_ttl_s, routing.max_session_bindings)


def _routing_settings(routing: RoutingSettings, engine_block_size: int) -> RoutingSettings:
    """The prefix index must hash blocks of the engines' size: theirs wins."""
    if engine_block_size and engine_block_size != routing.block_size:
        log.warning(
            "engines use KV blocks of %d tokens, not --block-size %d: using %d",
            engine_block_size,
            routing.block_size,
            engine_block_size,
        )
        return replace(routing, block_size=engine_block_size)
    return routing


def install_middleware(
    app: FastAPI,
    settings: RouterSettings,
    metrics: RouterMetrics,
    rate_limiter: RateLimiter | None = None,
) -> Limiter:
    """Outermost first: accounting (so 401s, 413s and 429s are counted too),
    body limits (size and time, before anything reads a body), then API keys
    (an unauthenticated request never takes a queue place), rate limits (per
    accepted key), then admission. Starlette wraps in reverse order of
    `add_middleware`."""
    admission = settings.admission
    limiter = Limiter(
        admission.max_concurrent_requests,
        admission.max_queued_requests,
        admission.queue_timeout_s,
        metrics,
    )
    app.add_middleware(AdmissionMiddleware, limiter=limiter)
    if rate_limiter is not None:
        app.add_middleware(RateLimits, limiter=rate_limiter, keyed=bool(settings.api_keys))
    app.add_middleware(ApiKeyAuth, keys=settings.api_keys, metrics=metrics)
    app.add_middleware(BodyLimits, settings=settings.body)
    app.add_middleware(RequestAccounting, metrics=metrics)
    return limiter


def create_app(settings: RouterSettings, source: PodSource | None = None) -> FastAPI:
    """The router app; its pods come from ``source`` (default: the flags' static list)."""
    metrics = RouterMetrics()
    source = source or pod_source(settings.discovery, settings.pods(), metrics)
    rate_limiter = (
        RateLimiter(settings.rate_limits, metrics) if settings.rate_limits.enabled else None
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # gRPC channels belong to the serving event loop: create them here.
        specs = await source.initial()
        tls = TlsFiles(settings.tls) if settings.tls.enabled else None
        info = await _model_info(
            [s.name for s in specs],
            tls.channel_credentials() if tls is not None else None,
            settings.tls.grpc_tls_server_name,
        )
        card = ModelCard(
            name=settings.served_model_name or info.served_model_name,
            max_model_len=info.max_model_len,
            created=int(time.time()),
        )
        routing = _routing_settings(settings.routing, info.block_size)
        core = RoutingCore(routing)
        state = shared_state(routing)
        pool = PodPool(
            core,
            settings.poll_interval_s,
            remove_grace_s=settings.shutdown_grace_s,
            tls=tls,
            shared_streams=settings.engine_streams == "shared",
        )
        for spec in specs:
            pool.add_pod(spec)
        metrics.watch(core, pool, state)
        retention = SessionRetention(settings.retention, routing.block_size)
        replica = Replica(core, state)
        prefetcher = (
            SessionPrefetcher(routing.prefetch, pool, replica, metrics, settings.poll_interval_s)
            if routing.prefetch.session_prefetch
            else None
        )
        template = Path(settings.chat_template).read_text() if settings.chat_template else None
        caches = settings.caches
        tokenizer = await asyncio.to_thread(
            ChatTokenizer,
            Path(settings.model or info.model_path),
            template,
            caches.tokenizer_cache_sessions,
            caches.tokenizer_cache_tokens,
        )
        tool_parser = (
            await asyncio.to_thread(AutoParser, settings.tool_call_parser, tokenizer.hf_tokenizer)
            if settings.tool_call_parser
            else None
        )
        reasoning = (
            await asyncio.to_thread(
                ReasoningParsers, settings.reasoning_parser, tokenizer.hf_tokenizer
            )
            if settings.reasoning_parser
            else None
        )
        hf_tokenizer = tokenizer.hf_tokenizer
        orchestrator = Orchestrator(
            pool,
            replica,
            metrics,
            retention,
            prefetcher,
            max_migrations=settings.max_migrations,
            request_timeout_s=settings.request_timeout_s,
            # As the engines' incremental detokenizer: no clean-up of spaces.
            detokenize=lambda ids: hf_tokenizer.decode(
                ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
            ),
        )
        await state.start()
        await pool.poll_once()
        pool.start()
        if prefetcher is not None:
            prefetcher.start()
        watch = asyncio.create_task(source.watch(pool), name="pod-source")
        requests = EngineRequests(card, routing.session_header, settings.retention.end_header)
        responder = Responder(
            MeteredOrchestrator(orchestrator) if rate_limiter is not None else orchestrator,
            metrics,
            settings.request_timeout_s,
        )
        chat_serving = ChatServing(requests, responder, tokenizer, tool_parser, reasoning)
        store = ResponseStore(caches.responses_store_max, caches.responses_store_max_chars)
        metrics.watch_tables(
            lambda: bounded_tables(
                core, state, retention, tokenizer, store, prefetcher, rate_limiter
            )
        )
        app.state.parts = RouterParts(
            card=card,
            core=core,
            chat=chat_serving,
            completions=CompletionsServing(requests, responder, tokenizer),
            messages=MessagesServing(chat_serving),
            responses=ResponsesServing(chat_serving, store),
            tokenize=TokenizeServing(requests, tokenizer),
        )
        log.info(
            "router ready on http://%s:%d serving %s (prefill=%s decode=%s engines=%s, "
            "policy %s, KV events from %d pods; KV retention %s, pins %gs; "
            "admission %s running, %d queued; API keys %s)",
            settings.host,
            settings.port,
            card.name,
            settings.prefill,
            settings.decode,
            settings.engines,
            routing.policy.policy,
            sum(1 for s in specs if s.kv_events),
            settings.retention.policy,
            settings.retention.ttl_s,
            settings.admission.max_concurrent_requests or "unlimited",
            settings.admission.max_queued_requests,
            f"required ({len(settings.api_keys)})" if settings.api_keys else "off",
        )
        with startup_heap_frozen():
            try:
                yield
            finally:
                await cancel_and_wait(watch)
                if prefetcher is not None:
                    await prefetcher.close()
                await orchestrator.drain_background()
                await pool.close()
                await state.close()

    app = FastAPI(title="Tandem router", lifespan=lifespan)
    app.state.metrics = metrics
    install_middleware(app, settings, metrics, rate_limiter)
    install_error_handlers(app)
    for family in (chat, messages, responses, completions, tokenize, models, operations):
        app.include_router(family.router)
    return app


__all__ = ["create_app", "OpenAIError"]
