"""Packed block transfers for the store connector (``--pack-blocks``).

vLLM's MooncakeStoreConnector moves each KV block as one store object made
of one buffer per layer region: ``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers`` with, per key, one ``(address, length)`` per
layer (30 for SmolLM2). With packing, each block is first gathered into one
contiguous row of a registered staging buffer (``kernels.pack_blocks``) and
moved as a single buffer (``batch_put_from`` / ``batch_get_into``); a get
scatters the row back (``kernels.unpack_blocks``).

The object is the same either way: a multi-buffer put stores its buffers
concatenated in order, which is exactly the packed row. Engines that pack
and engines that do not read each other's blocks.

:class:`PackingStore` wraps the store object the connector's transfer
threads call, so vLLM's code runs unchanged and no vLLM module is patched.
A call whose buffers are not one whole block per key in the registered
layout (another cache group's layout, Mamba state puts) passes through
untouched.

Packing serves the transfer engine (a remote pool owner): with the pool
owner on the engine's host the KV cache lives in shared memory instead
(``shm.py``) and blocks move with one copy, no packing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from kernels import block_pages, pack_blocks, packed_block_bytes, unpack_blocks

log = logging.getLogger("vllm.tandem.kvstore.packing")

# Not a Mooncake code: a get returned an object of another size than a block
# (vLLM treats any negative result as a failed key and recomputes it).
SIZE_MISMATCH = -1


class BlockPacker:
    """The layer regions of one KV cache group as the connector addresses them:
    block ``b`` of region ``i`` is ``(bases[i] + b * block_lens[i], block_lens[i])``."""

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        self.layers = list(layers)
        pages = [block_pages(layer) for layer in self.layers]
        self.bases = np.array([p.data_ptr() for p in pages], dtype=np.int64)
        self.block_lens = np.array([p.shape[1] for p in pages], dtype=np.int64)
        self.num_blocks = self.layers[0].shape[0]
        self.row_bytes = packed_block_bytes(self.layers)

    @classmethod
    def for_regions(
        cls, caches: Iterable[torch.Tensor], bases: Sequence[int], block_lens: Sequence[int]
    ) -> BlockPacker:
        """The packer for the connector's region list (``bases``, ``block_lens``)
        over the engine's KV cache tensors; ValueError if a region is not one
        cache's pages laid out at its block length."""
        by_address = {c.data_ptr(): c for c in caches if isinstance(c, torch.Tensor)}
        layers = []
        for base, block_len in zip(bases, block_lens):
            cache = by_address.get(base)
            if cache is None:
                raise ValueError(f"no KV cache tensor starts at region address {base:#x}")
            pages = block_pages(cache)
            stride = pages.stride(0) if pages.shape[0] > 1 else pages.shape[1]
            if pages.shape[1] != block_len or stride != block_len:
                raise ValueError(
                    f"region {base:#x}: {block_len}-byte blocks, but the cache "
                    f"has {pages.shape[1]}-byte pages {stride} bytes apart"
                )
            layers.append(cache)
        if not layers:
            raise ValueError("no KV cache regions")
        return cls(layers)

    @property
    def descriptors_per_block(self) -> int:
        return len(self.layers)

    def block_ids(
        self,
        addrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
    ) -> list[int] | None:
        """The block each key's buffers are, or None unless every key's buffers
        are exactly one whole block of every region."""
        if not addrs:
            return None
        try:
            a = np.asarray(addrs, dtype=np.int64)
            s = np.asarray(sizes, dtype=np.int64)
        except (ValueError, OverflowError):  # ragged: keys of different layouts
            return None
        regions = len(self.layers)
        if a.shape != (len(addrs), regions) or s.shape != a.shape:
            return None
        offsets = a[:, 0] - self.bases[0]
        ids = offsets // self.block_lens[0]
        if (
            np.any(offsets % self.block_lens[0])
            or np.any(ids < 0)
            or np.any(ids >= self.num_blocks)
            or np.any(s != self.block_lens)
            or np.any(a != self.bases + ids[:, None] * self.block_lens)
        ):
            return None
        return ids.tolist()


class PackingStore:
    """A Mooncake store client whose multi-buffer block puts and gets move one
    packed buffer per block. Every other call goes to the store unchanged.

    One per transfer thread: each has its own registered staging buffer of
    ``staging_bytes`` (at least one block), and a batch larger than it moves
    in several store calls.
    """

    def __init__(self, store: Any, packer: BlockPacker, staging_bytes: int) -> None:
        self._store = store
        self.packer = packer
        rows = max(1, staging_bytes // packer.row_bytes)
        device = packer.layers[0].device
        self._staging = torch.empty((rows, packer.row_bytes), dtype=torch.uint8, device=device)
        rc = store.register_buffer(self._staging.data_ptr(), self._staging.numel())
        if rc != 0:
            raise RuntimeError(
                f"Mooncake register_buffer failed for the {self._staging.numel()}"
                f"-byte packing staging buffer: {rc}"
            )
        self._lock = threading.Lock()
        self.packed_keys = 0
        self.passed_through_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    @property
    def rows_per_call(self) -> int:
        return self._staging.shape[0]

    def close(self) -> None:
        """Unregister the staging buffer (before it is freed, or a later
        allocation at the same address fails to register)."""
        self._store.unregister_buffer(self._staging.data_ptr())

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], config: Any
    ) -> list[int]:
        ids = self.packer.block_ids(addrs, sizes)
        if ids is None:
            self.passed_through_calls += 1
            return self._store.batch_put_from_multi_buffers(keys, addrs, sizes, config)
        results: list[int] = []
        with self._lock:
            for start in range(0, len(keys), self.rows_per_call):
                chunk = slice(start, start + self.rows_per_call)
                rows = self._staging[: len(keys[chunk])]
                pack_blocks(self.packer.layers, ids[chunk], out=rows)
                _settle(rows)
                results += self._store.batch_put_from(
                    keys[chunk], _row_addresses(rows), [rows.shape[1]] * rows.shape[0], config
                )
        self.packed_keys += len(keys)
        return results

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        ids = self.packer.block_ids(addrs, sizes)
        if ids is None:
            self.passed_through_calls += 1
            return self._store.batch_get_into_multi_buffers(keys, addrs, sizes)
        results: list[int] = []
        with self._lock:
            for start in range(0, len(keys), self.rows_per_call):
                chunk = slice(start, start + self.rows_per_call)
                rows = self._staging[: len(keys[chunk])]
                got = list(
                    self._store.batch_get_into(
                        keys[chunk], _row_addresses(rows), [rows.shape[1]] * rows.shape[0]
                    )
                )
                for i, value in enumerate(got):
                    if 0 <= value != rows.shape[1]:
                        log.warning(
                            "store object %s has %d bytes, a packed block %d: not loaded",
                            keys[chunk][i],
                            value,
                            rows.shape[1],
                        )
                        got[i] = SIZE_MISMATCH
                loaded = [i for i, value in enumerate(got) if value >= 0]
                if loaded:
                    packed = rows if len(loaded) == len(got) else rows[loaded]
                    unpack_blocks(packed, self.packer.layers, [ids[chunk][i] for i in loaded])
                    _settle(rows)
                results += got
        self.packed_keys += len(keys)
        return results


def _row_addresses(rows: torch.Tensor) -> list[int]:
    return [rows.data_ptr() + i * rows.stride(0) for i in range(rows.shape[0])]


def _settle(rows: torch.Tensor) -> None:
    """GPU copies are asynchronous: finish them before the store reads the
    staging buffer, or before vLLM is told a load is done."""
    if rows.device.type == "cuda":
        torch.cuda.synchronize(rows.device)
