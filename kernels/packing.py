"""Packed per-block KV: every layer's page of one KV block in one contiguous row.

vLLM keeps each layer's KV in its own paged region, so one block is one piece
per layer (30 for SmolLM2), each moved as its own descriptor by the store
connector and by NIXL. :func:`pack_blocks` gathers the pages of a list of
blocks into rows of :func:`packed_block_bytes` bytes, one row per block;
:func:`unpack_blocks` scatters rows back into the layers' pages.

Row layout: the page of ``layers[0]``, then ``layers[1]``, ...; each page is
the bytes of ``layer[block_id]`` in memory order, exactly as they sit in the
cache (``README.md`` spells out K/V order for vLLM's layouts). That is also
the byte order of the object vLLM's MooncakeStoreConnector writes from one
buffer per layer, so a packed put and an unpacked put store the same bytes.

Everything works on bytes (words of up to 8 bytes when sizes and addresses
allow): any dtype, fp8 included, moves bit-exactly, and any block size is
just a page size. A layer is any tensor ``[num_blocks, ...]`` whose per-block
page is one dense run of memory (strides may be permuted, and blocks may sit
further apart than a page, as in vLLM's block-outer layouts).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import triton
import triton.language as tl

from kernels import backend as backends

# Widest word first: copies move words when every size and address allows.
_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
_MAX_CHUNK_WORDS = 2048


def block_pages(cache: torch.Tensor) -> torch.Tensor:
    """The bytes of each block of one layer's paged cache, in memory order: a
    uint8 view ``[num_blocks, page_bytes]`` of the same storage (no copy)."""
    page_bytes, block_stride = _page_geometry(cache)
    return _storage_view(cache, torch.uint8, (cache.shape[0], page_bytes), (block_stride, 1))


def packed_block_bytes(layers: Sequence[torch.Tensor]) -> int:
    """Bytes of one packed block: the sum of the layers' page sizes."""
    _check_layers(layers)
    return sum(_page_geometry(cache)[0] for cache in layers)


def pack_blocks(
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Rows ``[len(block_ids), packed_block_bytes]`` (uint8): row ``i`` is block
    ``block_ids[i]`` of every layer. ``out``, if given, is filled and returned
    (a contiguous uint8 tensor of that shape, e.g. a registered staging buffer)."""
    row_bytes = packed_block_bytes(layers)
    device = layers[0].device
    ids = _block_ids(block_ids, layers, device)
    if out is None:
        out = torch.empty((ids.numel(), row_bytes), dtype=torch.uint8, device=device)
    _check_rows(out, ids.numel(), row_bytes, device, "out")
    chosen = backends.resolve(backend, device, _page_copy_kernel)
    if chosen == "reference":
        out.copy_(pack_blocks_reference(layers, ids.tolist()))
    elif ids.numel():
        pages, row = _word_views(layers, out)
        if chosen == "torch":
            for i, block, page, (start, end) in _page_pieces(pages, ids):
                row[i, start:end].copy_(page[block])
        else:
            _launch(pages, row, ids, to_rows=True)
    return out


def unpack_blocks(
    packed: torch.Tensor,
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Write row ``i`` of ``packed`` into block ``block_ids[i]`` of every layer
    (the inverse of :func:`pack_blocks`; block ids must be distinct)."""
    row_bytes = packed_block_bytes(layers)
    device = layers[0].device
    ids = _block_ids(block_ids, layers, device)
    if ids.numel() != len(set(ids.tolist())):
        raise ValueError("block_ids: unpacking into the same block twice")
    _check_rows(packed, ids.numel(), row_bytes, device, "packed")
    chosen = backends.resolve(backend, device, _page_copy_kernel)
    if chosen == "reference":
        unpack_blocks_reference(packed, layers, ids.tolist())
    elif ids.numel():
        pages, row = _word_views(layers, packed)
        if chosen == "torch":
            for i, block, page, (start, end) in _page_pieces(pages, ids):
                page[block].copy_(row[i, start:end])
        else:
            _launch(pages, row, ids, to_rows=False)


# -- reference: what is correct ------------------------------------------------


def pack_blocks_reference(
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
) -> torch.Tensor:
    """Block by block, layer by layer: each page's elements in memory order
    (dimensions by decreasing stride), as bytes, concatenated."""
    row_bytes = packed_block_bytes(layers)
    rows = [
        torch.cat([_memory_order(cache[b]).reshape(-1).view(torch.uint8) for cache in layers])
        for b in block_ids
    ]
    if not rows:
        return torch.empty((0, row_bytes), dtype=torch.uint8, device=layers[0].device)
    return torch.stack(rows)


def unpack_blocks_reference(
    packed: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: Sequence[int]
) -> None:
    for row, b in zip(packed, block_ids):
        offset = 0
        for cache in layers:
            page = _memory_order(cache[b])
            size = page.numel() * cache.element_size()
            page.copy_(row[offset : offset + size].clone().view(cache.dtype).view(page.shape))
            offset += size


def _memory_order(page: torch.Tensor) -> torch.Tensor:
    order = sorted(range(page.dim()), key=lambda d: page.stride(d), reverse=True)
    return page.permute(order)


# -- Triton kernels -------------------------------------------------------------
# One program copies one chunk of one layer's page of one block. Page bases,
# block strides, page sizes and row offsets come per layer from small tables
# (layers need not share an allocation); all in words of the row's dtype.


@triton.jit
def _page_copy_kernel(
    rows,
    row_words,
    page_bases,
    block_strides,
    page_words,
    row_offsets,
    block_ids,
    CHUNK: tl.constexpr,
    TO_ROWS: tl.constexpr,
):
    """Pages to rows (pack) when ``TO_ROWS``, rows to pages (unpack) otherwise."""
    i = tl.program_id(0)
    layer = tl.program_id(1)
    offs = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < tl.load(page_words + layer)
    block = tl.load(block_ids + i).to(tl.int64)
    page = tl.load(page_bases + layer).to(rows.dtype) + block * tl.load(block_strides + layer)
    row = rows + i.to(tl.int64) * row_words + tl.load(row_offsets + layer)
    if TO_ROWS:
        tl.store(row + offs, tl.load(page + offs, mask=mask), mask=mask)
    else:
        tl.store(page + offs, tl.load(row + offs, mask=mask), mask=mask)


def _launch(pages: list[torch.Tensor], row: torch.Tensor, ids: torch.Tensor, to_rows: bool) -> None:
    device = row.device
    spans = _spans(pages)

    def table(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    page_words = [p.shape[1] for p in pages]
    chunk = min(_MAX_CHUNK_WORDS, triton.next_power_of_2(max(page_words)))
    grid = (ids.numel(), len(pages), triton.cdiv(max(page_words), chunk))
    _page_copy_kernel[grid](
        row,
        row.shape[1],
        table([p.data_ptr() for p in pages]),
        table([p.stride(0) for p in pages]),
        table(page_words),
        table([start for start, _ in spans]),
        ids,
        CHUNK=chunk,
        TO_ROWS=to_rows,
    )


# -- geometry and checks ----------------------------------------------------------


def _check_layers(layers: Sequence[torch.Tensor]) -> None:
    if not layers:
        raise ValueError("layers: need at least one layer")
    first = layers[0]
    for index, cache in enumerate(layers):
        if cache.device != first.device:
            raise ValueError(f"layers[{index}] is on {cache.device}, layers[0] on {first.device}")
        if cache.dim() < 2 or cache.shape[0] != first.shape[0]:
            raise ValueError(
                f"layers[{index}] has shape {tuple(cache.shape)}: every layer must "
                f"be [num_blocks={first.shape[0]}, ...]"
            )


def _page_geometry(cache: torch.Tensor) -> tuple[int, int]:
    """(page bytes, block stride in bytes) of one layer; raises if a block's
    page is not one dense run of memory or pages overlap."""
    if cache.dim() < 2 or cache.shape[0] == 0:
        raise ValueError(f"a layer must be [num_blocks, ...], got shape {tuple(cache.shape)}")
    if any(s < 0 for s in cache.stride()):
        raise ValueError(f"negative strides {cache.stride()} are not supported")
    page = cache[0]
    if page.numel() == 0 or not _dense(page):
        raise ValueError(
            f"each block's page must be one dense run of memory; shape "
            f"{tuple(cache.shape)} with strides {cache.stride()} is not"
        )
    size = cache.element_size()
    page_bytes = page.numel() * size
    block_stride = cache.stride(0) * size if cache.shape[0] > 1 else page_bytes
    if block_stride < page_bytes:
        raise ValueError(
            f"blocks overlap: block stride {block_stride} bytes < page {page_bytes} bytes"
        )
    return page_bytes, block_stride


def _dense(t: torch.Tensor) -> bool:
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _storage_view(
    cache: torch.Tensor, dtype: torch.dtype, size: tuple[int, int], byte_stride: tuple[int, int]
) -> torch.Tensor:
    """A ``dtype`` view of ``cache``'s storage, starting at its first element;
    ``byte_stride`` in bytes (each a multiple of the dtype's size)."""
    width = dtype.itemsize
    offset = cache.storage_offset() * cache.element_size()
    view = torch.empty(0, dtype=dtype, device=cache.device)
    return view.set_(
        cache.untyped_storage(),
        offset // width,
        size,
        (byte_stride[0] // width, byte_stride[1] // width),
    )


def _word_views(
    layers: Sequence[torch.Tensor],
    rows: torch.Tensor,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The widest word every page, block stride, address and row allows, with
    each layer's pages ``[num_blocks, page_words]`` and the rows in it."""
    byte_pages = [block_pages(cache) for cache in layers]
    for dtype in _WORD_DTYPES:
        width = dtype.itemsize
        if (
            rows.data_ptr() % width == 0
            and rows.shape[1] % width == 0
            and all(
                p.shape[1] % width == 0 and p.stride(0) % width == 0 and p.data_ptr() % width == 0
                for p in byte_pages
            )
        ):
            break
    pages = [
        _storage_view(cache, dtype, (p.shape[0], p.shape[1] // width), (p.stride(0), width))
        for cache, p in zip(layers, byte_pages)
    ]
    return pages, rows.view(dtype)


def _page_pieces(
    pages: list[torch.Tensor],
    ids: torch.Tensor,
) -> Iterator[tuple[int, int, torch.Tensor, tuple[int, int]]]:
    """(row, block id, layer's pages, the layer's span in the row) of every
    page to copy, row by row. One plain copy per page: gathering a layer's
    pages with ``index_select`` ran at a tenth of memcpy speed on CPU
    (``make bench-kernels``), a copy per page at memcpy speed."""
    spans = _spans(pages)
    for i, block in enumerate(ids.tolist()):
        for page, span in zip(pages, spans):
            yield i, block, page, span


def _spans(pages: list[torch.Tensor]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for page in pages:
        spans.append((start, start + page.shape[1]))
        start += page.shape[1]
    return spans


def _block_ids(
    block_ids: Sequence[int] | torch.Tensor, layers: Sequence[torch.Tensor], device: torch.device
) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=device)
    if ids.dim() != 1:
        raise ValueError(f"block_ids must be one-dimensional, got shape {tuple(ids.shape)}")
    num_blocks = layers[0].shape[0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(
            f"block_ids must lie in [0, {num_blocks}), got {int(ids.min())}..{int(ids.max())}"
        )
    return ids


def _check_rows(
    rows: torch.Tensor, count: int, row_bytes: int, device: torch.device, name: str
) -> None:
    if (
        rows.dtype != torch.uint8
        or tuple(rows.shape) != (count, row_bytes)
        or not rows.is_contiguous()
        or rows.device != device
    ):
        raise ValueError(
            f"{name}: need a contiguous uint8 tensor of shape ({count}, {row_bytes}) "
            f"on {device}, got {rows.dtype} {tuple(rows.shape)} on {rows.device}"
        )
