"""What Mooncake's soft pins and leases really do (the installed master, a
real store, no engines): the retention design rests on these facts, so a
Mooncake upgrade that changes them fails here first.

* a soft pin is set when an object is written and lasts its own TTL;
* reads (existence checks, gets, replica lookups) do not renew it;
* writing an existing key again changes nothing; an upsert re-pins it (and
  rewrites its data);
* under pressure, pinned objects outlive unpinned ones;
* a removal right after a read fails with OBJECT_HAS_LEASE, and the
  connector's Reaper removes the object once the lease is over.
"""

from __future__ import annotations

import ctypes
import time

import httpx
import pytest

from common.ports import free_ports
from common.procs import launch, stop_process_group
from services.kvstore.api import store_launch, wait_ready
from services.kvstore.connector import OBJECT_HAS_LEASE, OBJECT_NOT_FOUND, Reaper

pytestmark = pytest.mark.stack

SIZE = 4 << 20  # objects of 4 MB in a 64 MB pool: 14 fit under the watermark


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mooncake-pins")
    store_cmd = store_launch(
        tmp / "kvstore",
        ports=free_ports(6),
        pool_size="64MB",
        enable_disk=False,
        lease_ttl_ms=500,
        session_ttl_s=60,
    )
    proc, popen = launch("kvstore", store_cmd.argv, tmp / "kvstore.log", env=store_cmd.env)
    try:
        wait_ready(store_cmd.health_url, timeout=120, alive=lambda: popen.poll() is None)
        from mooncake.store import MooncakeDistributedStore

        s = store_cmd.settings
        client = MooncakeDistributedStore()
        assert (
            client.setup("127.0.0.1", s.metadata_url, 0, 64 << 20, "tcp", "", s.master_address) == 0
        )
        buf = ctypes.create_string_buffer(SIZE)
        assert client.register_buffer(ctypes.addressof(buf), SIZE) == 0
        yield Client(client, buf, store_cmd.metrics_url)
        client.close()
    finally:
        stop_process_group(proc, grace_s=30)
        popen.wait(timeout=10)


class Client:
    """A Mooncake requester with one registered 4 MB buffer."""

    def __init__(self, store, buf, metrics_url: str) -> None:
        self.store, self.buf, self.metrics_url = store, buf, metrics_url
        self.addr = ctypes.addressof(buf)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _config(pin_ttl_ms: int | None = None, default_pin: bool = False):
    from mooncake.store import ReplicateConfig, SoftPinAction

    config = ReplicateConfig()
    if pin_ttl_ms is not None or default_pin:
        config.soft_pin_action = SoftPinAction.ENABLE
    if pin_ttl_ms is not None:
        config.soft_pin_ttl_ms = pin_ttl_ms
    return config


def _put(store, key, config=None, upsert=False):
    put = store.upsert_from if upsert else store.put_from
    return put(key, store.addr, SIZE, config or _config())


def _fill(store, key) -> None:
    """A put into a full pool fails (NO_AVAILABLE_HANDLE) until the master's
    eviction thread (every 10 ms) has made room: retry briefly."""
    for _ in range(100):
        rc = _put(store, key)
        if rc == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"put {key} kept failing: {rc}")


def test_pins_last_their_write_ttl_reads_do_not_renew_upsert_does(store):
    addr = store.addr
    assert _put(store, "short", _config(3000)) == 0
    assert _put(store, "read", _config(3000)) == 0
    assert _put(store, "default", _config(default_pin=True)) == 0  # master default: 60 s
    assert _put(store, "plain") == 0
    assert _put(store, "again", _config(3000)) == 0
    assert _put(store, "again", _config(60_000)) == 0  # existing key: no change
    assert _put(store, "upsert") == 0
    assert _put(store, "upsert", _config(60_000), upsert=True) == 0  # re-pinned
    for _ in range(5):  # keep reading "read" past its 3 s pin
        time.sleep(1)
        store.batch_is_exist(["read"])
        store.get_into("read", addr, SIZE)
    # Past the last read's lease, 160 MB of unpinned objects through a 64 MB
    # pool: each newer in LRU order (its put) than anything above, so only pins
    # decide. (Fills are not read: a leased object cannot be evicted at all, and
    # with every newer object leased the master evicts pinned ones instead.)
    time.sleep(1.5)
    for i in range(40):
        _fill(store, f"fill-{i}")
    keys = ["short", "read", "default", "plain", "again", "upsert"]
    time.sleep(1)
    alive = dict(zip(keys, (r == 1 for r in store.batch_is_exist(keys))))
    assert alive == {
        "short": False,
        "read": False,
        "default": True,
        "plain": False,
        "again": False,
        "upsert": True,
    }, alive


def test_reaper_waits_out_the_lease(store):
    assert _put(store, "leased") == 0 and _put(store, "free") == 0
    assert store.batch_is_exist(["leased"]) == [1]  # grants a 0.5 s lease
    assert store.batch_remove(["leased", "missing"], False) == [OBJECT_HAS_LEASE, OBJECT_NOT_FOUND]
    reaper = Reaper(store.store, delay_s=0.3, attempts=10)  # retries until the lease is over
    reaper.remove_later(["leased", "free", "missing"], "test")
    # Polling with existence checks would renew the lease: watch the reaper.
    deadline = time.monotonic() + 15
    while reaper.removed < 2:
        assert time.monotonic() < deadline, "the reaper did not remove the blocks"
        time.sleep(0.2)
    reaper.stop()
    assert store.batch_is_exist(["leased", "free"]) == [0, 0]
    text = httpx.get(store.metrics_url, timeout=5).text
    assert "tandem_kvstore_removes_total" in text
