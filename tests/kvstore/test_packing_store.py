"""Packed and shared-memory block puts and gets against the real store
(Mooncake master and pool owner, no engines, no mocks): the descriptors come
from vLLM's own ``RankLocalStoreLayout`` over caches laid out as vLLM 0.32
allocates them, so both paths are checked against exactly what vLLM's
connector sends.

* a packed put stores the same bytes as vLLM's one-buffer-per-layer put;
* each reads the other's objects (packing is not a format);
* a missing key fails alone; batches larger than the staging buffer split;
* calls that are not one whole block per key pass through untouched;
* one copy over shared memory (the KV cache allocated where the pool owner
  maps it, vLLM's per-layer calls through a dummy client): the same objects,
  read and written across the two transports, calls outside the shared
  cache on TCP, concurrent transfer threads, soft pins applied, and a clear
  error when the engine cannot attach.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from types import SimpleNamespace

import httpx
import pytest
import torch

from common.ports import free_port
from kernels import pack_blocks_reference
from services.kvstore.api import store_launch, wait_ready
from services.kvstore.packing import SIZE_MISMATCH, BlockPacker, PackingStore
from services.kvstore.shm import SharedKVCache, SharedMemoryStore, ShmUnavailable, attach

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

    def make(seed: int | None = None, shared: SharedKVCache | None = None) -> Engine:
        made.append(Engine(client, seed, shared))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


class Engine:
    """An engine's KV cache as vLLM 0.32 allocates it on CPU (one buffer,
    layer-outer LBHNC views), registered with the store, and the per-block
    descriptors vLLM's store connector builds for it. With ``shared``, the
    cache is allocated in its shared memory, as vLLM does inside the
    connector's allocation context."""

    def __init__(self, store, seed: int | None = None, shared: SharedKVCache | None = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            KeyMetadata,
            RankLocalStoreLayout,
        )

        page = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE
        if shared is None:
            self.raw = torch.zeros(LAYERS * BLOCKS * page * 4, dtype=torch.uint8)
        else:
            with shared:  # vLLM's allocate_kv_cache: one int8 buffer
                self.raw = torch.zeros(LAYERS * BLOCKS * page * 4, dtype=torch.int8).view(
                    torch.uint8
                )
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

    def packing(self, staging_bytes: int = 1 << 20) -> PackingStore:
        self.packing_stores.append(PackingStore(self.store, self.packer, staging_bytes))
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


# -- one copy over shared memory ---------------------------------------------------


@pytest.fixture
def shared(launched):
    """A KV cache allocation context on a fresh dummy client."""
    cache = SharedKVCache(attach(launched.settings.pool_owner_address))
    yield cache
    cache.client.close()


def test_the_allocation_context_takes_only_plain_host_allocations(shared):
    with shared:
        kv = torch.zeros(3, 1024, dtype=torch.float32, device="cpu")
        scratch = torch.ones(16)
        grads = torch.zeros(16, requires_grad=True)
        empty = torch.empty(0, dtype=torch.int8)
    assert kv.shape == (3, 1024) and kv.dtype == torch.float32 and not kv.any()
    assert shared.regions == [(kv.data_ptr(), 3 * 1024 * 4)]
    assert shared.holds([kv, kv[1:]]) and not shared.holds([kv, scratch])
    assert not shared.holds([grads]) and not shared.holds([empty]) and not shared.holds([])
    kv[2, 5] = 7.0  # ordinary writable memory
    assert kv.sum() == 7.0
    # Outside the context, allocations are ordinary again.
    assert not shared.holds([torch.zeros(16)])


def test_the_pool_owner_maps_the_shared_cache_before_use(launched, client, shared):
    """After ``map_into_pool_owner`` the pool owner copies into the cache
    without a page fault per 4 KiB page, as it does into a cache it has not
    mapped yet; the warm-up leaves the cache zero and no object behind."""
    import os

    from services.kvstore.shm import MAP_CHUNK_BYTES

    nbytes = 8 << 20
    cold = SharedKVCache(attach(launched.settings.pool_owner_address))
    try:
        with cold:
            cold_buf = torch.zeros(nbytes, dtype=torch.int8)
        with shared:  # three chunks, the last one partial
            warm_buf = torch.zeros(2 * MAP_CHUNK_BYTES + nbytes, dtype=torch.int8)
        assert shared.map_into_pool_owner() == warm_buf.numel() == shared.nbytes
        assert not warm_buf.any()
        address = warm_buf.data_ptr()
        keys = [f"tandem-map-{os.getpid()}-{address + off:x}" for off in (0, MAP_CHUNK_BYTES)]
        assert client.batch_is_exist(keys) == [0, 0]

        source = torch.randint(-128, 128, (nbytes,), dtype=torch.int8)
        assert client.register_buffer(source.data_ptr(), nbytes) == 0
        try:
            assert client.put_from("map-source", source.data_ptr(), nbytes) == 0
            pid = httpx.get(launched.health_url).json()["processes"]["client"]["pid"]

            def faults_of_get(cache: SharedKVCache, buf: torch.Tensor) -> int:
                start = _minor_faults(pid)
                assert cache.client.get_into("map-source", buf.data_ptr(), nbytes) == nbytes
                return _minor_faults(pid) - start

            cold_faults = faults_of_get(cold, cold_buf)
            warm_faults = faults_of_get(shared, warm_buf)
        finally:
            client.unregister_buffer(source.data_ptr())
        assert torch.equal(cold_buf, source) and torch.equal(warm_buf[:nbytes], source)
        pages = nbytes // 4096
        assert cold_faults > pages // 2, f"{cold_faults} faults into an unmapped cache"
        assert warm_faults < pages // 20, f"{warm_faults} faults into a mapped cache"
    finally:
        cold.client.close()


def _minor_faults(pid: int) -> int:
    """Minor page faults of a process so far (/proc/<pid>/stat, field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def test_blocks_in_the_shared_cache_move_over_shm_and_read_over_tcp(client, engines, shared):
    """An engine on the pool owner's host and one elsewhere share every block;
    calls whose buffers are outside the shared cache stay on TCP."""
    from mooncake.store import ReplicateConfig

    writer = engines(7, shared=shared)
    assert shared.holds(writer.layers)
    over_shm = SharedMemoryStore(client, shared)
    blocks = [6, 1, 4]
    addrs, sizes = writer.descriptors(blocks)
    keys = [f"shm-{b}" for b in blocks]
    assert over_shm.batch_put_from_multi_buffers(keys, addrs, sizes, ReplicateConfig()) == [0] * 3
    assert over_shm.shared_calls == 1 and over_shm.passed_through_calls == 0
    # Existence checks go to the TCP client, and see what shared memory wrote.
    assert over_shm.batch_is_exist([*keys, "shm-never"]) == [1, 1, 1, 0]

    # A TCP engine (vLLM's per-layer path, ordinary memory) reads what went
    # over shared memory, through the same wrapper: passed through.
    tcp_reader = engines()
    targets = [0, 2, 5]
    got = over_shm.batch_get_into_multi_buffers(keys, *tcp_reader.descriptors(targets))
    assert got == [writer.packer.row_bytes] * 3 and over_shm.passed_through_calls == 1
    for source, target in zip(blocks, targets):
        assert torch.equal(tcp_reader.block(target), writer.block(source))

    # ... and the reverse: a TCP put, read into another shared cache over shm.
    tcp_writer = engines(8)
    waddrs, wsizes = tcp_writer.descriptors([3, 7])
    assert client.batch_put_from_multi_buffers(
        ["tcp-3", "tcp-7"], waddrs, wsizes, ReplicateConfig()
    ) == [0, 0]
    shm_reader = engines(shared=shared)
    got = over_shm.batch_get_into_multi_buffers(
        ["tcp-7", "tcp-never", "tcp-3"], *shm_reader.descriptors([1, 2, 3])
    )
    assert got[0] == got[2] == writer.packer.row_bytes and got[1] < 0
    assert over_shm.shared_calls == 2
    assert torch.equal(shm_reader.block(1), tcp_writer.block(7))
    assert torch.equal(shm_reader.block(3), tcp_writer.block(3))
    assert not shm_reader.block(2).any()


def test_transfer_threads_share_one_dummy_client(client, engines, shared):
    """vLLM's sending thread and receiving thread call at the same time."""
    from mooncake.store import ReplicateConfig

    writer, reader = engines(11, shared=shared), engines(shared=shared)
    sender, receiver = SharedMemoryStore(client, shared), SharedMemoryStore(client, shared)
    assert sender.batch_put_from_multi_buffers(
        ["both-0"], *writer.descriptors([0]), ReplicateConfig()
    ) == [0]
    failures: list[str] = []

    def send() -> None:
        for round_ in range(20):
            keys = [f"both-{round_}-{b}" for b in range(1, 4)]
            put = sender.batch_put_from_multi_buffers(
                keys, *writer.descriptors([1, 2, 3]), ReplicateConfig()
            )
            if put != [0] * 3:
                failures.append(f"put {put}")

    def receive() -> None:
        for _ in range(20):
            got = receiver.batch_get_into_multi_buffers(["both-0"], *reader.descriptors([5]))
            if got != [writer.packer.row_bytes]:
                failures.append(f"get {got}")

    threads = [threading.Thread(target=send), threading.Thread(target=receive)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures
    assert torch.equal(reader.block(5), writer.block(0))
    assert sender.shared_calls == 21 and receiver.shared_calls == 20


def test_soft_pins_apply_over_shm(launched, engines, shared):
    """Retention rides on the put's ReplicateConfig, which the dummy client
    hands to the pool owner: a pinned put over shared memory is pinned."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    def pinned() -> float:
        for line in httpx.get(launched.metrics_url, timeout=10).text.splitlines():
            if line.startswith("tandem_kvstore_pinned_objects "):
                return float(line.split()[1])
        raise AssertionError("tandem_kvstore_pinned_objects not exported")

    before = pinned()
    engine = engines(9, shared=shared)
    config = ReplicateConfig()
    config.soft_pin_action = SoftPinAction.ENABLE
    config.soft_pin_ttl_ms = 600_000
    over_shm = SharedMemoryStore(engine.store, shared)
    addrs, sizes = engine.descriptors([0, 1])
    assert over_shm.batch_put_from_multi_buffers(["pin-0", "pin-1"], addrs, sizes, config) == [
        0,
        0,
    ]
    assert over_shm.shared_calls == 1
    assert pinned() == before + 2


def test_a_pool_owner_that_cannot_be_attached_fails_shm_and_falls_back_under_auto(caplog):
    """``shm`` refuses to start the engine with the reason; ``auto`` moves
    blocks over TCP and says why; a KV cache on a GPU never uses shm."""
    from services.kvstore.connector import TandemStoreConnector

    absent = f"127.0.0.1:{free_port()}"
    with pytest.raises(ShmUnavailable, match=f"{absent} over shared memory.*--transfer"):
        TandemStoreConnector._attach_shm(SimpleNamespace(_transfer=("shm", absent)))
    assert TandemStoreConnector._attach_shm(SimpleNamespace(_transfer=("auto", absent))) is None
    assert "KV blocks over TCP instead" in caplog.text

    def connector(transfer: str, device: str) -> SimpleNamespace:
        config = SimpleNamespace(device_config=SimpleNamespace(device_type=device))
        return SimpleNamespace(_transfer=(transfer, "127.0.0.1:1"), _vllm_config=config)

    wanted = TandemStoreConnector._shm_wanted
    assert wanted(connector("auto", "cpu")) and wanted(connector("shm", "cpu"))
    assert not wanted(connector("auto", "cuda")) and not wanted(connector("tcp", "cpu"))
    with pytest.raises(ShmUnavailable, match="KV cache is on cuda.*--transfer"):
        wanted(connector("shm", "cuda"))


def test_a_restarted_pool_owner_serves_the_shared_cache_at_once_and_maps_it_again(tmp_path):
    """SIGKILL the pool owner: once the store is healthy again, puts and gets
    of blocks in the shared KV cache succeed at once (over TCP while the new
    pool owner does not have the cache mapped) with the right bytes, and the
    dummy client maps the cache into the new pool owner, so the one copy
    comes back."""
    import os
    import time

    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    launch = store_launch(
        tmp_path / "kvstore",
        ports=[free_port() for _ in range(6)],
        pool_size="64MB",
        enable_disk=False,
        client_ttl_s=2,
        restart_backoff_s=0.5,
    )
    with open(tmp_path / "kvstore.log", "wb") as log:
        popen = subprocess.Popen(launch.argv, stdout=log, stderr=subprocess.STDOUT)
    tcp = MooncakeDistributedStore()
    shared: SharedKVCache | None = None
    engine: Engine | None = None
    try:
        wait_ready(launch.health_url, timeout=120, alive=lambda: popen.poll() is None)
        s = launch.settings
        assert tcp.setup("127.0.0.1", s.metadata_url, 0, 16 << 20, "tcp", "", s.master_address) == 0
        shared = SharedKVCache(attach(s.pool_owner_address))
        engine = Engine(tcp, 21, shared)
        over_shm = SharedMemoryStore(tcp, shared)
        config = ReplicateConfig()
        assert over_shm.batch_put_from_multi_buffers(
            ["before"], *engine.descriptors([0]), config
        ) == [0]
        assert over_shm.fallback_calls == 0

        pid = httpx.get(launch.health_url).json()["processes"]["client"]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while True:  # healthy again, with a new pool owner
            assert time.monotonic() - killed < 90, "pool owner not restarted"
            resp = httpx.get(launch.health_url, timeout=5)
            if resp.status_code == 200 and resp.json()["processes"]["client"]["pid"] != pid:
                break
            time.sleep(0.2)
        healthy_s = time.monotonic() - killed

        keys = ["after-1", "after-2"]
        assert over_shm.batch_put_from_multi_buffers(keys, *engine.descriptors([1, 2]), config) == [
            0,
            0,
        ]
        got = over_shm.batch_get_into_multi_buffers(keys, *engine.descriptors([6, 7]))
        assert got == [engine.packer.row_bytes] * 2
        assert torch.equal(engine.block(6), engine.block(1))
        assert torch.equal(engine.block(7), engine.block(2))

        # The one copy is back once a call moves every key over shared memory.
        for attempt in range(60):
            fallbacks = over_shm.fallback_calls
            put = over_shm.batch_put_from_multi_buffers(
                [f"again-{attempt}"], *engine.descriptors([3]), config
            )
            assert put == [0]
            if over_shm.fallback_calls == fallbacks:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the pool owner never mapped the shared KV cache again")
        print(
            f"\nhealthy {healthy_s:.1f}s after the kill; one copy back after "
            f"{time.monotonic() - killed:.1f}s ({over_shm.fallback_calls} calls over TCP meanwhile)"
        )
    finally:
        if engine is not None:
            engine.close()
        if shared is not None:
            shared.client.close()
        tcp.close()
        popen.send_signal(signal.SIGTERM)
        popen.wait(30)


def test_keys_the_pool_owner_cannot_move_over_shm_go_over_tcp(launched, client, engines, shared):
    """A dummy client whose memory the pool owner has not mapped (as after the
    pool owner restarted) is refused key by key: those keys move over TCP."""
    from mooncake.store import ReplicateConfig

    writer = engines(13, shared=shared)
    unmapped = SharedKVCache(attach(launched.settings.pool_owner_address))
    unmapped.regions = shared.regions  # the same memory, never mapped for this client
    try:
        over_shm = SharedMemoryStore(client, unmapped)
        keys = ["unmapped-0", "unmapped-1"]
        assert over_shm.batch_put_from_multi_buffers(
            keys, *writer.descriptors([0, 1]), ReplicateConfig()
        ) == [0, 0]
        assert over_shm.shared_calls == over_shm.fallback_calls == 1
        got = over_shm.batch_get_into_multi_buffers(keys, *writer.descriptors([4, 5]))
        assert got == [writer.packer.row_bytes] * 2 and over_shm.fallback_calls == 2
        assert torch.equal(writer.block(4), writer.block(0))
        assert torch.equal(writer.block(5), writer.block(1))
        # A missing key is still a miss, after the TCP retry too.
        assert over_shm.batch_get_into_multi_buffers(["never"], *writer.descriptors([6]))[0] < 0
    finally:
        unmapped.client.close()
