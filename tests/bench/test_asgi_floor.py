"""The ASGI floor benchmark's app streams what a router streams (every chunk
a chat completion chunk, then [DONE]) and its servers' command lines name
the app; the servers themselves run in `python -m bench.asgi_floor`."""

from __future__ import annotations

import orjson

from bench import asgi_floor


async def test_the_app_streams_every_chunk_then_done():
    sent: list[dict] = []
    requests = iter([{"type": "http.request", "body": b"{}", "more_body": False}])

    async def receive() -> dict:
        return next(requests)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/"}
    await asgi_floor.app(scope, receive, send)
    assert sent[0]["status"] == 200
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[-1] == b"data: [DONE]\n\n" and not sent[-1]["more_body"]
    chunks = [orjson.loads(b.removeprefix(b"data: ")) for b in bodies[:-1]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == [
        f"t{i}" for i in range(asgi_floor.CHUNKS)
    ]


def test_every_server_serves_the_floor_app_on_the_given_port():
    for server, argv in asgi_floor.SERVERS.items():
        line = argv(4321)
        assert "bench.asgi_floor:app" in line, server
        assert line[line.index("--port") + 1] == "4321", server
