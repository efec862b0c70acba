"""vLLM's prefix-cache block hashes, computed outside the engine.

Each full block of ``block_size`` tokens hashes to
``H((parent_hash, tuple(block_tokens), extra_keys))``; the first block's
parent is ``NONE_HASH = H(seed)``. ``H`` is SHA-256 of the pickle (highest
protocol) for ``sha256`` and SHA-256 of canonical CBOR for ``sha256_cbor``.
The seed is ``PYTHONHASHSEED`` when set, else the fixed ``"vllm-none-hash"``.
``extra_keys`` is ``None`` or a tuple of tagged keys: a LoRA adapter as
``("lora", name, path)`` on every block and ``("cache_salt", salt)`` on block 0.

KV events carry the low 64 bits of each hash as an int, and the index keys
blocks the same way, so what the router computes and what engines publish
compare directly. No vLLM import: the router stays light; a test checks this
module against vLLM's own functions.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SEED = "vllm-none-hash"
SUPPORTED_ALGOS = ("sha256", "sha256_cbor")
_LOW_64 = (1 << 64) - 1


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only needed for this algorithm

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def hash_function(algo: str) -> Callable[[Any], bytes]:
    if algo == "sha256":
        return _sha256_pickle
    if algo == "sha256_cbor":
        return _sha256_cbor
    raise ValueError(
        f"prefix-caching hash algorithm {algo!r} is not reproducible outside the engine; "
        f"use one of {SUPPORTED_ALGOS} (xxhash variants use a per-process random seed)"
    )


def resolve_seed(seed: str | None = None) -> str:
    """The engines' NONE_HASH seed: explicit, else PYTHONHASHSEED, else vLLM's default."""
    if seed is not None:
        return seed
    return os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)


def to_event_hash(block_hash: bytes) -> int:
    """A block hash as KV events publish it: its low 64 bits, big-endian."""
    return int.from_bytes(block_hash, "big") & _LOW_64


class BlockHasher:
    """Hashes the full blocks of a token sequence exactly as the engines do."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.algo = algo
        self._hash = hash_function(algo)
        self.seed = resolve_seed(seed)
        self.none_hash = self._hash(self.seed)

    def block_hashes(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        start_parent: bytes | None = None,
    ) -> list[bytes]:
        """Full-width hashes (bytes) of every full block, in order.

        ``start_parent`` continues a chain whose earlier blocks were hashed
        before (incremental hashing for a session's growing prompt); block 0
        of the given tokens is then not the sequence's first block.
        """
        bs = self.block_size
        parent = start_parent or self.none_hash
        first = start_parent is None
        out: list[bytes] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            extra = self._extra_keys(first and start == 0, cache_salt, lora)
            parent = self._hash((parent, tuple(token_ids[start : start + bs]), extra))
            out.append(parent)
        return out

    def event_hashes(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[int]:
        """Hashes of every full block as KV events carry them (low 64 bits)."""
        return [to_event_hash(h) for h in self.block_hashes(token_ids, cache_salt, lora)]

    @staticmethod
    def _extra_keys(
        first_block: bool, cache_salt: str | None, lora: tuple[str, str] | None
    ) -> tuple[Any, ...] | None:
        # Same order as vLLM's generate_block_hash_extra_keys: LoRA, (mm), salt.
        keys: list[tuple[str, ...]] = []
        if lora:
            keys.append(("lora", *lora))
        if first_block and cache_salt:
            keys.append(("cache_salt", cache_salt))
        return tuple(keys) if keys else None
