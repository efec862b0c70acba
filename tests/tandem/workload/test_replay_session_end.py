"""``ReplayConfig.session_end_header``: each agent's last request, and only
that one, carries the header, sub-agents' too (their session key differs
from their parent's). The endpoint is a real TCP listener answering a
minimal OpenAI stream, so no model server is needed."""

from __future__ import annotations

import asyncio
import json

from tandem.workload.content import BuiltPrompt
from tandem.workload.replay import ReplayConfig, Replayer
from tandem.workload.trace import Request, Session, Subagent

_CHUNK = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "length"}]}
_BODY = f"data: {json.dumps(_CHUNK)}\n\ndata: [DONE]\n\n".encode()


async def _serve(
    seen: list[tuple[str, bool]], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """One HTTP request per connection: records (session, ends) and answers."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode().lower().split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    await reader.readexactly(int(headers["content-length"]))
    seen.append((headers["x-session-id"], headers.get("x-session-end") == "1"))
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(_BODY) + _BODY
    )
    await writer.drain()
    writer.close()


def _request(n: int) -> Request:
    return Request(t=0.0, in_tokens=n, out_tokens=1, hash_ids=[n])


async def _replay(header: str | None) -> list[tuple[str, bool]]:
    seen: list[tuple[str, bool]] = []
    server = await asyncio.start_server(lambda r, w: _serve(seen, r, w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    subs = [
        Subagent([_request(3), _request(4)], agent_id="sa1"),
        Subagent([_request(5)], agent_id="sa2"),
    ]
    # The session's last entry is a request after the sub-agents join.
    session = Session(
        id="s", block_size=64, requests=[_request(1), _request(2), *subs, _request(6)]
    )
    prompts = {
        id(r): BuiltPrompt([{"role": "user", "content": "hi"}], [1], 1)
        for _, _, r in session.iter_requests()
    }
    cfg = ReplayConfig(
        url=f"http://127.0.0.1:{port}",
        model="m",
        concurrency=1,
        progress=False,
        timeout_s=30,
        session_end_header=header,
    )
    result = await Replayer(cfg, [session], prompts, salt="k").run()
    server.close()
    await server.wait_closed()
    assert all(r.ok for r in result.records), [r.error for r in result.records]
    return seen


async def test_each_agents_last_request_ends_its_session():
    seen = await _replay("x-session-end")
    ended = sorted(key for key, ends in seen if ends)
    assert ended == ["k:s", "k:s:sa1", "k:s:sa2"]
    assert len(seen) == 6
    assert seen[-1] == ("k:s", True)  # the parent's last turn, not its turn before the fork


async def test_off_by_default():
    seen = await _replay(None)
    assert len(seen) == 6 and not any(ends for _, ends in seen)
