"""``paged_attention``: decode attention over the paged KV cache (chapter 07).

In a decode step every sequence brings exactly one new query token, and that
token attends over the sequence's whole context, read from the cache through
its block table. There is almost no arithmetic per byte read, so this kernel
is about reading the cache at full memory bandwidth.

**One program per (sequence, KV head).** With grouped-query attention (GQA)
several query heads share one KV head. Loading that head's K/V once and using it
for the whole group divides the cache traffic by the group size, so a program
holds *all* query heads of its group as the rows of one tile:

    q tile  [GROUP_ROWS, head_dim]   rows = the group's query heads (padded)
    K tile  [BLOCK_N,   head_dim]    BLOCK_N token positions, possibly several blocks
    scores  [GROUP_ROWS, BLOCK_N]  = q @ K.T   (tl.dot)

``tl.dot`` needs at least 16 rows on a GPU, so the group (1 to 8 heads, any
count) is padded to 16 rows; the padding rows are zeros, computed and dropped.

**Split-KV ("flash-decoding") for small batches.** A batch of one sequence with
8 KV heads would give 8 programs: a GPU with 132 multiprocessors would sit
nearly idle. So the context may be cut into ``num_splits`` pieces, one program
each; each writes its partial result with its log-sum-exp, and a second small
kernel (:func:`_combine_splits_kernel`) merges them exactly:

    out = sum_i 2**(lse_i - lse_max) * out_i  /  sum_i 2**(lse_i - lse_max)

**Sliding window.** With one, the context a program reads starts at the
decode query's window start (:func:`mini_vllm.kernels._attention_tiles.window_start`)
instead of position 0, and the splits share out that shorter context.
"""

from __future__ import annotations

import functools
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
def _paged_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scale_log2,
    tokens_per_split,
    num_splits,
    head_dim,
    stride_out_seq,
    stride_out_head,
    stride_query_seq,
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
    GROUP_ROWS: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_TF32: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The context is positions [context_start, seq_len), context_start being 0
    # without a sliding window. This program's share of it: positions [start, end).
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = window_start(seq_len - 1, SLIDING_WINDOW)
    if SPLIT:
        start = context_start + split * tokens_per_split
        end = tl.minimum(seq_len, start + tokens_per_split)
    else:
        start = context_start
        end = seq_len

    # The query heads of this KV head's group are the tile's rows.
    rows = tl.arange(0, GROUP_ROWS)
    row_mask = rows < GROUP
    q_heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim

    q_ptrs = (
        query_ptr + seq * stride_query_seq + q_heads[:, None] * stride_query_head + dims[None, :] * stride_query_dim
    )
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)

    running_max = tl.full([GROUP_ROWS], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([GROUP_ROWS], dtype=tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM_PAD], dtype=tl.float32)

    block_table_ptr = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        position_mask = positions < end
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
        # The decode query is the sequence's last token: it may see every position.
        scores = scores_of_tile(q, k, scale_log2, position_mask[None, :], USE_TF32)
        running_max, running_sum, acc = online_softmax_step(scores, v, running_max, running_sum, acc, USE_TF32)

    out = finish_softmax(acc, running_sum)
    store_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        # Partial results in float32: [num_seqs, num_q_heads, num_splits, HEAD_DIM_PAD]
        # and the log-sum-exp (base 2) [num_seqs, num_q_heads, num_splits]. An
        # empty split (past the end of a short sequence) stores lse = -inf,
        # which gives it weight 0 when the splits are combined.
        safe_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
        lse = tl.where(running_sum == 0.0, float("-inf"), running_max + tl.log2(safe_sum))
        partial_row = (seq * tl.num_programs(1) * GROUP + q_heads) * num_splits + split
        tl.store(partial_lse_ptr + partial_row, lse, mask=row_mask)
        tl.store(partial_out_ptr + partial_row[:, None] * HEAD_DIM_PAD + dims[None, :], out, mask=store_mask)
    else:
        out_ptrs = out_ptr + seq * stride_out_seq + q_heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    num_splits,
    head_dim,
    stride_out_seq,
    stride_out_head,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One program per (sequence, query head): merge its splits' partial results."""
    seq = tl.program_id(0).to(tl.int64)
    q_head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim

    first_row = (seq * tl.num_programs(1) + q_head) * num_splits
    lse = tl.load(partial_lse_ptr + first_row + splits, mask=split_mask, other=float("-inf"))
    partial = tl.load(
        partial_out_ptr + (first_row + splits)[:, None] * HEAD_DIM_PAD + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    lse_max = tl.max(lse, axis=0)
    # All splits empty (a sequence of length 0): keep weights 0 instead of NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    # tl.where, not a product: an empty split's weight is 0 and its output is 0
    # too, but 0 * NaN would be NaN if anything upstream ever left one there.
    weighted = tl.where(weights[:, None] > 0.0, weights[:, None] * partial, 0.0)
    out = tl.sum(weighted, axis=0) / total
    tl.store(
        out_ptr + seq * stride_out_seq + q_head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_programs: int, max_context: int, device: torch.device) -> int:
    """How many pieces to cut each context into so that the GPU has enough programs.

    Aim for about two programs per multiprocessor, but never give a split fewer
    than 256 positions: below that, combining costs more than it saves. In the
    interpreter (no GPU to fill) there is no reason to split.
    """
    if TRITON_INTERPRETED or device.type != "cuda":
        return 1
    target_programs = 2 * _num_sms(device)
    if num_programs >= target_programs:
        return 1
    wanted = math.ceil(target_programs / num_programs)
    most_useful = max(1, max_context // 256)
    return max(1, min(wanted, most_useful))


def default_launch_config(interpreted: bool) -> dict[str, int]:
    """Tile width and launch settings.

    In the interpreter, small tiles make short test sequences take several
    loop iterations. On the GPU, 64 positions per tile with 4 warps and a
    2-stage load pipeline was the fastest setting measured on an H200
    (``benchmarks/kernels.py --sweep``: 91% of the copy bandwidth at batch 64,
    4k context, against 68% with 3 stages).
    """
    if interpreted:
        return {"block_n": 16, "num_warps": 4, "num_stages": 1}
    return {"block_n": 64, "num_warps": 4, "num_stages": 2}


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Decode attention: one query token per sequence, over its whole context (or its window).

    Args:
        query: ``[num_seqs, num_q_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_num_blocks]`` int32, padded with 0.
        seq_lens: ``[num_seqs]`` int32, context length including the new token.
        scale: softmax scale, ``1/sqrt(head_dim)`` by default.
        sliding_window: None for full attention; else ``W`` (a positive int):
            the query sees only its sequence's last ``W`` keys, and only those
            are read (table entries before them may hold the placeholder 0).
        max_seq_len: an upper bound on ``seq_lens``, if known (it sizes the
            splits); otherwise the block table's width times the block size,
            which needs no GPU sync.
        num_splits, block_n, num_warps, num_stages: override the launch
            heuristics (tests and benchmarks).

    Returns ``[num_seqs, num_q_heads, head_dim]`` in ``query``'s dtype, equal to
    :func:`mini_vllm.kernels.reference.paged_attention` up to float rounding.
    """
    check_attention(query, k_cache, v_cache, block_tables, seq_lens, TRITON_INTERPRETED)
    check_sliding_window(sliding_window)
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
    if num_seqs == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    block_n, num_warps, num_stages = resolve_launch_settings(
        default_launch_config(TRITON_INTERPRETED), block_n, num_warps, num_stages
    )
    group = num_q_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)

    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    # The longest context a program reads: a sliding window caps it.
    max_context = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * num_kv_heads, max_context, query.device)
    # Every split but the last gets the same whole number of tiles.
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max_context, tokens_per_split))
    split = num_splits > 1

    if split:
        partial_out = torch.empty(
            (num_seqs, num_q_heads, num_splits, head_dim_pad), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=query.device)
    else:
        # Unused, but the kernel needs some pointer there.
        partial_out = out
        partial_lse = out

    _paged_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        out,
        partial_out,
        partial_lse,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale * LOG2_E,
        tokens_per_split,
        num_splits,
        head_dim,
        out.stride(0),
        out.stride(1),
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        GROUP=group,
        GROUP_ROWS=max(16, triton.next_power_of_2(group)),
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        SLIDING_WINDOW=int(sliding_window or 0),  # 0: full attention
        USE_TF32=use_tf32(query, k_cache, v_cache, TRITON_INTERPRETED),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _combine_splits_kernel[(num_seqs, num_q_heads)](
            out,
            partial_out,
            partial_lse,
            num_splits,
            head_dim,
            out.stride(0),
            out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM_PAD=head_dim_pad,
        )
    return out
