"""The simulated KV store as the real one keeps blocks (services/kvstore,
"Retention policy"): a RAM tier, a disk tier written at put, soft pins that
last from the write and are not renewed by reads."""

from __future__ import annotations

from sim.cluster import ClusterConfig, Simulation, Traffic
from sim.costs import StoreTier
from sim.defaults import CPU_BLOCK_BYTES_PER_TOKEN, fitted_model
from sim.engine import EngineSettings, SharedStore

RAM = StoreTier(2, 1e9, 0.002)
DISK = StoreTier(3, 0.5e9, 0.010)


def test_ram_evicts_its_least_recently_used_block_and_a_disk_copy_stays_readable():
    store = SharedStore(RAM, lambda: 0.0, DISK)
    store.put([1, 2])
    assert store.match([1]) == (1, 0)  # 1 is now the most recent
    store.put([3])
    assert list(store.blocks) == [1, 3] and list(store.disk) == [2, 1, 3]  # a read is one lease
    assert store.match([1, 2, 3]) == (2, 1)  # 2 from disk
    assert store.match([2, 3]) == (1, 1)
    assert store.load_s(1, 1, 1_000_000) == RAM.load_s(1, 1_000_000) + DISK.load_s(1, 1_000_000)
    store.put([4])  # the disk drops its least recently used past capacity
    assert 1 not in store.disk and store.match([2]) == (0, 1)


def test_a_stored_block_is_not_written_again():
    store = SharedStore(RAM, lambda: 0.0, DISK)
    store.put([1, 2, 3])  # 1 leaves RAM, stays on disk
    store.put([1])  # exists: looked up, not written back to RAM
    assert 1 not in store.blocks and store.match([1]) == (0, 1)


def test_pins_last_from_the_write_and_reads_do_not_renew_them():
    now = [0.0]
    store = SharedStore(RAM, lambda: now[0], pin_ttl_s=10.0)
    store.put([1])  # pinned until 10
    now[0] = 8.0
    store.put([2])  # pinned until 18
    now[0] = 9.0
    store.match([1])  # the most recent now, still pinned until 10 only
    now[0] = 12.0
    store.put([3])
    assert list(store.blocks) == [2, 3]  # 1's pin lapsed: it goes before older, pinned 2
    unpinned = SharedStore(RAM, lambda: now[0])
    unpinned.put([1])
    unpinned.put([2])
    unpinned.match([1])
    unpinned.put([3])
    assert list(unpinned.blocks) == [1, 3]
    now[0] = 13.0
    store.put([4])  # every block pinned: the least recently used goes all the same
    assert list(store.blocks) == [3, 4]


def _run(**store):
    config = ClusterConfig(
        policy="round-robin",
        aggregated=4,
        engine=EngineSettings(kv_blocks=25, block_bytes=128 * CPU_BLOCK_BYTES_PER_TOKEN),
        model=fitted_model(),
        **store,
    )
    sim = Simulation(config, Traffic(sessions=16, concurrency=0))
    return sim.run(), sim.store


def test_a_disk_tier_keeps_the_hits_a_small_ram_tier_loses():
    ram_only, _ = _run(store=StoreTier(20, 1e9, 0.002))
    with_disk, store = _run(store=StoreTier(20, 1e9, 0.002), store_disk=StoreTier(4000, 5e8, 0.01))
    assert with_disk["hit_rate"] > ram_only["hit_rate"] + 0.3
    assert with_disk["ttft_p50_s"] < ram_only["ttft_p50_s"]
    assert store is not None and store.disk_hits > 0
