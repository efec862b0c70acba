"""Shared-memory transfers between a packing engine and the pool owner on its host.

Mooncake's dummy client (``setup_dummy``) attaches to the standalone pool
owner (``mooncake_client``) on its RPC port and hands it shared memory over
a Unix socket in the abstract namespace (``@mooncake_client_<port>.sock``):
the pool owner maps that memory, so a put or a get of a buffer inside it is
one copy between it and the pool instead of a trip through TCP. Only memory
the dummy client allocated itself qualifies (``alloc_from_mem_pool``, then
``register_buffer``; any other buffer is refused), which is why this path
serves the packed-block staging buffer (``packing.py``) and not vLLM's KV
cache.

What the dummy client does not do, the engine's TCP client keeps doing:
``batch_get_replica_desc`` is not served over this channel ("rpc function
not registered"), and vLLM's per-layer calls address the engine's own
memory. Puts carry their ``ReplicateConfig`` to the pool owner unchanged, so
soft pins and retention hints apply as over TCP.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
from typing import Any

import torch

from common.mooncake import TRANSFERS


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
    """Whether packed blocks should move over shared memory (``transfer`` is
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


def shared_buffer(client: Any, nbytes: int) -> torch.Tensor:
    """``nbytes`` of memory the pool owner maps (uint8, registered with ``client``)."""
    address = client.alloc_from_mem_pool(nbytes)
    if not address:
        raise ShmUnavailable(f"Mooncake could not allocate {nbytes} bytes of shared memory")
    if client.register_buffer(address, nbytes) != 0:
        raise ShmUnavailable(
            f"the pool owner refused to map the {nbytes}-byte shared staging buffer"
        )
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)
