"""One-copy transfers between an engine and the pool owner on its host.

Mooncake's dummy client (``setup_dummy``) attaches to the standalone pool
owner (``mooncake_client``) on its RPC port and hands it shared memory over
a Unix socket in the abstract namespace (``@mooncake_client_<port>.sock``):
the pool owner maps that memory, and a put or a get of buffers inside it is
served by the pool owner itself, one ``memcpy`` per buffer between that
memory and the object in its pool (its transfer engine copies locally when
the object's segment is its own). Only memory the dummy client allocated
qualifies (``alloc_from_mem_pool``, then ``register_buffer`` of the whole
allocation; any other buffer is refused), so the engine's KV cache itself is
allocated there: :class:`SharedKVCache` is the allocation context vLLM runs
its KV cache allocation in (the connector's ``get_mem_pool_context``), and
:class:`SharedMemoryStore` sends vLLM's per-layer block puts and gets whose
buffers lie in that memory through the dummy client. Each block then moves
with one copy per direction, no staging buffer and no packing.

What the dummy client does not do, the engine's TCP client keeps doing:
``batch_get_replica_desc`` is not served over this channel ("rpc function
not registered"), and existence checks, removals and any call with a buffer
outside the shared KV cache stay on it. Puts carry their
``ReplicateConfig`` to the pool owner unchanged, so soft pins and retention
hints apply as over TCP.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from common.mooncake import TRANSFERS

# Under vLLM's logger: this runs in vLLM's processes.
log = logging.getLogger(f"vllm.{__name__}")

# What a dummy client's call returns per key when the pool owner cannot serve
# it over shared memory: INVALID_PARAMS (the pool owner has no mapping of this
# client's memory) and RPC_FAIL (the dummy client is not connected).
SHM_UNAVAILABLE = frozenset({-600, -900})
# The pool owner maps the shared KV cache this many bytes at a time at start-up
# (one store object of this size must fit in its pool for that moment).
MAP_CHUNK_BYTES = 32 << 20


class ShmUnavailable(RuntimeError):
    """The engine cannot attach to the pool owner over shared memory."""


def is_local_address(host: str) -> bool:
    """True when ``host`` names this machine: a loopback address, or one this
    process can bind to (only a local interface's address binds)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((ip, 0))
            return True
        except OSError:
            continue
    return False


def wants_shm(transfer: str, pool_owner_address: str) -> bool:
    """Whether KV blocks should move over shared memory (``transfer`` is
    the store's ``--transfer``: ``auto`` asks whether the pool owner is local)."""
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer {transfer!r}: must be one of {', '.join(TRANSFERS)}")
    if transfer != "auto":
        return transfer == "shm"
    host, _, _ = pool_owner_address.rpartition(":")
    return is_local_address(host.strip("[]"))


def attach(pool_owner_address: str) -> Any:
    """A Mooncake dummy client attached to the pool owner at ``host:port``;
    :class:`ShmUnavailable`, naming the setting, when it cannot attach."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    # No local buffer: every transfer on this client is zero-copy from the
    # staging buffer it allocates (the pool-size argument is unused on CPU).
    rc = client.setup_dummy(0, 0, pool_owner_address)
    if rc != 0:
        raise ShmUnavailable(
            f"cannot attach to the KV store's pool owner at {pool_owner_address} over "
            f"shared memory (setup_dummy returned {rc}): an engine using shared memory "
            "must run on the pool owner's host and see its abstract socket "
            f"@mooncake_client_{pool_owner_address.rpartition(':')[2]}.sock (same network "
            "namespace); otherwise set the store's --transfer to tcp or auto"
        )
    return client


class SharedKVCache(TorchFunctionMode):
    """While active, CPU ``torch.zeros`` / ``torch.empty`` allocate their
    tensors in shared memory the pool owner maps (``client``, a dummy client
    from :func:`attach`), registered whole with it.

    vLLM allocates each KV cache group's backing buffer with one
    ``torch.zeros(nbytes, dtype=torch.int8, device=...)`` inside the
    connector's allocation context and builds every layer's view on it; a
    mode (per thread) catches that call without patching vLLM. Fresh shared
    memory reads as zeros, so nothing is written. The memory lives as long as
    the process: the pool owner unmaps it when the dummy client closes or
    stops answering.
    """

    def __init__(self, client: Any) -> None:
        super().__init__()
        self.client = client
        # (address, bytes) of every allocation made here.
        self.regions: list[tuple[int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in (torch.zeros, torch.empty) and _host_allocation(args, kwargs):
            shape = _shape(args)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes:
                return self._allocate(nbytes).view(dtype).view(shape)
        return func(*args, **kwargs)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        address = self.client.alloc_from_mem_pool(nbytes)
        if not address:
            raise ShmUnavailable(
                f"Mooncake could not allocate {nbytes} bytes of shared memory for the KV cache"
            )
        if self.client.register_buffer(address, nbytes) != 0:
            raise ShmUnavailable(
                f"the KV store's pool owner refused to map the {nbytes}-byte shared KV cache"
            )
        self.regions.append((address, nbytes))
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)

    def map_into_pool_owner(self) -> int:
        """Make the pool owner touch every page of the shared KV cache now;
        returns the bytes it touched.

        The pool owner's mapping of this memory starts empty: its first copy
        into or out of each 4 KiB page takes a page fault in its process, so
        a store hit of a 3,072-token SmolLM2 prefix (141 MB) cost it 34,000
        faults, most of the hit's copy time, until every block had been moved
        once. Putting each chunk of the cache as an object, removed at once
        (never read, so never leased), takes those faults here, before the
        engine serves. A failed put (the pool full) only ends the warm-up
        early: the rest faults in on first use, as before.
        """
        started = time.monotonic()
        touched = 0
        for address, nbytes in self.regions:
            for offset in range(0, nbytes, MAP_CHUNK_BYTES):
                key = f"tandem-map-{os.getpid()}-{address + offset:x}"
                size = min(MAP_CHUNK_BYTES, nbytes - offset)
                rc = self.client.put_from(key, address + offset, size)
                if rc != 0:
                    log.warning(
                        "KV store: the pool owner mapped %d of %d bytes of the shared KV cache "
                        "ahead of use (a %d-byte put failed with %d: pool full?); the rest "
                        "maps on first use",
                        touched,
                        self.nbytes,
                        size,
                        rc,
                    )
                    return touched
                rc = self.client.remove(key)
                if rc != 0:
                    log.warning(
                        "KV store: removing the %d-byte warm-up object %s failed with %d; "
                        "it stays in the pool until evicted",
                        size,
                        key,
                        rc,
                    )
                touched += size
        log.info(
            "KV store: the pool owner mapped the shared KV cache (%d bytes) in %.2f s",
            touched,
            time.monotonic() - started,
        )
        return touched

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.regions)

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether every tensor's storage lies in this shared memory."""
        return bool(tensors) and all(
            _inside(self.regions, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            for t in tensors
        )


class SharedMemoryStore:
    """A Mooncake store client whose multi-buffer puts and gets go through
    ``shm`` (the dummy client that allocated ``cache``) when every buffer lies
    in the shared KV cache; every other call goes to ``store`` unchanged.

    Keys the dummy client could not move because the pool owner does not have
    the KV cache mapped (it restarted and the dummy client has not mapped it
    into the new one yet) or is not reachable are moved again over ``store``
    (vLLM registers the KV cache with it too), so a pool owner's restart costs
    the one copy for a while, never a stored block.

    One per transfer thread; the threads share one dummy client (the pool
    owner maps the KV cache for that client only).
    """

    def __init__(self, store: Any, cache: SharedKVCache) -> None:
        self._store = store
        self._cache = cache
        self.shared_calls = 0
        self.passed_through_calls = 0
        # Calls with keys the dummy client could not move, moved over TCP.
        self.fallback_calls = 0
        self._falling_back = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], config: Any
    ) -> list[int]:
        def put(client: Any, idx: list[int]) -> list[int]:
            return list(
                client.batch_put_from_multi_buffers(
                    [keys[i] for i in idx], [addrs[i] for i in idx], [sizes[i] for i in idx], config
                )
            )

        return self._move(addrs, sizes, put)

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        def get(client: Any, idx: list[int]) -> list[int]:
            return list(
                client.batch_get_into_multi_buffers(
                    [keys[i] for i in idx], [addrs[i] for i in idx], [sizes[i] for i in idx]
                )
            )

        return self._move(addrs, sizes, get)

    def _move(
        self,
        addrs: list[list[int]],
        sizes: list[list[int]],
        call: Callable[[Any, list[int]], list[int]],
    ) -> list[int]:
        """``call(client, indices)`` over shared memory when every buffer is in
        the shared KV cache, then over TCP for the keys it could not move."""
        every = list(range(len(addrs)))
        if not self._all_shared(addrs, sizes):
            self.passed_through_calls += 1
            return call(self._store, every)
        self.shared_calls += 1
        codes = call(self._cache.client, every)
        retry = [i for i, code in enumerate(codes) if code in SHM_UNAVAILABLE]
        if not retry:
            if self._falling_back:
                self._falling_back = False
                log.info("KV store: the pool owner has the KV cache mapped again: one copy, no TCP")
            return codes
        if not self._falling_back:
            self._falling_back = True
            log.warning(
                "KV store: the pool owner refused the shared KV cache (%s; restarted, and the "
                "KV cache not yet mapped into the new one?): moving blocks over TCP meanwhile",
                ", ".join(sorted({str(codes[i]) for i in retry})),
            )
        self.fallback_calls += 1
        for i, code in zip(retry, call(self._store, retry)):
            codes[i] = code
        return codes

    def _all_shared(self, addrs: list[list[int]], sizes: list[list[int]]) -> bool:
        starts = np.fromiter((a for row in addrs for a in row), dtype=np.int64)
        lengths = np.fromiter((s for row in sizes for s in row), dtype=np.int64)
        return bool(
            starts.size
            and starts.shape == lengths.shape
            and _inside(self._cache.regions, starts, lengths)
        )


def _inside(regions: list[tuple[int, int]], starts: Any, lengths: Any) -> bool:
    """Whether every range ``[start, start + length)`` lies in one region."""
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    ok = np.zeros(starts.shape, dtype=bool)
    for base, size in regions:
        ok |= (starts >= base) & (starts + lengths <= base + size)
    return bool(ok.all())


def _host_allocation(args: tuple, kwargs: dict) -> bool:
    """A plain allocation on the host: a shape and at most dtype and device."""
    if set(kwargs) - {"dtype", "device"} or not args:
        return False
    return torch.device(kwargs.get("device") or "cpu").type == "cpu"


def _shape(args: tuple) -> tuple[int, ...]:
    dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    return tuple(int(d) for d in dims)
