"""Building blocks shared by the two attention kernels (chapter 07).

Both :mod:`mini_vllm.kernels.paged_attention` and :mod:`mini_vllm.kernels.unified_attention` walk
over a sequence's keys in tiles of ``BLOCK_N`` token positions, and for each
tile they

1. find where each position's K/V row lives in the paged cache
   (:func:`load_kv_tile`: block table lookup, then the row inside the block), and
2. fold the tile into a running softmax (:func:`online_softmax_step`), so that
   the whole ``[queries, keys]`` score matrix never exists at once.

With a sliding window, both kernels begin that walk at :func:`window_start`
instead of position 0 (its docstring explains the window).

A tile of ``BLOCK_N`` positions may span several cache blocks (64 positions are
four 16-token blocks): every position looks its own block up in the block
table. Reading a few block ids twice costs nothing next to reading the K/V
rows, and a wide tile keeps the GPU's memory system busy.

Numerics, for every dtype the cache may hold: values are converted to float32
right after they are loaded, and all arithmetic is float32. (Triton's CPU
interpreter also computes bfloat16 arithmetic and bfloat16 ``tl.dot``
incorrectly, triton#11584; converting first sidesteps that too.) The two dot
products take ``USE_TF32``: on a GPU, with float16/bfloat16 inputs, they run on
tensor cores in tf32 (see :func:`use_tf32` for why that loses nothing in
``q @ k.T``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    cache_ptr,
    block_table_ptr,
    positions,
    position_mask,
    kv_head,
    dims,
    dim_mask,
    stride_block,
    stride_offset,
    stride_head,
    stride_dim,
    BLOCK_SIZE: tl.constexpr,
):
    """Load the K (or V) rows of token ``positions`` of one KV head, as float32.

    ``block_table_ptr`` points at this sequence's row of the block table.
    Returns a ``[len(positions), len(dims)]`` tile; masked entries are 0.

    Every load is masked. Past the sequence's end the block table holds padding
    (block 0, a real block that belongs to someone else) and unused slots may
    hold anything, NaN included; a masked load never reads them.
    """
    logical_block = positions // BLOCK_SIZE
    physical_block = tl.load(block_table_ptr + logical_block, mask=position_mask, other=0)
    # int64 before multiplying by the block stride: block_id * stride can pass 2**31.
    physical_block = physical_block.to(tl.int64)
    offset_in_block = positions % BLOCK_SIZE
    row_start = physical_block * stride_block + offset_in_block * stride_offset + kv_head * stride_head
    ptrs = cache_ptr + row_start[:, None] + dims[None, :] * stride_dim
    tile = tl.load(ptrs, mask=position_mask[:, None] & dim_mask[None, :], other=0.0)
    return tile.to(tl.float32)


@triton.jit
def window_start(query_positions, SLIDING_WINDOW: tl.constexpr):
    """The first key position that a query at ``query_positions`` may see.

    Full attention (``SLIDING_WINDOW`` 0): position 0. A sliding window of
    ``W`` tokens: the query at position ``p`` sees only the keys at
    ``p - W + 1 .. p`` (``W`` keys, itself included), so its window starts at
    ``max(p - W + 1, 0)``.

    A kernel starts its walk over the keys at the window start of its
    *earliest* query: the tiles before it are never loaded, and neither are
    their entries of the block table (the null block's placeholder 0 stands
    there once those blocks are freed, and they may hold anything). A decode
    step then reads ``W`` keys however long the sequence. The later queries of
    a prefill start their windows further right: inside a tile, a key before a
    query's own window start is masked like a key after the query (causal).
    """
    if SLIDING_WINDOW > 0:
        start = tl.maximum(query_positions - SLIDING_WINDOW + 1, 0)
    else:
        start = 0
    return start


@triton.jit
def scores_of_tile(q, k, scale_log2, allowed, USE_TF32: tl.constexpr):
    """``q @ k.T``, scaled for base-2 exponentials, with disallowed pairs at -inf.

    The scale is applied *after* the product: ``q`` and ``k`` come from float16
    or bfloat16 values, which tf32 represents exactly, so on the GPU's tensor
    cores the product loses nothing; scaling ``q`` first would not keep that.
    """
    if USE_TF32:
        scores = tl.dot(q, tl.trans(k), input_precision="tf32")
    else:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    scores = scores * scale_log2
    return tl.where(allowed, scores, float("-inf"))


@triton.jit
def online_softmax_step(scores, v, running_max, running_sum, acc, USE_TF32: tl.constexpr):
    """Fold one tile of (base-2) scores and its V rows into the running softmax.

    State per query row: ``running_max`` (largest score so far), ``running_sum``
    (sum of ``2**(score - running_max)``) and ``acc`` (the same weights times V).
    When a tile raises the maximum, the old sum and accumulator are rescaled by
    ``2**(old_max - new_max)`` so that all terms share one reference.
    """
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    # A row that has seen only disallowed keys so far has new_max == -inf, and
    # -inf - (-inf) is NaN. Such a row takes 0 as its reference instead: its
    # weights 2**(-inf - 0) are then 0, as they should be.
    max_ref = tl.where(new_max == float("-inf"), 0.0, new_max)
    weights = tl.exp2(scores - max_ref[:, None])
    rescale = tl.exp2(running_max - max_ref)
    running_sum = running_sum * rescale + tl.sum(weights, axis=1)
    if USE_TF32:
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="tf32")
    else:
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
    return new_max, running_sum, acc


@triton.jit
def finish_softmax(acc, running_sum):
    """Divide by the softmax denominator; a row that saw no key at all gives 0, not NaN."""
    safe_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
    return acc / safe_sum[:, None]


LOG2_E = 1.4426950408889634
"""log2(e): exp(x) == exp2(x * LOG2_E); exp2 is the GPU's native exponential."""


def use_tf32(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, interpreted: bool) -> bool:
    """Whether the kernels' float32 dot products may run as tf32 on tensor cores.

    Only for float16/bfloat16 queries and caches on a GPU. Their values are
    exact in tf32 (10 mantissa bits), so every product in ``q @ k.T`` is exact
    and summed in float32; only the softmax weights in ``weights @ v`` are
    rounded, to tf32's 10 bits (FlashAttention rounds them to bf16's 7).
    Float32 inputs keep IEEE float32 products (tf32 would round them), and so
    does the interpreter. Tensor cores make this ~7x faster than IEEE float32
    on an H100/H200, which decode at a 16-row tile needs to stay memory-bound.
    """
    half_types = (torch.float16, torch.bfloat16)
    dtypes = (query.dtype, k_cache.dtype, v_cache.dtype)
    return (not interpreted) and all(dtype in half_types for dtype in dtypes)


def resolve_launch_settings(
    defaults: dict[str, int], block_n: int | None, num_warps: int | None, num_stages: int | None
) -> tuple[int, int, int]:
    """The launch settings: the caller's overrides (tests, benchmarks) or the defaults.

    ``block_n`` (key positions per tile) must be a power of two >= 16: ``tl.dot``
    needs at least 16 along each side of a tile.
    """
    block_n = block_n or defaults["block_n"]
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot needs it), got {block_n}")
    return block_n, num_warps or defaults["num_warps"], num_stages or defaults["num_stages"]
