"""Several endpoint URLs (router replicas): the replay sends each request to
the next one in turn, as a per-request balancer in front of replicas does,
and tries a refused connection on the next one."""

from __future__ import annotations

import httpx
import pytest

from tandem.workload.endpoint import urls
from tandem.workload.replay import Spread


async def test_requests_alternate_over_the_replicas():
    hits: list[str] = []

    def replica(name: str) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            hits.append(name)
            return httpx.Response(200, text="data: [DONE]\n\n")

        return httpx.MockTransport(handle)

    clients = [httpx.AsyncClient(base_url=f"http://{n}", transport=replica(n)) for n in "ab"]
    spread = Spread(clients)
    for _ in range(5):
        async with spread.stream("POST", "/v1/chat/completions", json={}) as resp:
            assert resp.status_code == 200
    for c in clients:
        await c.aclose()
    assert hits == ["a", "b", "a", "b", "a"]


async def test_a_refused_connection_goes_to_the_next_replica():
    hits: list[str] = []
    down = {"a"}

    def replica(name: str) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            hits.append(name)
            if name in down:
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200, text="ok")

        return httpx.MockTransport(handle)

    clients = [httpx.AsyncClient(base_url=f"http://{n}", transport=replica(n)) for n in "ab"]
    spread = Spread(clients)
    for _ in range(2):
        async with spread.stream("POST", "/v1/chat/completions", json={}) as resp:
            assert (await resp.aread()) == b"ok"
    assert hits == ["a", "b", "b"]  # the first turn fails over; the second is b's own
    down.add("b")
    with pytest.raises(httpx.ConnectError):  # none accepts: the caller sees it
        async with spread.stream("POST", "/v1/chat/completions", json={}):
            pass
    assert hits[3:] == ["a", "b"]
    for c in clients:
        await c.aclose()


def test_url_lists():
    assert urls("http://a:1") == ["http://a:1"]
    assert urls("http://a:1, http://b:2,") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError):
        urls(" , ")
