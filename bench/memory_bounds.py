"""The router's tables stop growing at their bounds: distinct KV blocks,
sessions and stored responses driven through the router's public seams, in
process and with no engines, while the memory the tables hold is measured.

* blocks: requests with new prompts routed by the routing core (each one
  predicted on its pod), whose blocks the pod's KV events then confirm
  (``events.apply_batch``): the prefix index and its predicted entries.
* sessions: a new session per request, tokenized incrementally with the
  model's tokenizer (``IncrementalTokenizer``), routed through ``Replica``
  with the local shared state (bindings), given a KV retention hint
  (``SessionRetention``): session bindings, live sessions, the tokenizer's
  cache, retention.
* responses: stored through the Responses API's ``ResponseStore``, the
  evicted ones checked gone (``previous_response_id`` then answers 404).

Memory is what ``tracemalloc`` counts as allocated since the tables were
made (the tokenizer and the interpreter excluded), read at each checkpoint.
The clock advances 1 ms a request, so no TTL or idle window ends an entry
here: only the bounds do. ``make soak-memory`` runs the full scale (10^6
blocks, 10^5 sessions, 10^5 responses); the unit test a smaller one.

    python -m bench.memory_bounds                      # the full scale
    python -m bench.memory_bounds --kinds blocks --blocks 10000,100000,1000000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.router.api.responses.serving import ResponseStore
from services.router.retention import RetentionSettings, SessionRetention
from services.router.routing import (
    IncrementalTokenizer,
    PodSpec,
    Replica,
    RouteRequest,
    RoutingCore,
    RoutingSettings,
    SharedView,
)
from services.router.routing.events import BlockStored, KVEventBatch, apply_batch
from services.router.routing.shared_state import LocalState

BLOCK_SIZE = 16
PODS = (PodSpec("10.0.0.1:1", kv_events="tcp://x:1"), PodSpec("10.0.0.2:1"))

# Growth allowed between two checkpoints past a bound, as a share of the first.
FLAT_TOLERANCE = 0.05


@dataclass(frozen=True)
class Point:
    kind: str
    driven: int  # blocks, sessions or responses driven so far
    entries: dict[str, int]  # per table
    traced_bytes: int
    seconds: float


def _traced(base: int) -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - base


def _core(bound: int) -> RoutingCore:
    core = RoutingCore(
        RoutingSettings(
            block_size=BLOCK_SIZE,
            index_capacity=bound,
            predicted_capacity=max(1, bound // 2),
            max_session_bindings=bound,
            live_max_sessions=bound,
            live_max_blocks=4 * bound,
            live_max_tokens=200 * bound,
        ),
        PODS,
    )
    for pod in PODS:
        core.update_pod(pod.name, 0.0, healthy=True)
    return core


def drive_blocks(marks: Sequence[int], bound: int) -> list[Point]:
    """Distinct blocks, eight a request, routed then confirmed by KV events
    (checkpoints at the first multiple of eight at or past each mark)."""
    points: list[Point] = []
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    core = _core(bound)
    per_request = 8
    tokens = per_request * BLOCK_SIZE
    driven = 0
    request = 0
    while driven < marks[-1]:
        ids = list(range(request * tokens, (request + 1) * tokens))  # never seen before
        now = request * 1e-3
        decision = core.route(RouteRequest(ids), SharedView(), now)
        apply_batch(
            core.index,
            decision.decode_pod,
            KVEventBatch(now, [BlockStored(block_hashes=list(decision.block_hashes))]),
        )
        core.release(decision)
        request += 1
        driven += per_request
        if driven >= marks[len(points)]:
            index = core.index
            points.append(
                Point(
                    "blocks",
                    driven,
                    {"prefix_index": len(index), "predicted_index": index.predicted_entries},
                    _traced(base),
                    time.perf_counter() - start,
                )
            )
    tracemalloc.stop()
    return points


def drive_sessions(marks: Sequence[int], bound: int, tokenizer: Any) -> list[Point]:
    """A new session a request: tokenized, routed (binding), hinted (retention)."""
    points: list[Point] = []
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    core = _core(bound)
    state = LocalState(binding_ttl_s=3600.0, max_sessions=bound)
    replica = Replica(core, state)
    inc = IncrementalTokenizer(tokenizer, max_sessions=bound, max_tokens=200 * bound)
    retention = SessionRetention(
        RetentionSettings(ttl_s=3600.0, max_sessions=bound, max_blocks=4 * bound), BLOCK_SIZE
    )
    system = {"role": "system", "content": "You are a coding agent. Tools: grep, edit, test."}

    async def run() -> None:
        for i in range(marks[-1]):
            session = f"h:agent-{i}"
            text = inc.render_chat(
                [system, {"role": "user", "content": f"Task {i}: fix issue #{i * 7919}."}]
            )
            ids = inc.encode(text, session)
            now = i * 1e-3
            decision = await replica.route(RouteRequest(ids, session=session), now)
            retention.hint(session, "header", decision.block_hashes, now)
            await replica.release(decision, now)
            if i + 1 in marks:
                points.append(
                    Point(
                        "sessions",
                        i + 1,
                        {
                            "session_bindings": state.entries,
                            "live_sessions": len(core.live),
                            "hash_chains": len(core.chains),
                            "tokenizer_sessions": inc.cached_sessions,
                            "retention_sessions": retention.active_sessions,
                            "prefix_index": len(core.index),
                        },
                        _traced(base),
                        time.perf_counter() - start,
                    )
                )

    asyncio.run(run())
    tracemalloc.stop()
    return points


def drive_responses(marks: Sequence[int], bound: int) -> list[Point]:
    """Responses stored as the Responses API stores them, three messages each."""
    points: list[Point] = []
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    store = ResponseStore(max_entries=bound)
    for i in range(marks[-1]):
        response = {
            "id": f"resp_{i:016x}",
            "object": "response",
            "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "Done."}]}],
        }
        conversation = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"Task {i}: fix issue #{i * 7919}."},
            {"role": "assistant", "content": f"Fixed issue #{i * 7919}."},
        ]
        store.put(response, conversation)
        if i + 1 in marks:
            points.append(
                Point(
                    "responses",
                    i + 1,
                    {"stored_responses": store.entries},
                    _traced(base),
                    time.perf_counter() - start,
                )
            )
    oldest = f"resp_{0:016x}"
    if marks[-1] > bound and store.conversation(oldest) is not None:
        raise AssertionError(f"{oldest} is still stored past the bound")
    tracemalloc.stop()
    return points


def flat_after_bound(points: Sequence[Point], tolerance: float = FLAT_TOLERANCE) -> str | None:
    """None when memory grew before the last two checkpoints and stayed
    within ``tolerance`` between them; else what went wrong.

    The last two must both be at least twice the bound: a table that has
    just filled holds less than one whose entries have turned over (its
    hash table settles at a larger size once deletions leave dummies)."""
    if len(points) < 3:
        return "needs three checkpoints: one below the bound, two past it"
    first, before, last = points[0], points[-2], points[-1]
    if not first.traced_bytes < before.traced_bytes:
        return f"{first.kind}: memory did not grow up to the bound ({first} -> {before})"
    growth = (last.traced_bytes - before.traced_bytes) / before.traced_bytes
    if growth > tolerance:
        return (
            f"{last.kind}: memory grew {growth:.1%} from {before.driven} to {last.driven} "
            f"({before.traced_bytes} -> {last.traced_bytes} bytes), over {tolerance:.0%}"
        )
    return None


def table(points: Sequence[Point]) -> str:
    lines = [f"{'kind':<10} {'driven':>9} {'MiB':>8} {'s':>6}  entries"]
    for p in points:
        entries = ", ".join(f"{k}={v}" for k, v in p.entries.items())
        lines.append(
            f"{p.kind:<10} {p.driven:>9} {p.traced_bytes / 2**20:>8.1f} "
            f"{p.seconds:>6.1f}  {entries}"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return sorted(int(float(x)) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory_bounds",
        description=(
            "Drive distinct KV blocks, sessions and stored responses through the router's "
            "tables (in process, no engines) and check their memory stops growing at the "
            "bounds: growth between the last two checkpoints, both past the bound, below "
            f"{FLAT_TOLERANCE:.0%}."
        ),
    )
    parser.add_argument("--kinds", default="blocks,sessions,responses")
    parser.add_argument("--blocks", type=_ints, default=_ints("10000,100000,1000000"))
    parser.add_argument("--block-bound", type=int, default=50_000)
    parser.add_argument("--sessions", type=_ints, default=_ints("1000,10000,100000"))
    parser.add_argument("--session-bound", type=int, default=5_000)
    parser.add_argument("--responses", type=_ints, default=_ints("1000,10000,100000"))
    parser.add_argument("--response-bound", type=int, default=5_000)
    parser.add_argument("--model", default=None, help="tokenizer's model folder")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    failures = []
    for kind in kinds:
        if kind == "blocks":
            points = drive_blocks(args.blocks, args.block_bound)
        elif kind == "sessions":
            from transformers import AutoTokenizer

            from common.model import resolve_model

            tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
            points = drive_sessions(args.sessions, args.session_bound, tokenizer)
        elif kind == "responses":
            points = drive_responses(args.responses, args.response_bound)
        else:
            parser.error(f"--kinds: unknown {kind!r}")
        print(table(points), flush=True)
        failure = flat_after_bound(points)
        if failure:
            failures.append(failure)
    for failure in failures:
        print("FAIL:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
