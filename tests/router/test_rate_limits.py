"""Per-client rate limits (services/router/rate_limits.py) through the router's
own middleware stack (`app.install_middleware`) in front of a fake FastAPI
app whose generation endpoints stream from a fake orchestrator through the
real `MeteredOrchestrator`, on a clock the tests move. Fast; no engines."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import generate_latest

from common.proto import engine_pb2 as pb
from common.router import RateLimitSettings
from services.router.app import install_middleware
from services.router.config import RouterSettings, parse_settings
from services.router.errors import install_error_handlers
from services.router.metrics import RouterMetrics
from services.router.pd import EngineRequest
from services.router.rate_limits import (
    _METER,
    MeteredOrchestrator,
    RateLimiter,
    TokenBucket,
)
from tests.helpers import metric_value

PROMPT = 50  # prompt tokens of every fake request
COMPLETION = 20  # completion tokens, 4 per message


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeOrchestrator:
    def __init__(self) -> None:
        self.closed = 0

    async def stream(self, ereq: EngineRequest):
        try:
            for _ in range(COMPLETION // 4):
                yield pb.GenerateResponse(token_ids=[1, 2, 3, 4], text="abcd")
        finally:
            self.closed += 1


def engine_request() -> EngineRequest:
    return EngineRequest("r", list(range(PROMPT)), pb.SamplingParams(), None, 0.0)


class Router:
    def __init__(self, limits: RateLimitSettings, api_keys: tuple[str, ...] = ()) -> None:
        self.metrics = RouterMetrics()
        self.clock = Clock()
        self.limiter = RateLimiter(limits, self.metrics, self.clock)
        settings = RouterSettings(engines=["fake:1"], api_keys=api_keys, rate_limits=limits)
        app = FastAPI()
        install_middleware(app, settings, self.metrics, self.limiter)
        install_error_handlers(app)
        orchestrator = MeteredOrchestrator(FakeOrchestrator())

        async def body():
            async for message in orchestrator.stream(engine_request()):
                yield message.text

        for path in ("/v1/chat/completions", "/v1/messages"):

            @app.post(path)
            async def generate():
                return StreamingResponse(body(), media_type="text/event-stream")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": []}

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        self.app = app

    def client(self, key: str | None = None, address: str = "10.0.0.1") -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app, client=(address, 40000)),
            base_url="http://router",
            headers={"Authorization": f"Bearer {key}"} if key else None,
        )

    def limited(self, limit: str) -> float:
        return metric_value(
            generate_latest(self.metrics.registry).decode(),
            "tandem_router_rate_limited_total",
            f'limit="{limit}"',
        )


def assert_429(response: httpx.Response, retry_after: int) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["Retry-After"] == str(retry_after)
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert f"retry after {retry_after}s" in error["message"]


def test_bucket_refills_to_capacity_and_goes_into_debt():
    bucket = TokenBucket(capacity=2, rate=1.0, now=0.0)
    assert bucket.take(1, 0.0) == 0 and bucket.take(1, 0.0) == 0
    assert bucket.take(1, 0.25) == pytest.approx(0.75)  # nothing taken
    assert bucket.take(1, 1.0) == 0
    assert bucket.take(1, 100.0) == 0 and bucket.level == 1  # capped at capacity
    bucket.charge(5, 100.0)
    assert bucket.level == -4 and bucket.in_debt_for(100.0) == pytest.approx(5.0)
    assert bucket.in_debt_for(104.5) == pytest.approx(0.5)
    assert bucket.in_debt_for(105.0) == 0  # holds a whole token again


async def test_requests_per_second_per_key():
    router = Router(RateLimitSettings(rate_limit_requests_per_s=1, rate_limit_burst=2), ("a", "b"))
    async with router.client("a") as a, router.client("b") as b:
        assert (await a.get("/v1/models")).status_code == 200
        assert (await a.get("/v1/models")).status_code == 200
        assert_429(await a.get("/v1/models"), 1)
        # Another key has its own bucket; /health is never limited.
        assert (await b.get("/v1/models")).status_code == 200
        assert (await a.get("/health")).status_code == 200
        assert router.limited("requests") == 1
        router.clock.now += 1.0
        assert (await a.get("/v1/models")).status_code == 200


async def test_without_keys_each_address_has_a_bucket():
    router = Router(RateLimitSettings(rate_limit_requests_per_s=0.5))
    async with router.client(address="10.0.0.1") as one, router.client(address="10.0.0.2") as two:
        assert (await one.get("/v1/models")).status_code == 200
        assert_429(await one.get("/v1/models"), 2)  # one token per 2 s
        assert (await two.get("/v1/models")).status_code == 200


async def test_refusal_on_messages_speaks_anthropic():
    router = Router(RateLimitSettings(rate_limit_requests_per_s=1))
    async with router.client() as client:
        assert (await client.post("/v1/messages")).status_code == 200
        response = await client.post("/v1/messages")
    assert response.status_code == 429 and response.headers["Retry-After"] == "1"
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"


async def test_tokens_per_minute_charge_prompt_and_completion():
    # 60 tokens a minute: one a second. A request costs 50 + 20 = 70: the
    # first is admitted with the bucket full and leaves it 10 in debt.
    router = Router(RateLimitSettings(rate_limit_tokens_per_min=60), ("k",))
    async with router.client("k") as client:
        response = await client.post("/v1/chat/completions")
        assert response.status_code == 200 and response.text == "abcd" * 5
        (bucket,) = [c.tokens for c in router.limiter._clients.values()]
        assert bucket.level == pytest.approx(60 - PROMPT - COMPLETION)
        # In debt: refused until a token is back (11 s); other endpoints still answer.
        assert_429(await client.post("/v1/chat/completions"), 11)
        assert (await client.get("/v1/models")).status_code == 200
        assert router.limited("tokens") == 1
        router.clock.now += 10.5
        assert_429(await client.post("/v1/chat/completions"), 1)
        router.clock.now += 1.0
        assert (await client.post("/v1/chat/completions")).status_code == 200


async def test_completion_tokens_charged_as_generated():
    fake = FakeOrchestrator()
    charged: list[int] = []
    token = _METER.set(charged.append)
    try:
        stream = MeteredOrchestrator(fake).stream(engine_request())
        await anext(stream)
        assert charged == [PROMPT, 4]  # prompt at the start, then each message's tokens
        await anext(stream)
        assert charged == [PROMPT, 4, 4]
        # A client gone mid-stream closes the inner stream at once (its abort runs).
        await stream.aclose()
        assert fake.closed == 1
    finally:
        _METER.reset(token)
    # Outside a limited request nothing is charged and the stream is the inner one.
    async with contextlib.aclosing(MeteredOrchestrator(fake).stream(engine_request())) as plain:
        assert len([m async for m in plain]) == COMPLETION // 4
    assert charged == [PROMPT, 4, 4]


def test_forgets_the_least_recently_seen_client_beyond_the_bound():
    limiter = RateLimiter(
        RateLimitSettings(rate_limit_requests_per_s=1, rate_limit_max_clients=2),
        RouterMetrics(),
        Clock(),
    )
    for client in ("a", "b", "a", "c"):
        assert limiter.admit(client, False)[0] is None or client == "a"
    assert list(limiter._clients) == ["a", "c"] and limiter.evictions == 1


def test_flags(monkeypatch):
    monkeypatch.setenv("TANDEM_ROUTER_RATE_LIMIT_TOKENS_PER_MIN", "1000")
    settings = parse_settings(
        ["--engine", "e:1", "--rate-limit-requests-per-s", "2.5", "--rate-limit-burst", "5"]
    )
    assert settings.rate_limits == RateLimitSettings(2.5, 5, 1000)
    with pytest.raises(SystemExit):
        parse_settings(["--engine", "e:1", "--rate-limit-requests-per-s", "-1"])
