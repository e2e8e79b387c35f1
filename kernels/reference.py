"""Plain PyTorch versions of the kernels, written to be read (chapters 03 and 07).

These are the oracles: the Triton kernels in this package and the engine's
``torch`` attention backend are checked against them. They favour clarity over
speed: every sequence is handled on its own, and the paged cache is gathered
into a dense tensor before attention.

Cache layout (shared with vLLM's FlashAttention backend):
``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A *slot* is ``block_id * block_size + offset``: the flat index of one token's
K/V row once the first two dimensions are merged.
"""

from __future__ import annotations

import math

import torch

from mini_vllm.validation import check_sliding_window


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``i``'s key/value into cache slot ``slot_mapping[i]`` (in place).

    key, value: ``[num_tokens, num_kv_heads, head_dim]``; slot ``-1`` means
    "do not store" (vLLM uses it for padding tokens).
    """
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # View the cache as one row per slot: [num_blocks * block_size, H, D].
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Collect one sequence's first ``seq_len`` K/V rows from the paged cache.

    Returns dense ``[seq_len, num_kv_heads, head_dim]`` tensors: token ``t``
    lives in block ``block_table[t // block_size]`` at offset ``t % block_size``.
    """
    block_size = k_cache.shape[1]
    num_blocks_used = (seq_len + block_size - 1) // block_size
    block_ids = block_table[:num_blocks_used].long()
    # The sequence's whole blocks (one index_select per cache), then its first seq_len rows.
    keys = k_cache.index_select(0, block_ids).flatten(0, 1)[:seq_len]
    values = v_cache.index_select(0, block_ids).flatten(0, 1)[:seq_len]
    return keys, values


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    causal_offset: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``q_len`` queries over ``seq_len`` keys, in float32.

    Query ``i`` sits at position ``causal_offset + i`` and sees keys ``0..that``;
    with a sliding window ``W``, only the last ``W`` of them (itself included).
    Grouped-query attention: each KV head serves ``num_q_heads // num_kv_heads``
    consecutive query heads.
    """
    q_len, num_q_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_q_heads // num_kv_heads
    q = query.float().transpose(0, 1)  # [Hq, q_len, D]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, seq_len, D]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) * scale  # [Hq, q_len, seq_len]
    query_pos = causal_offset + torch.arange(q_len, device=query.device)[:, None]
    key_pos = torch.arange(seq_len, device=query.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    if sliding_window is not None:
        scores = scores.masked_fill(key_pos <= query_pos - sliding_window, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [Hq, q_len, D]
    return out.transpose(0, 1).to(query.dtype)


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
) -> torch.Tensor:
    """Attention for a mixed batch of prefills, prefill chunks and decodes.

    query: ``[total_q, num_q_heads, head_dim]``, sequences packed back to back;
    sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``. Its
    ``q_len`` queries are the *last* ``q_len`` of its ``seq_lens[s]`` tokens, so
    a prefill over a cached prefix, a prefill chunk and a decode step (q_len 1)
    are the same computation. The new tokens' K/V must already be in the cache.

    ``sliding_window``: None for full causal attention; else ``W``, and the
    query at position ``p`` sees only the keys at ``p - W + 1 .. p``. The keys
    before the first query's window are dropped before attention: their blocks
    may be freed already (the table holds the placeholder 0 there).
    """
    check_sliding_window(sliding_window)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[s], cu[s + 1]
        if end == start:
            continue
        keys, values = gather_kv(k_cache, v_cache, block_tables[s], seq_len)
        q_len = end - start
        context_len = seq_len - q_len
        # Keys from first_key on: positions shift by first_key for keys and queries alike.
        first_key = 0 if sliding_window is None else max(0, context_len - sliding_window + 1)
        out[start:end] = _attend(
            query[start:end], keys[first_key:], values[first_key:], scale, context_len - first_key, sliding_window
        )
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention: one query token per sequence (``[num_seqs, Hq, D]``).

    The query is the sequence's last token, so it sees all ``seq_lens[s]`` keys
    (with a sliding window ``W``: the last ``W`` of them).
    """
    num_seqs = query.shape[0]
    cu_seqlens_q = torch.arange(num_seqs + 1, device=query.device, dtype=torch.int32)
    return unified_attention(
        query, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, sliding_window=sliding_window
    )
