"""Against ONE real vLLM engine (CPU, SmolLM2-135M): the router's block hashes
equal the hashes in the engine's KV events, and on a short multi-turn replay
the predicted cached tokens equal the engine's reported ``cached_tokens``. No
mocks: real engine host, real gRPC, real ZMQ events. The engine is one of the
session's aggregated engines (tests/conftest.py), talked to directly: the
routing core here is the test's own, in-process. These prompts share no block
with other tests' prompts, so what else the engine served does not count.
Predictions from the router's own decisions are switched off here
(``predicted_ttl_with_events_s=0``), so every hit comes from KV events alone.
"""

import asyncio
import time
import uuid

import grpc
import pytest
from transformers import AutoTokenizer

from common.model import resolve_model
from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc
from services.router.routing import PodSpec, RouteRequest, RoutingCore, RoutingSettings, SharedView
from services.router.routing.events import KvEventSubscriber
from services.router.routing.sessions import IncrementalTokenizer
from tests.helpers import AGGREGATED_BLOCK_SIZE

pytestmark = pytest.mark.stack

BLOCK_SIZE = AGGREGATED_BLOCK_SIZE  # small blocks: short prompts still span many blocks
# The engines share a Mooncake store, whose connector publishes what it puts
# there on the same stream (medium "cpu", the store's chunks; the router's
# index skips them: services/router/routing/events.py). vLLM calls the
# engine's own KV cache "GPU", even on CPU.
ENGINE_MEDIUM = "GPU"


@pytest.fixture(scope="module")
def engine(aggregated_engines):
    """engine-0 of the session-wide aggregated engines (tests/conftest.py),
    spoken to over gRPC directly: its gRPC address and KV-event endpoints."""
    proc = next(p for p in aggregated_engines.procs if p.name == "engine-0")
    pub, replay = proc.kv_events.split(",")
    return proc.grpc, pub, replay


async def wait_until_held(core, pod, hashes, timeout=60.0):
    deadline = time.monotonic() + timeout
    while core.index.match(hashes, time.monotonic())[pod] < len(hashes):
        if time.monotonic() > deadline:
            pytest.fail(f"engine events for {len(hashes)} blocks did not arrive in {timeout} s")
        await asyncio.sleep(0.05)


async def generate(stub, tokens, max_tokens=8, cache_salt=None):
    req = pb.GenerateRequest(
        request_id=uuid.uuid4().hex,
        token_ids=tokens,
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )
    if cache_salt:
        req.cache_salt = cache_salt
    text, usage = "", None
    async for msg in stub.Generate(req, timeout=120):
        text += msg.text
        if msg.HasField("usage"):
            usage = msg.usage
    return text, usage.cached_tokens


def events_core(address, pub, replay, **settings):
    """A routing core for the one engine, healthy, and a subscriber feeding its index."""
    spec = PodSpec(address, kv_events=pub, kv_events_replay=replay)
    core = RoutingCore(RoutingSettings(block_size=BLOCK_SIZE, **settings), [spec])
    core.update_pod(address, time.monotonic(), healthy=True)
    return core, KvEventSubscriber(address, pub, replay, core.index)


async def test_prediction_matches_engine_on_multi_turn_replay(engine):
    address, pub, replay = engine
    core, sub = events_core(address, pub, replay, predicted_ttl_with_events_s=0.0)
    stored_events = []  # (block_hashes, token_ids) from the engine
    sub.on_batch = lambda pod, batch: stored_events.extend(
        (e.block_hashes, e.token_ids, e.parent_block_hash)
        for e in batch.events
        if type(e).__name__ == "BlockStored"
    )
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    inc = IncrementalTokenizer(tok)
    sub.start()
    results = []  # (predicted, actual)
    sent_hashes = set()
    try:
        await asyncio.sleep(0.5)  # SUB connects before the first event
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.EngineStub(ch)
            for session in range(2):
                rules = " ".join(f"Rule {i}: answer in at most {i + 3} words." for i in range(20))
                msgs = [{"role": "system", "content": f"You are agent {session}. {rules}"}]
                for turn in range(4):
                    msgs.append(
                        {
                            "role": "user",
                            "content": f"Session {session} turn {turn}: name a colour "
                            f"and a number above {turn * 13}.",
                        }
                    )
                    tokens = inc.encode(inc.render_chat(msgs), f"s{session}")
                    salt = "tenant-x" if session == 1 else None
                    decision = core.route(
                        RouteRequest(tokens, session=f"s{session}", cache_salt=salt),
                        SharedView(),
                        time.monotonic(),
                    )
                    sent_hashes.update(core.hasher.event_hashes(tokens, salt))
                    text, cached = await generate(stub, tokens, cache_salt=salt)
                    core.report_prefill(decision, time.monotonic())
                    core.release(decision)
                    results.append((decision.predicted_cached_tokens, cached))
                    msgs.append({"role": "assistant", "content": text})
                    # events flush once per scheduler step, just after the reply
                    await wait_until_held(core, address, core.hasher.event_hashes(tokens, salt))
    finally:
        await sub.stop()

    agree = sum(p == a for p, a in results)
    print(
        f"\ncached-token agreement: {agree}/{len(results)} requests; "
        f"(predicted, reported): {results}"
    )
    assert sub.stats.batches > 0 and sub.stats.lost == 0
    # Every prompt block the engine published hashes as the router computed it.
    published = {h for hashes, _, _ in stored_events for h in hashes}
    prompt_blocks_published = sent_hashes & published
    print(
        f"hash agreement: {len(prompt_blocks_published)}/{len(sent_hashes)} router-computed "
        f"prompt blocks seen in engine events"
    )
    assert prompt_blocks_published == sent_hashes
    # Each later turn reuses the previous turns' prefix: hits must be non-trivial.
    assert sum(a for _, a in results) > 0
    assert agree == len(results), results


async def test_late_join_replay_and_event_hashes_from_tokens(engine):
    """A router that starts after the engine served requests recovers them by replay;
    every root BlockStored of the engine's KV cache has hashes that recompute
    from its own token ids."""
    address, pub, replay = engine
    first = list(range(1000, 1000 + 5 * BLOCK_SIZE + 3))
    second = list(range(3000, 3000 + 3 * BLOCK_SIZE + 1))
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.EngineStub(ch)
        await generate(stub, first, max_tokens=4)  # nobody listening yet
        core, sub = events_core(address, pub, replay)
        events = []
        sub.on_batch = lambda pod, b: events.extend(
            e for e in b.events if type(e).__name__ == "BlockStored"
        )
        sub.start()
        try:
            await asyncio.sleep(0.5)
            await generate(stub, second, max_tokens=4)  # its events reveal the gap
            await wait_until_held(core, address, core.hasher.event_hashes(second))
            await wait_until_held(core, address, core.hasher.event_hashes(first))
        finally:
            await sub.stop()
    stats = sub.stats
    assert stats.gaps >= 1 and stats.replayed > 0 and stats.lost == 0, stats
    checked = ok = 0
    for e in events:
        if (
            e.medium == ENGINE_MEDIUM
            and e.parent_block_hash is None
            and all(k is None for k in e.extra_keys or [])
        ):
            ours = core.hasher.event_hashes(e.token_ids)
            checked += len(ours)
            ok += sum(a == b for a, b in zip(ours, e.block_hashes))
    print(
        f"\nroot-chain event hashes recomputed from event tokens: {ok}/{checked}; "
        f"replayed {stats.replayed} batches"
    )
    assert checked > 0 and ok == checked, [
        (e.parent_block_hash, e.extra_keys, len(e.token_ids)) for e in events[:5]
    ]
