"""Bounded admission (services/router/admission.py) through the router's own
middleware stack (`app.install_middleware`) in front of a fake FastAPI app
whose generation endpoints wait on events, so the tests decide when each
request finishes. Fast; no engines."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client import generate_latest

from services.router.admission import AdmissionMiddleware, AdmissionSettings, Limiter, Rejected
from services.router.app import install_middleware
from services.router.config import RouterSettings, parse_settings
from services.router.errors import install_error_handlers
from services.router.metrics import RouterMetrics
from tests.helpers import metric_value


class FakeRouter:
    """POST /v1/completions with {"id": X} starts, then waits for `finish(X)`.
    POST /v1/chat/completions streams "one", waits for `finish(X)`, streams
    "two". {"id": X, "fail": true} raises instead."""

    def __init__(
        self,
        *,
        running: int = 2,
        queued: int = 2,
        timeout: float = 30.0,
        api_keys: tuple[str, ...] = (),
    ) -> None:
        self.metrics = RouterMetrics()
        settings = RouterSettings(
            engines=["fake:1"],
            admission=AdmissionSettings(
                max_concurrent_requests=running, max_queued_requests=queued, queue_timeout_s=timeout
            ),
            api_keys=api_keys,
        )
        self.started: list[str] = []
        self._gates: dict[str, asyncio.Event] = {}
        app = FastAPI()
        self.limiter = install_middleware(app, settings, self.metrics)
        install_error_handlers(app)

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            await self._enter(body)
            await self._gate(body["id"]).wait()
            return {"id": body["id"]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            await self._enter(body)

            async def stream():
                yield "data: one\n\n"
                await self._gate(body["id"]).wait()
                yield "data: two\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": []}

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            return generate_latest(self.metrics.registry).decode()

        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
            base_url="http://router",
        )

    async def _enter(self, body: dict) -> None:
        self.started.append(body["id"])
        if body.get("fail"):
            raise RuntimeError("handler failed")

    def _gate(self, request_id: str) -> asyncio.Event:
        return self._gates.setdefault(request_id, asyncio.Event())

    def finish(self, request_id: str) -> None:
        self._gate(request_id).set()

    def send(self, request_id: str, path: str = "/v1/completions", **extra) -> asyncio.Task:
        return asyncio.create_task(self.client.post(path, json={"id": request_id, **extra}))

    def metric(self, name: str, labels: str = "") -> float:
        return metric_value(generate_latest(self.metrics.registry).decode(), name, labels)


async def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def assert_429(response: httpx.Response) -> int:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests"
    assert error["param"] is None and "retry after" in error["message"]
    retry_after = int(response.headers["Retry-After"])
    assert retry_after >= 1
    return retry_after


async def test_running_and_queued_are_bounded_then_429():
    r = FakeRouter(running=2, queued=1)
    a, b = r.send("a"), r.send("b")
    await until(lambda: r.started == ["a", "b"])
    c = r.send("c")
    await until(lambda: r.limiter.queued == 1)
    assert r.metric("tandem_router_requests_running") == 2
    assert r.metric("tandem_router_requests_queued") == 1

    assert_429(await r.client.post("/v1/completions", json={"id": "d"}))
    assert "d" not in r.started and not c.done()
    assert r.metric("tandem_router_requests_rejected_total", 'reason="queue_full"') == 1

    r.finish("a")
    await until(lambda: "c" in r.started)
    for name in ("b", "c"):
        r.finish(name)
    assert [(await t).json()["id"] for t in (a, b, c)] == ["a", "b", "c"]
    assert r.limiter.running == 0 and r.metric("tandem_router_requests_running") == 0
    assert r.metric("tandem_router_queue_wait_seconds_count") == 3  # admitted: a, b, c


async def test_queue_timeout_gets_429():
    r = FakeRouter(running=1, queued=4, timeout=0.2)
    a = r.send("a")
    await until(lambda: r.started == ["a"])
    start = time.monotonic()
    assert_429(await r.client.post("/v1/completions", json={"id": "b"}))
    assert time.monotonic() - start >= 0.2
    assert r.started == ["a"] and r.limiter.queued == 0
    assert r.metric("tandem_router_requests_rejected_total", 'reason="queue_timeout"') == 1
    r.finish("a")
    assert (await a).status_code == 200
    assert r.limiter.running == 0


async def test_queue_is_fifo():
    r = FakeRouter(running=1, queued=5)
    tasks = [r.send("a")]
    await until(lambda: r.started == ["a"])
    for i, name in enumerate(["b", "c", "d", "e"], 1):
        tasks.append(r.send(name))
        await until(lambda i=i: r.limiter.queued == i)  # each queues behind the last
    for i, name in enumerate("abcd", 2):
        r.finish(name)  # frees the one slot: exactly the oldest waiter starts
        await until(lambda i=i: len(r.started) == i)
    assert r.started == ["a", "b", "c", "d", "e"]
    r.finish("e")
    assert [(await t).status_code for t in tasks] == [200] * 5


async def test_queued_client_that_leaves_frees_its_place():
    r = FakeRouter(running=1, queued=1)
    a = r.send("a")
    await until(lambda: r.started == ["a"])
    b = r.send("b")
    await until(lambda: r.limiter.queued == 1)
    b.cancel()  # the client gives up while queued
    await asyncio.gather(b, return_exceptions=True)
    await until(lambda: r.limiter.queued == 0)

    c = r.send("c")  # the queue place is free again: no 429
    await until(lambda: r.limiter.queued == 1)
    r.finish("a")
    await until(lambda: "c" in r.started)
    r.finish("c")
    assert (await a).status_code == 200 and (await c).status_code == 200
    assert r.started == ["a", "c"] and r.limiter.running == 0


async def test_disconnect_message_while_queued_leaves_the_queue():
    """The ASGI server's way: http.disconnect arrives while the request waits."""
    metrics = RouterMetrics()
    limiter = Limiter(1, 1, 30.0, metrics)
    called = []

    async def downstream(scope, receive, send):
        called.append(scope["path"])

    held = await limiter.acquire()
    left = asyncio.Event()
    messages = [
        {"type": "http.request", "body": b'{"x":', "more_body": True},
        {"type": "http.request", "body": b"1}", "more_body": False},
    ]

    async def receive():
        if messages:
            return messages.pop(0)
        await left.wait()
        return {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    call = asyncio.create_task(AdmissionMiddleware(downstream, limiter)(scope, receive, send))
    await until(lambda: limiter.queued == 1)
    left.set()
    await asyncio.wait_for(call, 5)
    assert limiter.queued == 0 and sent == [] and called == []
    held.release()
    assert limiter.running == 0


async def test_body_is_replayed_to_the_endpoint():
    limiter = Limiter(1, 1, 30.0, RouterMetrics())
    seen = []

    async def downstream(scope, receive, send):
        seen.append(await receive())

    messages = [
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": False},
    ]

    async def receive():
        return messages.pop(0) if messages else await asyncio.Event().wait()

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    await AdmissionMiddleware(downstream, limiter)(scope, receive, None)
    assert seen == [{"type": "http.request", "body": b"abcd", "more_body": False}]
    assert limiter.running == 0


async def test_slot_is_held_for_the_whole_stream():
    r = FakeRouter(running=1, queued=1)
    a = r.send("a", "/v1/chat/completions")
    await until(lambda: r.started == ["a"])
    b = r.send("b")
    await until(lambda: r.limiter.queued == 1)
    await asyncio.sleep(0.05)
    # The handler returned its StreamingResponse long ago; the stream is not
    # done, so the slot is still taken.
    assert r.started == ["a"] and r.limiter.running == 1
    r.finish("a")
    response = await a
    assert response.status_code == 200 and response.text == "data: one\n\ndata: two\n\n"
    await until(lambda: "b" in r.started)
    r.finish("b")
    assert (await b).status_code == 200
    assert r.limiter.running == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_slot_is_released_after_an_exception(path):
    r = FakeRouter(running=1, queued=0)
    response = await r.client.post(path, json={"id": "a", "fail": True})
    assert response.status_code == 500
    assert r.limiter.running == 0 and r.metric("tandem_router_requests_running") == 0
    b = r.send("b")  # admitted at once: no 429 with a queue of 0
    await until(lambda: "b" in r.started)
    r.finish("b")
    assert (await b).status_code == 200


async def test_slot_is_released_when_a_running_request_is_cancelled():
    r = FakeRouter(running=1, queued=0)
    a = r.send("a", "/v1/chat/completions")
    await until(lambda: r.started == ["a"])
    a.cancel()
    await asyncio.gather(a, return_exceptions=True)
    await until(lambda: r.limiter.running == 0)
    b = r.send("b")
    await until(lambda: "b" in r.started)
    r.finish("b")
    assert (await b).status_code == 200


async def test_zero_means_unlimited():
    r = FakeRouter(running=0, queued=0)
    names = [str(i) for i in range(20)]
    tasks = [r.send(n) for n in names]
    await until(lambda: len(r.started) == 20)
    assert r.limiter.running == 20 and r.limiter.queued == 0
    for n in names:
        r.finish(n)
    assert [(await t).status_code for t in tasks] == [200] * 20
    assert r.limiter.running == 0
    assert r.metric("tandem_router_requests_rejected_total", 'reason="queue_full"') == 0


async def test_health_metrics_and_models_are_never_queued():
    r = FakeRouter(running=1, queued=0)
    a = r.send("a")
    await until(lambda: r.started == ["a"])
    assert_429(await r.client.post("/v1/completions", json={"id": "b"}))
    for path in ("/health", "/v1/models", "/metrics"):
        assert (await r.client.get(path)).status_code == 200, path
    metrics = (await r.client.get("/metrics")).json()
    assert metric_value(metrics, "tandem_router_requests_running") == 1
    assert (
        metric_value(
            metrics, "tandem_router_requests_total", 'endpoint="/v1/completions",status="429"'
        )
        == 1
    )
    r.finish("a")
    await a


async def test_unauthenticated_requests_never_take_a_place():
    r = FakeRouter(running=1, queued=1, api_keys=("k",))
    auth = {"Authorization": "Bearer k"}
    a = asyncio.create_task(r.client.post("/v1/completions", json={"id": "a"}, headers=auth))
    await until(lambda: r.started == ["a"])
    # Checked before admission: 401, and the one queue place stays free.
    assert (await r.client.post("/v1/completions", json={"id": "x"})).status_code == 401
    assert r.limiter.queued == 0 and r.limiter.running == 1
    r.finish("a")
    assert (await a).status_code == 200


async def test_retry_after_follows_recent_durations():
    limiter = Limiter(2, 0, 30.0, RouterMetrics())
    assert limiter.retry_after_s() == 1  # no history yet
    for _ in range(2):
        slot = await limiter.acquire()
        slot._start -= 9.9  # as if it had run for ~10 s
        slot.release()
        slot.release()  # a second release is a no-op
    assert limiter.running == 0
    # Queue of 0 (this request is the only one to wait for), two slots,
    # ~10 s each: ceil(9.9 * 1 / 2) = 5 s.
    assert limiter.retry_after_s() == 5
    held = [await limiter.acquire(), await limiter.acquire()]
    with pytest.raises(Rejected) as rejected:
        await limiter.acquire()
    assert rejected.value.reason == "queue_full"
    assert rejected.value.openai_error.headers == {"Retry-After": "5"}
    for slot in held:
        slot.release()


def test_admission_flags_and_environment(monkeypatch):
    s = parse_settings(["--engine", "e:1"]).admission
    assert (s.max_concurrent_requests, s.max_queued_requests, s.queue_timeout_s) == (256, 512, 30)
    monkeypatch.setenv("TANDEM_ROUTER_MAX_CONCURRENT_REQUESTS", "8")
    monkeypatch.setenv("TANDEM_ROUTER_QUEUE_TIMEOUT_S", "2.5")
    s = parse_settings(["--engine", "e:1", "--max-queued-requests", "3"]).admission
    assert (s.max_concurrent_requests, s.max_queued_requests, s.queue_timeout_s) == (8, 3, 2.5)
    for bad in (["--max-concurrent-requests", "-1"], ["--queue-timeout-s", "0"]):
        with pytest.raises(SystemExit):
            parse_settings(["--engine", "e:1", *bad])
