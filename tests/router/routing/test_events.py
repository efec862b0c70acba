"""KV event decoding and the subscriber's gap recovery against vLLM's real ZMQ
publisher (its replay buffer and ROUTER socket), on loopback. No mocks."""

import asyncio

import msgspec
import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from common.ports import free_port
from services.router.routing.events import KvEventSubscriber, apply_batch, decode_batch
from services.router.routing.index import PrefixIndex


def stored(hashes, parent=None):
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(2 * len(hashes))),
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_decodes_what_vllm_encodes():
    batch = KVEventBatch(
        ts=1.5,
        events=[
            stored([11, 12]),
            BlockRemoved(block_hashes=[12], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    ours = decode_batch(msgspec.msgpack.encode(batch))
    assert ours.ts == 1.5 and len(ours.events) == 3
    assert ours.events[0].block_hashes == [11, 12]
    idx = PrefixIndex()
    apply_batch(
        idx,
        "p",
        decode_batch(
            msgspec.msgpack.encode(
                KVEventBatch(
                    ts=0,
                    events=[stored([11, 12, 13]), BlockRemoved(block_hashes=[13], medium="GPU")],
                )
            )
        ),
    )
    assert idx.match([11, 12, 13], 0)["p"] == 2
    apply_batch(idx, "p", ours)
    assert idx.held_blocks("p") == 0


def test_blocks_written_to_the_kv_store_are_not_held_on_the_pod():
    """vLLM's Mooncake store connector publishes its writes on the engine's
    stream with medium "cpu" and never removes them."""
    idx = PrefixIndex()
    to_store = BlockStored(
        block_hashes=[21, 22],
        parent_block_hash=None,
        token_ids=list(range(4)),
        block_size=2,
        lora_id=None,
        medium="cpu",
        lora_name=None,
    )
    apply_batch(
        idx,
        "p",
        decode_batch(msgspec.msgpack.encode(KVEventBatch(ts=0, events=[stored([11]), to_store]))),
    )
    assert idx.held_blocks("p") == 1
    assert idx.match([21, 22], 0).get("p", 0) == 0
    apply_batch(
        idx,
        "p",
        decode_batch(
            msgspec.msgpack.encode(
                KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=[11], medium="cpu")])
            )
        ),
    )
    assert idx.held_blocks("p") == 1


async def wait_for(cond, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.fixture
def publisher():
    pub_port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kv",
    )
    yield pub, pub_port, replay_port
    pub.shutdown()


async def test_late_joiner_replays_missed_batches(publisher):
    pub, pub_port, replay_port = publisher
    # Five batches go out before anyone listens: PUB drops them for us.
    for i in range(5):
        pub.publish(KVEventBatch(ts=0, events=[stored([100 + i])]))
    await asyncio.sleep(0.3)
    idx = PrefixIndex()
    sub = KvEventSubscriber(
        "p", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", idx
    )
    sub.start()
    try:
        await asyncio.sleep(0.3)  # let the SUB connect
        pub.publish(KVEventBatch(ts=0, events=[stored([105])]))
        await wait_for(lambda: sub.stats.last_seq == 5)
        assert sub.stats.gaps == 1 and sub.stats.replayed == 5 and sub.stats.lost == 0
        assert idx.held_blocks("p") == 6
        pub.publish(KVEventBatch(ts=0, events=[AllBlocksCleared()]))
        await wait_for(lambda: sub.stats.last_seq == 6)
        assert idx.held_blocks("p") == 0
    finally:
        await sub.stop()


async def test_gap_mid_stream_and_publisher_restart():
    """Feed seqs directly: a skipped seq is replayed; seq 0 again means a restart."""
    pub_port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kv",
    )
    try:
        payloads = []
        for i in range(3):
            b = KVEventBatch(ts=0, events=[stored([200 + i])])
            pub.publish(b)
            payloads.append(msgspec.msgpack.encode(b))
        await asyncio.sleep(0.3)
        idx = PrefixIndex()
        sub = KvEventSubscriber(
            "p", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", idx
        )
        import zmq.asyncio

        sub._ctx = zmq.asyncio.Context()
        await sub.handle(0, payloads[0])
        await sub.handle(2, payloads[2])  # seq 1 lost on the wire: replayed
        assert sub.stats.gaps == 1 and sub.stats.replayed == 1
        assert idx.held_blocks("p") == 3
        await sub.handle(0, msgspec.msgpack.encode(KVEventBatch(ts=0, events=[stored([7])])))
        assert sub.stats.restarts == 1
        assert idx.match([200], 0)["p"] == 0 and idx.match([7], 0)["p"] == 1
        await sub.stop()
    finally:
        pub.shutdown()
