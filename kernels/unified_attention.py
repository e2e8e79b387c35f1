"""``unified_attention``: prefill, chunked prefill and decode in one launch (chapter 07).

Every sequence in the batch brings its *last* ``q_len`` tokens as queries:

- a prefill over a cached prefix: 3000 tokens cached, 1000 new → ``q_len`` 1000;
- a chunk of a long prefill: the chunk is the new part, what came before is cached;
- a decode step: ``q_len`` 1.

With ``context_len = seq_len - q_len`` cached positions in front, query ``i`` of
the sequence sits at position ``context_len + i`` and, being causal, sees the
keys at positions ``0 .. context_len + i``. The K/V of the new tokens are
already in the cache (``store_kv`` ran first), so every key is read the same
way: through the block table.

**The grid: (sequence, KV head, query block).** A program takes ``BLOCK_Q``
consecutive query tokens of one sequence and *all* the query heads of one GQA
group, and lays them out as the rows of one tile:

    row r  →  query token  r // GROUP_PAD,  query head  r % GROUP_PAD  (of the group)

so K/V loaded once serve ``BLOCK_Q * GROUP`` rows. A group of 3 is padded to 4
(``GROUP_PAD``); padding rows load zeros and are never stored.

The grid has ``cdiv(max_query_len, BLOCK_Q)`` query blocks for every sequence;
a program past its sequence's last query finds nothing to do and stores
nothing. (vLLM's version launches only the blocks that exist and lets each
program search for its sequence; simpler is better here.)

A program walks the keys in tiles of ``BLOCK_N`` positions and stops after
the last position its last query may see: keys to the right of the diagonal
are never loaded. With a sliding window it also starts late, at the window
start of its first query (:func:`mini_vllm.kernels._attention_tiles.window_start`):
keys too far to the left are never loaded either.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mini_vllm.validation import check_sliding_window

from . import TRITON_INTERPRETED
from ._attention_tiles import (
    LOG2_E,
    finish_softmax,
    load_kv_tile,
    online_softmax_step,
    resolve_launch_settings,
    scores_of_tile,
    use_tf32,
    window_start,
)
from ._validate import check_attention


@triton.jit
def _unified_attention_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    head_dim,
    stride_out_token,
    stride_out_head,
    stride_query_token,
    stride_query_head,
    stride_query_dim,
    stride_k_block,
    stride_k_offset,
    stride_k_head,
    stride_k_dim,
    stride_v_block,
    stride_v_offset,
    stride_v_head,
    stride_v_dim,
    stride_table_seq,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_TF32: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Rows of the tile: BLOCK_Q query tokens x GROUP_PAD query heads.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_index = q_block * BLOCK_Q + rows // GROUP_PAD  # which of the sequence's queries
    head_in_group = rows % GROUP_PAD
    row_mask = (q_index < q_len) & (head_in_group < GROUP)
    q_heads = kv_head * GROUP + head_in_group
    q_tokens = (q_start + q_index).to(tl.int64)  # row in the packed query tensor
    q_positions = context_len + q_index  # position in the sequence (causal mask)

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim
    q_ptrs = (
        query_ptr
        + q_tokens[:, None] * stride_query_token
        + q_heads[:, None] * stride_query_head
        + dims[None, :] * stride_query_dim
    )
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)

    running_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    # The block's last query sees up to position context_len + last_q_index;
    # a block with no queries at all (past this sequence's q_len) loops zero times.
    last_q_index = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    num_keys = tl.where(q_block * BLOCK_Q < q_len, tl.minimum(seq_len, context_len + last_q_index + 1), 0)
    # The block's first query sees nothing before first_key (0 without a sliding window).
    first_key = window_start(context_len + q_block * BLOCK_Q, SLIDING_WINDOW)

    block_table_ptr = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(first_key, num_keys, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        position_mask = positions < seq_len
        k = load_kv_tile(
            k_cache_ptr,
            block_table_ptr,
            positions,
            position_mask,
            kv_head,
            dims,
            dim_mask,
            stride_k_block,
            stride_k_offset,
            stride_k_head,
            stride_k_dim,
            BLOCK_SIZE,
        )
        v = load_kv_tile(
            v_cache_ptr,
            block_table_ptr,
            positions,
            position_mask,
            kv_head,
            dims,
            dim_mask,
            stride_v_block,
            stride_v_offset,
            stride_v_head,
            stride_v_dim,
            BLOCK_SIZE,
        )
        causal = positions[None, :] <= q_positions[:, None]
        allowed = position_mask[None, :] & causal
        if SLIDING_WINDOW > 0:
            allowed = allowed & (positions[None, :] >= window_start(q_positions, SLIDING_WINDOW)[:, None])
        scores = scores_of_tile(q, k, scale_log2, allowed, USE_TF32)
        running_max, running_sum, acc = online_softmax_step(scores, v, running_max, running_sum, acc, USE_TF32)

    out = finish_softmax(acc, running_sum)
    out_ptrs = out_ptr + q_tokens[:, None] * stride_out_token + q_heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def default_launch_config(interpreted: bool, tile_rows: int) -> dict[str, int]:
    """Launch settings for a tile of ``tile_rows`` rows.

    In the interpreter, small tiles make short test sequences take several
    loop iterations. On the GPU (measured on an H200 with
    ``benchmarks/kernels.py --sweep``): big prefill tiles (128 rows) run best
    with 8 warps and a 3-stage pipeline; decode-sized tiles (16 rows) with 4
    warps and 2 stages, as in ``paged_attention``.
    """
    if interpreted:
        return {"block_n": 16, "num_warps": 4, "num_stages": 1}
    if tile_rows >= 128:
        return {"block_n": 64, "num_warps": 8, "num_stages": 3}
    return {"block_n": 64, "num_warps": 4, "num_stages": 2}


def unified_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float | None = None,
    *,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention for a mixed batch of prefills, prefill chunks and decodes.

    Args:
        query: ``[total_q, num_q_heads, head_dim]``; sequence ``s`` owns rows
            ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, its last ``q_len`` tokens.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            already holding the new tokens' K/V.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 prefix sums of the query lengths.
        seq_lens: ``[num_seqs]`` int32 total tokens per sequence (cached + new).
        block_tables: ``[num_seqs, max_num_blocks]`` int32, padded with 0.
        scale: softmax scale, ``1/sqrt(head_dim)`` by default.
        sliding_window: None for full causal attention; else ``W`` (a positive
            int): the query at position ``p`` sees only the keys at
            ``p - W + 1 .. p``. Table entries of blocks entirely before every
            query's window are never read (they may hold the placeholder 0).
        max_query_len: the longest ``q_len`` if known; otherwise it is computed
            from ``cu_seqlens_q`` (one small GPU→CPU copy).
        block_m, block_n, num_warps, num_stages: override the launch
            heuristics (tests and benchmarks). ``block_m`` is the tile's row
            count (query tokens x padded group).

    Returns ``[total_q, num_q_heads, head_dim]`` in ``query``'s dtype, equal to
    :func:`mini_vllm.kernels.reference.unified_attention` up to float rounding.
    """
    check_attention(query, k_cache, v_cache, block_tables, seq_lens, TRITON_INTERPRETED, cu_seqlens_q)
    check_sliding_window(sliding_window)
    total_q, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
    if total_q == 0 or num_seqs == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if max_query_len <= 0:
        return out

    # The tile's row budget: 16 rows in the interpreter, 128 on a GPU.
    block_m = block_m or (16 if TRITON_INTERPRETED else 128)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16 (tl.dot needs it), got {block_m}")

    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # As many query tokens as fit in block_m rows (at least one token).
    block_q = max(1, block_m // group_pad)
    # A decode-only batch needs only one query token per tile; do not waste rows.
    block_q = min(block_q, triton.next_power_of_2(max_query_len))
    # ...but tl.dot needs a tile of at least 16 rows.
    block_q = max(block_q, triton.cdiv(16, group_pad))

    block_n, num_warps, num_stages = resolve_launch_settings(
        default_launch_config(TRITON_INTERPRETED, tile_rows=block_q * group_pad), block_n, num_warps, num_stages
    )

    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _unified_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        scale * LOG2_E,
        head_dim,
        out.stride(0),
        out.stride(1),
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SLIDING_WINDOW=int(sliding_window or 0),  # 0: full attention
        USE_TF32=use_tf32(query, k_cache, v_cache, TRITON_INTERPRETED),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
