"""vLLM's MooncakeStoreConnector with Tandem's store config and retention policy.

Loaded inside the engine through ``kv_connector_module_path`` (and registered
by name, see ``engine.py``). It adds three things to vLLM's connector and
changes nothing else:

* the path of the store's config file travels in the connector's own
  ``kv_connector_extra_config["mooncake_config_path"]`` (set as
  ``MOONCAKE_CONFIG_PATH`` before vLLM reads it), so an engine needs no extra
  environment and two engines in one process tree cannot mix their configs;
* the engine-wide policy: the ``tandem.retention`` block of that file picks
  the default ``ReplicateConfig``: ``soft-pin`` sets Mooncake's soft pin with
  the session TTL, ``lru`` leaves Mooncake's default (lease, then
  least-recently-used eviction);
* per-request router hints (``retention.py``): a request whose
  ``kv_transfer_params`` carry ``tandem_retention`` has the blocks it writes
  soft-pinned for the hint's TTL, or, for a session's last request
  (``release``), the session's own blocks removed from the store once the
  request's KV is written and no reader holds a lease on them;
* with the store's ``--transfer`` at ``shm`` (or ``auto`` and the pool owner
  on this host), the KV cache is allocated in shared memory the pool owner
  maps (``get_mem_pool_context``, ``shm.py``) and vLLM's per-layer block
  puts and gets go through a dummy client: the pool owner copies each block
  once between the KV cache and its pool, no TCP;
* otherwise, with ``pack_blocks`` in that block (the store's
  ``--pack-blocks``), each KV block moves over TCP as one packed buffer
  instead of one per layer (``packing.py``); the stored objects are the same
  bytes either way.

How a hint gets from the request to the put: the scheduler side records it
when the request arrives (``on_new_request``) and tags the request's store
jobs with it when it builds the step's connector metadata; the worker's
sending thread picks the ``ReplicateConfig`` per job. vLLM's sending thread
uses one ``ReplicateConfig`` for every put and has no per-request hook, so
the one thread instance this connector's worker starts is re-classed to
:class:`_RetentionSendingThread`, a subclass that only chooses that config
per job and schedules the release; no vLLM module is patched.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    KVCacheStoreSendingThread,
)

from services.kvstore.packing import BlockPacker, PackingStore
from services.kvstore.retention import REQ_META_ATTR, RetentionHint
from services.kvstore.shm import (
    SharedKVCache,
    SharedMemoryStore,
    ShmUnavailable,
    attach,
    wants_shm,
)

# Under vLLM's logger: the connector runs in vLLM's processes, where only
# vLLM's loggers are set up to print INFO.
log = logging.getLogger(f"vllm.{__name__}")

CONFIG_PATH_KEY = "mooncake_config_path"
# Mooncake error codes (mooncake-store/include/types.h).
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
# Bounds on the scheduler's per-request bookkeeping (entries leave when the
# request finishes; the bound only guards against a leak).
_MAX_TRACKED_REQUESTS = 100_000
_MAX_PIN_CONFIGS = 64


def retention_of(config: dict[str, Any]) -> dict[str, Any]:
    block = config.get("tandem") or {}
    session_ttl_ms = int(block.get("session_ttl_ms", 1_800_000))
    return {
        "retention": block.get("retention", "lru"),
        "session_ttl_ms": session_ttl_ms,
        # The master refuses pins longer than its max_kv_soft_pin_ttl.
        "max_pin_ttl_ms": int(block.get("max_pin_ttl_ms", max(session_ttl_ms, 86_400_000))),
        # A removal waits for the lease the write path's existence check
        # granted (master default_kv_lease_ttl).
        "lease_ttl_ms": int(block.get("lease_ttl_ms", 10_000)),
    }


def packing_of(config: dict[str, Any]) -> int | None:
    """Bytes of each transfer thread's packing staging buffer, or None when
    the store's engines do not pack blocks."""
    block = config.get("tandem") or {}
    if not block.get("pack_blocks", False):
        return None
    return int(block.get("pack_staging_bytes", 128 << 20))


def transfer_of(config: dict[str, Any]) -> tuple[str, str | None]:
    """The store's ``--transfer`` and its pool owner's RPC address."""
    block = config.get("tandem") or {}
    return block.get("transfer", "tcp"), block.get("pool_owner_address")


def apply_retention(replicate_config: Any, retention: dict[str, Any]) -> bool:
    """Set soft pin on ``replicate_config`` for the soft-pin policy; True if set."""
    if retention["retention"] != "soft-pin":
        return False
    from mooncake.store import SoftPinAction

    replicate_config.soft_pin_action = SoftPinAction.ENABLE
    replicate_config.soft_pin_ttl_ms = retention["session_ttl_ms"]
    return True


def _copy_placement(src: Any, dst: Any) -> Any:
    for name in (
        "replica_num",
        "preferred_segment",
        "preferred_segments",
        "prefer_alloc_in_same_node",
        "data_type",
    ):
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))
    return dst


class RequestRetention:
    """Worker side: the ReplicateConfig for each store job, and releases.

    ``default`` is the engine-wide config (vLLM's ``store_replicate_config``
    after :func:`apply_retention`); pinned configs are built per TTL from it.
    """

    def __init__(self, store: Any, default: Any, retention: dict[str, Any]) -> None:
        from mooncake.store import ReplicateConfig

        self._new_config = ReplicateConfig
        self.default = default
        # A released session's last blocks are removed right after: never pin them.
        self.unpinned = _copy_placement(default, ReplicateConfig())
        self.max_pin_ttl_ms = retention["max_pin_ttl_ms"]
        self._pinned: dict[int, Any] = {}
        self.reaper = Reaper(store, delay_s=retention["lease_ttl_ms"] / 1000 + 0.25)
        self._released: OrderedDict[str, None] = OrderedDict()

    def config_for(self, hint: RetentionHint | None) -> Any:
        if hint is None:
            return self.default
        if hint.release:
            return self.unpinned
        if not hint.pins:
            return self.default
        ttl = min(hint.pin_ttl_ms, self.max_pin_ttl_ms)
        config = self._pinned.get(ttl)
        if config is None:
            from mooncake.store import SoftPinAction

            if len(self._pinned) >= _MAX_PIN_CONFIGS:
                self._pinned.clear()
            config = _copy_placement(self.default, self._new_config())
            config.soft_pin_action = SoftPinAction.ENABLE
            config.soft_pin_ttl_ms = ttl
            self._pinned[ttl] = config
        return config

    def first_release(self, req_id: str) -> bool:
        """True the first time a released request's prompt is fully written."""
        if req_id in self._released:
            return False
        self._released[req_id] = None
        if len(self._released) > _MAX_TRACKED_REQUESTS:
            self._released.popitem(last=False)
        return True


class Reaper(threading.Thread):
    """Removes released blocks once no lease protects them.

    Every existence check and read grants the object a lease (the master's
    ``default_kv_lease_ttl``); removing a leased object fails with
    OBJECT_HAS_LEASE, and forcing it could free memory another engine is
    reading. So removals wait one lease, retry with growing waits, and leave
    a block still leased after ``attempts`` tries (someone keeps using it)
    to the LRU.
    """

    def __init__(self, store: Any, delay_s: float, attempts: int = 5) -> None:
        super().__init__(name="TandemStoreReaper", daemon=True)
        self._store = store
        self.delay_s = delay_s
        self.attempts = attempts
        self._heap: list[tuple[float, int, list[str], int, str]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopped = False
        self.removed = 0
        self.kept_leased = 0

    def remove_later(self, keys: list[str], label: str) -> None:
        if not keys:
            return
        with self._cv:
            if not self.is_alive() and not self._stopped:
                self.start()
            heapq.heappush(
                self._heap, (time.monotonic() + self.delay_s, next(self._seq), keys, 1, label)
            )
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(timeout)
                if self._stopped:
                    return
                _, _, keys, attempt, label = heapq.heappop(self._heap)
            try:
                codes = self._store.batch_remove(keys, False)
            except Exception as exc:  # store closed or master gone: nothing to do
                log.warning("%s: removing %d released blocks failed: %s", label, len(keys), exc)
                continue
            removed = sum(1 for c in codes if c == 0)
            leased = [k for k, c in zip(keys, codes) if c == OBJECT_HAS_LEASE]
            other = [c for c in codes if c not in (0, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)]
            self.removed += removed
            if leased and attempt < self.attempts:
                with self._cv:  # back off: someone is reading these blocks
                    heapq.heappush(
                        self._heap,
                        (
                            time.monotonic() + self.delay_s * (attempt + 1),
                            next(self._seq),
                            leased,
                            attempt + 1,
                            label,
                        ),
                    )
                    self._cv.notify()
            elif leased:
                self.kept_leased += len(leased)
            log.info(
                "%s: removed %d of %d released blocks from the store%s%s",
                label,
                removed,
                len(keys),
                f", {len(leased)} still leased"
                + (" (retrying)" if attempt < self.attempts else " (left to the LRU)")
                if leased
                else "",
                f", errors {sorted(set(other))}" if other else "",
            )


class _RetentionSendingThread(KVCacheStoreSendingThread):
    """vLLM's sending thread, choosing the ReplicateConfig per store job.

    Never constructed: :meth:`TandemStoreConnector.register_kv_caches`
    re-classes the thread vLLM started (and sets ``tandem``). The thread
    handles one job at a time, so swapping ``replicate_config`` around the
    parent's handler is race-free.
    """

    tandem: RequestRetention

    def _handle_request(self, req_meta: Any) -> None:
        hint: RetentionHint | None = getattr(req_meta, REQ_META_ATTR, None)
        self.replicate_config = self.tandem.config_for(hint)
        try:
            super()._handle_request(req_meta)
        finally:
            self.replicate_config = self.tandem.default
        if hint is not None and hint.release:
            # Once, at the job that completes the prompt (chunked prefills
            # write it in several jobs).
            done, prompt = req_meta.completed_token_len, req_meta.prefill_end_tokens
            if (done is None or prompt is None or done >= prompt) and self.tandem.first_release(
                req_meta.req_id
            ):
                keys = self.release_keys(req_meta, hint.keep_tokens)
                log.info(
                    "session %s ended (request %s): %d blocks after the first %d tokens to remove",
                    hint.session,
                    req_meta.req_id,
                    len(keys),
                    hint.keep_tokens,
                )
                self.tandem.reaper.remove_later(keys, f"session {hint.session}")

    def release_keys(self, req_meta: Any, keep_tokens: int) -> list[str]:
        """Store keys this rank wrote for the request's blocks past ``keep_tokens``
        (the same chunks and keys as the parent's save path)."""
        lcm = self.coord.lcm_block_size
        token_len = req_meta.token_len_chunk // lcm * lcm
        keys: list[str] = []
        if not token_len or not req_meta.block_hashes:
            return keys
        for g_idx, db in enumerate(self.token_databases):
            if not self.group_participates[g_idx]:
                continue
            put_step = self.group_put_steps[g_idx]
            for _, _, block_hash in db.process_tokens(
                token_len,
                req_meta.block_hashes,
                mask_num=keep_tokens,
                put_step=put_step,
                put_step_rank=(self.tp_rank + g_idx) % put_step,
            ):
                for shard_id in db.store_layout.local_shard_ids:
                    keys.append(db.store_layout.key_for(shard_id, block_hash))
        return keys


class TandemStoreConnector(MooncakeStoreConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        path = extra.get(CONFIG_PATH_KEY)
        if path:
            os.environ["MOONCAKE_CONFIG_PATH"] = path
        path = os.environ.get("MOONCAKE_CONFIG_PATH")
        if not path or not os.path.exists(path):
            raise ValueError(
                f"KV store config {path!r} not found: start the KV store "
                "(python -m services.kvstore) before the engine, or fix --kv-store-config"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        # Scheduler side: request id → its router hint, until it finishes.
        self._hints: OrderedDict[str, RetentionHint] = OrderedDict()
        self._retention: RequestRetention | None = None
        self._pack_staging_bytes: int | None = None
        self._transfer: tuple[str, str | None] = ("tcp", None)
        self._shared_cache: SharedKVCache | None = None
        worker = self.connector_worker
        if worker is not None:
            with open(path) as f:
                config = json.load(f)
            retention = retention_of(config)
            self._pack_staging_bytes = packing_of(config)
            self._transfer = transfer_of(config)
            if apply_retention(worker.store_replicate_config, retention):
                log.info(
                    "KV store retention: soft-pin every put for %d ms", retention["session_ttl_ms"]
                )
            if worker.can_put:
                self._retention = RequestRetention(
                    worker.store, worker.store_replicate_config, retention
                )
        log.info("Tandem store connector (%s) loaded from %s", role, __file__)

    # -- scheduler side ---------------------------------------------------
    def on_new_request(self, request) -> None:
        super().on_new_request(request)
        try:
            hint = RetentionHint.from_params(request.kv_transfer_params)
        except ValueError as exc:  # the engine host validates; never fail a request here
            log.warning("request %s: ignoring retention hint: %s", request.request_id, exc)
            return
        if hint is None:
            return
        self._hints[request.request_id] = hint
        if len(self._hints) > _MAX_TRACKED_REQUESTS:
            self._hints.popitem(last=False)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        if self._hints:
            for req_meta in meta.requests:
                hint = self._hints.get(req_meta.req_id)
                if hint is not None:
                    setattr(req_meta, REQ_META_ATTR, hint)
            # After tagging: a finished request's last jobs (its prompt's
            # partial tail) are in the metadata built right after it finished.
            for req_id in scheduler_output.finished_req_ids:
                self._hints.pop(req_id, None)
        return meta

    # -- worker side ------------------------------------------------------
    def get_mem_pool_context(self):
        """Where vLLM allocates the KV cache: shared memory the pool owner
        maps when blocks should move over shared memory, else vLLM's choice."""
        context = super().get_mem_pool_context()
        if context is not None or self.connector_worker is None or not self._shm_wanted():
            return context
        client = self._attach_shm()
        if client is not None:
            self._shared_cache = SharedKVCache(client)
        return self._shared_cache

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        thread = getattr(self.connector_worker, "kv_send_thread", None)
        if thread is not None and self._retention is not None:
            if type(thread) is not KVCacheStoreSendingThread:
                raise RuntimeError(
                    f"unexpected vLLM store sending thread {type(thread)!r}: "
                    "per-request retention needs vLLM's own class"
                )
            thread.tandem = self._retention
            thread.__class__ = _RetentionSendingThread
        caches = [c if isinstance(c, torch.Tensor) else c[0] for c in kv_caches.values()]
        if self._shared_cache is not None and self._shared_cache.holds(caches):
            self._move_over_shm()
            return
        if self._shared_cache is not None:
            log.warning(
                "KV store: the KV cache was not allocated in shared memory; blocks move over TCP"
            )
            self._detach_shm()
        if self._pack_staging_bytes is not None:
            self._pack_blocks(kv_caches)

    def _move_over_shm(self) -> None:
        """Give each transfer thread a store client that moves blocks in the
        shared KV cache through the pool owner."""
        worker = self.connector_worker
        assert self._shared_cache is not None
        for thread in [worker.kv_send_thread, *worker.kv_recv_threads]:
            if thread is not None:
                thread.store = SharedMemoryStore(thread.store, self._shared_cache)
        self._shared_cache.map_into_pool_owner()
        log.info(
            "KV store: KV cache (%d bytes) in shared memory with the pool owner at %s: "
            "it copies each block once, no TCP%s",
            self._shared_cache.nbytes,
            self._transfer[1],
            ", no packing" if self._pack_staging_bytes is not None else "",
        )

    def _pack_blocks(self, kv_caches) -> None:
        """Give each transfer thread a store client that moves packed blocks."""
        worker = self.connector_worker
        dbs = worker.token_dbs
        try:
            if len(dbs) != 1:
                raise ValueError(f"{len(dbs)} KV cache groups (packing handles one)")
            layout = dbs[0].store_layout
            if not hasattr(layout, "kv_caches_base_addr"):
                raise ValueError(
                    f"vLLM store layout {type(layout).__name__} (packing handles "
                    "the rank-local layout)"
                )
            caches = [c if isinstance(c, torch.Tensor) else c[0] for c in kv_caches.values()]
            packer = BlockPacker.for_regions(caches, layout.kv_caches_base_addr, layout.block_len)
        except ValueError as exc:
            log.warning("KV store: not packing blocks, one buffer per layer as vLLM does: %s", exc)
            return
        stores = []
        for thread in [worker.kv_send_thread, *worker.kv_recv_threads]:
            if thread is not None:
                thread.store = PackingStore(thread.store, packer, self._pack_staging_bytes)
                stores.append(thread.store)
        log.info(
            "KV store: packing blocks, 1 buffer per block instead of %d (%d-byte rows, "
            "up to %d blocks per store call), over the transfer engine (TCP)",
            packer.descriptors_per_block,
            packer.row_bytes,
            stores[0].rows_per_call if stores else 0,
        )

    def _shm_wanted(self) -> bool:
        transfer, pool_owner = self._transfer
        device = self._vllm_config.device_config.device_type
        host_cache = device == "cpu"
        if transfer == "shm":
            if not host_cache:
                raise ShmUnavailable(
                    "the store's --transfer is shm, but the KV cache is on "
                    f"{device}: shared memory holds "
                    "host memory only; set --transfer to tcp or auto"
                )
            return True
        # auto: the pool owner on this host, and a KV cache in host memory.
        return pool_owner is not None and host_cache and wants_shm(transfer, pool_owner)

    def _attach_shm(self) -> Any:
        """A dummy client on the pool owner; None (TCP) when ``auto`` cannot attach."""
        transfer, pool_owner = self._transfer
        if pool_owner is None:
            raise ShmUnavailable("the store config names no pool_owner_address")
        try:
            return attach(pool_owner)
        except ShmUnavailable as exc:
            if transfer == "shm":
                raise
            log.warning("KV store: KV blocks over TCP instead: %s", exc)
            return None

    def _detach_shm(self) -> None:
        cache, self._shared_cache = getattr(self, "_shared_cache", None), None
        if cache is not None:
            cache.client.close()

    def shutdown(self):
        if getattr(self, "_retention", None) is not None:
            self._retention.reaper.stop()
        super().shutdown()
        # Detach from the pool owner once the transfer threads are drained
        # (shutdown also runs from __del__: once only). The pool owner unmaps
        # the KV cache; this process keeps its own mapping.
        self._detach_shm()


def _register() -> None:
    from services.kvstore.engine import register_connector

    register_connector()


_register()
