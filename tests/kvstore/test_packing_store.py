"""Packed block puts and gets against the real store (Mooncake master and pool
owner, no engines, no mocks): the descriptors come from vLLM's own
``RankLocalStoreLayout`` over caches laid out as vLLM 0.32 allocates them,
so the packed path is checked against exactly what vLLM's connector sends.

* a packed put stores the same bytes as vLLM's one-buffer-per-layer put;
* each reads the other's objects (packing is not a format);
* a missing key fails alone; batches larger than the staging buffer split;
* calls that are not one whole block per key pass through untouched;
* over shared memory (a dummy client attached to the pool owner): the same
  objects, read and written across the two transports, soft pins applied,
  and a clear error when the engine cannot attach.
"""

from __future__ import annotations

import signal
import subprocess

import httpx
import pytest
import torch

from common.ports import free_port
from kernels import pack_blocks_reference
from services.kvstore.api import store_launch, wait_ready
from services.kvstore.packing import SIZE_MISMATCH, BlockPacker, PackingStore
from services.kvstore.shm import ShmUnavailable, attach

pytestmark = pytest.mark.stack

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE = 4, 8, 3, 32, 64


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packing-store")
    launch = store_launch(
        tmp / "kvstore",
        ports=[free_port() for _ in range(6)],
        pool_size="128MB",
        enable_disk=False,
        lease_ttl_ms=500,
    )
    with open(tmp / "kvstore.log", "wb") as log:
        popen = subprocess.Popen(launch.argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(launch.health_url, timeout=120, alive=lambda: popen.poll() is None)
        yield launch
    finally:
        popen.send_signal(signal.SIGTERM)
        popen.wait(30)


@pytest.fixture(scope="module")
def client(launched):
    """The TCP requester every engine of these tests uses (vLLM's own client)."""
    from mooncake.store import MooncakeDistributedStore

    s = launched.settings
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", s.metadata_url, 0, 64 << 20, "tcp", "", s.master_address) == 0
    yield store
    store.close()


@pytest.fixture
def engines(client):
    """Makes engines; unregisters their buffers afterwards (the store refuses
    to register a new buffer that overlaps a stale registration)."""
    made: list[Engine] = []

    def make(seed: int | None = None) -> Engine:
        made.append(Engine(client, seed))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


class Engine:
    """An engine's KV cache as vLLM 0.32 allocates it on CPU (one buffer,
    layer-outer LBHNC views), registered with the store, and the per-block
    descriptors vLLM's store connector builds for it."""

    def __init__(self, store, seed: int | None = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            KeyMetadata,
            RankLocalStoreLayout,
        )

        page = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE
        self.raw = torch.zeros(LAYERS * BLOCKS * page * 4, dtype=torch.uint8)
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            self.raw.copy_(torch.randint(0, 256, self.raw.shape, dtype=torch.uint8, generator=gen))
        flat = self.raw.view(torch.float32)
        self.layers = [
            flat[i * BLOCKS * page : (i + 1) * BLOCKS * page].view(
                BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE
            )
            for i in range(LAYERS)
        ]
        assert store.register_buffer(self.raw.data_ptr(), self.raw.numel()) == 0
        self.layout = RankLocalStoreLayout(KeyMetadata("m", 0, 0, 0, 0), BLOCK_SIZE, BLOCK_SIZE)
        self.layout.register_kv_caches(self.layers, BLOCKS)
        self.packer = BlockPacker.for_regions(
            self.layers, self.layout.kv_caches_base_addr, self.layout.block_len
        )
        self.store = store
        self.packing_stores: list[PackingStore] = []

    def packing(self, staging_bytes: int = 1 << 20, shm=None) -> PackingStore:
        self.packing_stores.append(PackingStore(self.store, self.packer, staging_bytes, shm=shm))
        return self.packing_stores[-1]

    def close(self) -> None:
        for packing in self.packing_stores:
            packing.close()
        self.store.unregister_buffer(self.raw.data_ptr())

    def descriptors(self, block_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        pairs = [self.layout.prepare_value_for_block(b) for b in block_ids]
        return [a for a, _ in pairs], [s for _, s in pairs]

    def block(self, b: int) -> torch.Tensor:
        return pack_blocks_reference(self.layers, [b])[0]


def test_vllm_sends_one_buffer_per_layer_and_packing_one_per_block(engines):
    engine = engines(1)
    addrs, sizes = engine.descriptors([3])
    assert len(addrs[0]) == LAYERS == engine.packer.descriptors_per_block
    assert engine.packer.block_ids(addrs, sizes) == [3]
    assert engine.packer.row_bytes == sum(sizes[0])


def test_packed_put_stores_the_bytes_of_a_per_layer_put(client, engines):
    from mooncake.store import ReplicateConfig

    engine = engines(2)
    packing = engine.packing()
    blocks = [5, 0, 7]
    addrs, sizes = engine.descriptors(blocks)
    packed_keys = [f"packed-{b}" for b in blocks]
    plain_keys = [f"plain-{b}" for b in blocks]
    assert packing.batch_put_from_multi_buffers(packed_keys, addrs, sizes, ReplicateConfig()) == [
        0,
        0,
        0,
    ]
    assert client.batch_put_from_multi_buffers(plain_keys, addrs, sizes, ReplicateConfig()) == [
        0,
        0,
        0,
    ]
    assert packing.packed_keys == 3 and packing.passed_through_calls == 0
    for b, packed, plain in zip(blocks, packed_keys, plain_keys):
        stored = bytes(client.get(packed))
        assert stored == bytes(client.get(plain))
        assert stored == engine.block(b).numpy().tobytes()


def test_packing_and_plain_engines_read_each_others_blocks(client, engines):
    from mooncake.store import ReplicateConfig

    writer = engines(3)
    blocks = [1, 6, 2, 4]
    addrs, sizes = writer.descriptors(blocks)
    assert (
        writer.packing().batch_put_from_multi_buffers(
            [f"p-{b}" for b in blocks], addrs, sizes, ReplicateConfig()
        )
        == [0] * 4
    )
    assert (
        client.batch_put_from_multi_buffers(
            [f"u-{b}" for b in blocks], addrs, sizes, ReplicateConfig()
        )
        == [0] * 4
    )

    # A packing reader loads what a plain writer stored, and the reverse.
    for prefix, packs in (("u", True), ("p", False)):
        reader = engines()
        targets = [3, 0, 7, 5]
        taddrs, tsizes = reader.descriptors(targets)
        keys = [f"{prefix}-{b}" for b in blocks]
        if packs:
            got = reader.packing().batch_get_into_multi_buffers(keys, taddrs, tsizes)
        else:
            got = client.batch_get_into_multi_buffers(keys, taddrs, tsizes)
        assert got == [writer.packer.row_bytes] * 4
        for source, target in zip(blocks, targets):
            assert torch.equal(reader.block(target), writer.block(source))
        untouched = set(range(BLOCKS)) - set(targets)
        assert all(not reader.block(b).any() for b in untouched)


def test_batches_larger_than_the_staging_buffer_and_a_missing_key(engines):
    from mooncake.store import ReplicateConfig

    writer = engines(4)
    packing = writer.packing(staging_bytes=2 * writer.packer.row_bytes)
    assert packing.rows_per_call == 2
    blocks = [0, 1, 2, 3, 4]
    addrs, sizes = writer.descriptors(blocks)
    keys = [f"staged-{b}" for b in blocks]
    assert packing.batch_put_from_multi_buffers(keys, addrs, sizes, ReplicateConfig()) == [0] * 5

    reader = engines()
    targets = [7, 6, 5]
    taddrs, tsizes = reader.descriptors(targets)
    got = reader.packing(staging_bytes=2 * writer.packer.row_bytes).batch_get_into_multi_buffers(
        ["staged-4", "never-written", "staged-0"], taddrs, tsizes
    )
    assert got[0] == got[2] == writer.packer.row_bytes and got[1] < 0
    assert torch.equal(reader.block(7), writer.block(4))
    assert torch.equal(reader.block(5), writer.block(0))
    assert not reader.block(6).any()


def test_an_object_of_another_size_is_not_loaded(client, engines, caplog):
    writer = engines(5)
    small = torch.ones(1024, dtype=torch.uint8)
    assert client.register_buffer(small.data_ptr(), small.numel()) == 0
    assert client.put_from("odd-size", small.data_ptr(), small.numel()) == 0
    client.unregister_buffer(small.data_ptr())
    addrs, sizes = writer.descriptors([2])
    before = writer.block(2).clone()
    got = writer.packing().batch_get_into_multi_buffers(["odd-size"], addrs, sizes)
    assert got == [SIZE_MISMATCH]
    assert "odd-size has 1024 bytes" in caplog.text
    assert torch.equal(writer.block(2), before)


def test_calls_that_are_not_whole_blocks_pass_through(client, engines):
    from mooncake.store import ReplicateConfig

    engine = engines(6)
    packing = engine.packing()
    # Two blocks in one object (what vLLM sends when a chunk spans two blocks).
    addrs, sizes = engine.descriptors([2])
    doubled = [[2 * s for s in sizes[0]]]
    assert engine.packer.block_ids(addrs, doubled) is None
    assert packing.batch_put_from_multi_buffers(
        ["two-blocks"], addrs, doubled, ReplicateConfig()
    ) == [0]
    assert packing.passed_through_calls == 1 and packing.packed_keys == 0
    expected = torch.cat(
        [torch.cat([engine.layers[i][2:4].reshape(-1).view(torch.uint8)]) for i in range(LAYERS)]
    )
    assert bytes(client.get("two-blocks")) == expected.numpy().tobytes()


# -- over shared memory -----------------------------------------------------------


def test_blocks_put_over_shm_read_over_tcp_and_back(launched, client, engines):
    """An engine on the pool owner's host and one elsewhere share every block."""
    from mooncake.store import ReplicateConfig

    owner = launched.settings.pool_owner_address
    writer = engines(7)
    over_shm = writer.packing(staging_bytes=2 * writer.packer.row_bytes, shm=attach(owner))
    assert over_shm.over_shm and over_shm.rows_per_call == 2
    blocks = [6, 1, 4]  # more than the staging buffer holds: two store calls
    addrs, sizes = writer.descriptors(blocks)
    keys = [f"shm-{b}" for b in blocks]
    assert over_shm.batch_put_from_multi_buffers(keys, addrs, sizes, ReplicateConfig()) == [0] * 3
    assert over_shm.packed_keys == 3
    # Existence checks go to the TCP client, and see what shared memory wrote.
    assert over_shm.batch_is_exist([*keys, "shm-never"]) == [1, 1, 1, 0]

    # A TCP engine (vLLM's per-layer path) reads what went over shared memory.
    tcp_reader = engines()
    targets = [0, 2, 5]
    taddrs, tsizes = tcp_reader.descriptors(targets)
    assert (
        client.batch_get_into_multi_buffers(keys, taddrs, tsizes) == [writer.packer.row_bytes] * 3
    )
    for source, target in zip(blocks, targets):
        assert torch.equal(tcp_reader.block(target), writer.block(source))

    # ... and the reverse: a TCP put, read into another engine over shared memory.
    tcp_writer = engines(8)
    waddrs, wsizes = tcp_writer.descriptors([3, 7])
    assert client.batch_put_from_multi_buffers(
        ["tcp-3", "tcp-7"], waddrs, wsizes, ReplicateConfig()
    ) == [0, 0]
    shm_reader = engines()
    got = shm_reader.packing(shm=attach(owner)).batch_get_into_multi_buffers(
        ["tcp-7", "tcp-never", "tcp-3"], *shm_reader.descriptors([1, 2, 3])
    )
    assert got[0] == got[2] == writer.packer.row_bytes and got[1] < 0
    assert torch.equal(shm_reader.block(1), tcp_writer.block(7))
    assert torch.equal(shm_reader.block(3), tcp_writer.block(3))
    assert not shm_reader.block(2).any()


def test_soft_pins_apply_over_shm(launched, engines):
    """Retention rides on the put's ReplicateConfig, which the dummy client
    hands to the pool owner: a pinned put over shared memory is pinned."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    def pinned() -> float:
        for line in httpx.get(launched.metrics_url, timeout=10).text.splitlines():
            if line.startswith("tandem_kvstore_pinned_objects "):
                return float(line.split()[1])
        raise AssertionError("tandem_kvstore_pinned_objects not exported")

    before = pinned()
    engine = engines(9)
    config = ReplicateConfig()
    config.soft_pin_action = SoftPinAction.ENABLE
    config.soft_pin_ttl_ms = 600_000
    over_shm = engine.packing(shm=attach(launched.settings.pool_owner_address))
    addrs, sizes = engine.descriptors([0, 1])
    assert over_shm.batch_put_from_multi_buffers(["pin-0", "pin-1"], addrs, sizes, config) == [
        0,
        0,
    ]
    assert pinned() == before + 2


def test_a_pool_owner_that_cannot_be_attached_fails_shm_and_falls_back_under_auto(caplog):
    """``shm`` refuses to start the engine with the reason; ``auto`` moves
    packed blocks over TCP and says why."""
    from types import SimpleNamespace

    from services.kvstore.connector import TandemStoreConnector

    absent = f"127.0.0.1:{free_port()}"
    with pytest.raises(ShmUnavailable, match=f"{absent} over shared memory.*--transfer"):
        TandemStoreConnector._attach_shm(SimpleNamespace(_transfer=("shm", absent)))
    assert TandemStoreConnector._attach_shm(SimpleNamespace(_transfer=("auto", absent))) is None
    assert "packed blocks over TCP instead" in caplog.text
