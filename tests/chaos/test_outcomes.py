"""How the chaos harness (bench/chaos.py) classifies a request's end and
judges a phase: what counts as truncated, as lost to a dead decode (what
migration would save), and which failures break a promise; and the relay
that cuts an engine's KV-event stream. No engines."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.chaos import FAULTS, MIGRATABLE, KvEventsProxy, Outcome, classify, judge, table


def chunk(content: str | None = None, finish: str | None = None) -> str:
    delta = {} if content is None else {"content": content}
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


ERROR = json.dumps(
    {"error": {"message": "decode pod 127.0.0.1:1 is unavailable: Socket closed", "type": "x"}}
)


def test_a_finished_stream_is_ok():
    assert classify([chunk(""), chunk("Hi"), chunk("!", "length"), "[DONE]"])[:2] == ("ok", 2)


def test_a_stream_without_finish_or_done_is_truncated():
    assert classify([chunk("Hi"), chunk("!")])[0] == "truncated"
    # [DONE] without any finish_reason is cut short too.
    assert classify([chunk("Hi"), "[DONE]"])[0] == "truncated"
    # A finish_reason without [DONE]: the stream's end was lost.
    assert classify([chunk("Hi", "stop")])[0] == "truncated"


def test_a_decode_lost_after_tokens_is_what_migration_saves():
    assert classify([chunk("Hi"), ERROR, "[DONE]"])[:2] == (MIGRATABLE, 1)
    # Before any token nothing was streamed: not a migration case.
    assert classify([chunk(""), ERROR, "[DONE]"])[0] == "error_event"


def test_a_broken_connection_is_an_explicit_error_not_a_truncation():
    assert classify([chunk("Hi")], "RemoteProtocolError: peer closed")[0] == "connection_lost"


def test_a_finished_stream_without_output_is_a_failure():
    assert classify([chunk("", "stop"), "[DONE]"])[0] == "no_output"


def test_judge_counts_kinds_and_flags_the_unexpected():
    outcomes = [Outcome(0, 1, k) for k in ("ok", "ok", MIGRATABLE, "http_503", "truncated")]
    row = judge(FAULTS["decode_kill"], outcomes, 42.0)
    assert (row.requests, row.failed, row.migratable) == (5, 3, 1)
    assert row.violations == ["1 truncated"]
    assert judge(FAULTS["redis_restart"], outcomes[:2], None).violations == [
        "capacity not back within 30s"
    ]
    assert "truncated 1" in table([row])


async def test_the_kv_events_relay_passes_bytes_and_cuts_every_connection():
    received: list[bytes] = []

    async def publisher(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"batch-1")
        await writer.drain()
        received.append(await reader.read(100))
        writer.close()

    server = await asyncio.start_server(publisher, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = KvEventsProxy(f"tcp://127.0.0.1:{port}")
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await reader.read(100) == b"batch-1"
        await proxy.cut()
        assert await asyncio.wait_for(reader.read(100), 5) == b""  # closed by the cut
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", proxy.port)
        await proxy.start()  # restored on the same port
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await reader.read(100) == b"batch-1"
        writer.write(b"subscribe")
        await writer.drain()
        await asyncio.sleep(0.2)
        assert received[-1] == b"subscribe"
        writer.close()
    finally:
        await proxy.cut()
        server.close()
