"""KV layout kernels of Tandem's data path (see README.md).

Each kernel has a plain PyTorch reference (``*_reference``) that defines what
is correct, a vectorized PyTorch path used on CPU and a Triton kernel used on
GPU; ``backend=`` picks one explicitly (:mod:`kernels.backend`).
"""

from kernels.attention_merge import merge_partial_attention, merge_partial_attention_reference
from kernels.dcp import (
    cpu_backend_token_view,
    reassemble_shards,
    reassemble_shards_reference,
    shard_lengths,
    shard_tokens,
    shard_tokens_reference,
)
from kernels.packing import (
    block_pages,
    pack_blocks,
    pack_blocks_reference,
    packed_block_bytes,
    unpack_blocks,
    unpack_blocks_reference,
)

__all__ = [
    "block_pages",
    "cpu_backend_token_view",
    "merge_partial_attention",
    "merge_partial_attention_reference",
    "pack_blocks",
    "pack_blocks_reference",
    "packed_block_bytes",
    "reassemble_shards",
    "reassemble_shards_reference",
    "shard_lengths",
    "shard_tokens",
    "shard_tokens_reference",
    "unpack_blocks",
    "unpack_blocks_reference",
]
