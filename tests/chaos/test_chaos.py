"""The short chaos sequence on the shared session stack (its engines, two
router replicas of the harness's own in front of them sharing a Redis): the
agentic replay at steady concurrency while, at once, the decode engine is
SIGKILLed mid-stream, a router replica is SIGKILLed and Redis is killed and
comes back empty; the harness restarts each. The phase must keep every
promise (bench/chaos.py): no hang, no truncated stream, only the failures
these faults may cause, capacity back within its bound, no KV left held on
any engine. In `make test` (last among the stack tests: it kills the stack's
decode); `make chaos` runs every fault, one at a time and overlapping."""

from __future__ import annotations

import asyncio

import pytest

from bench.chaos import MIGRATABLE, SHORT, Chaos, LoadShape, table

pytestmark = [pytest.mark.stack, pytest.mark.chaos]

# Past this the test fails rather than hang CI; the harness's own bounds
# (engine back within 420 s, each request's deadline, the KV lease) come first.
DEADLINE_S = 900


def _lease_s(stack) -> float:
    args = stack.config.engine_args
    return float(args[args.index("--kv-lease-s") + 1])


async def test_short_chaos_sequence_keeps_every_promise(stack, model_dir, tmp_path):
    h = Chaos(
        stack,
        str(model_dir),
        tmp_path,
        LoadShape(concurrency=3, deadline_s=90.0, lead_s=3.0, tail_s=3.0),
        kv_lease_s=_lease_s(stack),
    )
    try:
        async with asyncio.timeout(DEADLINE_S):
            await h.start()
            rows = await h.run([SHORT])
    finally:
        await h.close()
    print("\n" + table(rows))
    (row,) = rows
    assert row.requests > 0, row
    assert not row.violations, table(rows)
    # Streams were in flight on the killed decode: each ended in an explicit
    # error, lost with its decode pod or with its router replica.
    assert row.kinds[MIGRATABLE] + row.kinds["connection_lost"] >= 1, table(rows)
    # Each fault took something down that the harness brought back.
    restarted = {s.name: s.restarts for s in h.services}
    assert restarted["decode-0"] >= 1 and restarted["chaos-router-1"] >= 1
    assert restarted["redis"] >= 1
