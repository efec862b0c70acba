"""How the chaos harness (bench/chaos.py) names a replayed request's end
(the replay client judges the stream itself: tests/tandem/workload/
test_replay_streams.py) and judges a phase: what counts as lost to a dead
decode (what migration would save), and which failures break a promise; and
the relay that cuts an engine's KV-event stream. No engines."""

from __future__ import annotations

import asyncio

import pytest

from bench.chaos import FAULTS, MIGRATABLE, KvEventsProxy, judge, kind_of, table
from tandem.workload.replay import RequestRecord


def record(failure: str | None, error: str = "", streamed: int | None = None) -> RequestRecord:
    rec = RequestRecord("s", "", 0, 0, 0.0, 1, 2, 2, 1, ok=failure is None, failure=failure)
    rec.error, rec.output_tokens = error or None, streamed
    return rec


LOST = "error event: decode pod 127.0.0.1:1 is unavailable: Socket closed"


def test_a_decode_lost_after_tokens_is_what_migration_saves():
    assert kind_of(record("error_event", LOST, streamed=3)) == MIGRATABLE
    # Before any token nothing was streamed: not a migration case.
    assert kind_of(record("error_event", LOST)) == "error_event"
    assert kind_of(record("error_event", "error event: bad request", streamed=3)) == "error_event"


def test_the_replays_failures_keep_their_names_and_a_timeout_is_a_hang():
    assert kind_of(record(None)) == "ok"
    for failure in ("http_503", "truncated", "connection_lost", "no_output"):
        assert kind_of(record(failure)) == failure
    assert kind_of(record("timeout")) == "hang"


def test_judge_counts_kinds_and_flags_the_unexpected():
    ends = ["ok", "ok", MIGRATABLE, "http_503", "truncated"]
    row = judge(FAULTS["decode_kill"], ends, 42.0)
    assert (row.requests, row.failed, row.migratable) == (5, 3, 1)
    assert row.violations == ["1 truncated"]
    assert judge(FAULTS["redis_restart"], ends[:2], None).violations == [
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
