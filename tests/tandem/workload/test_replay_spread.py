"""Several endpoint URLs (router replicas): the replay sends each request to
the next one in turn, as a per-request balancer in front of replicas does."""

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


def test_url_lists():
    assert urls("http://a:1") == ["http://a:1"]
    assert urls("http://a:1, http://b:2,") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError):
        urls(" , ")
