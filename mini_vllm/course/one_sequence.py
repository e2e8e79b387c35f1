"""One sequence through the model, by hand: chapter 01's two helpers.

The engine's ``ModelRunner`` packs many sequences into one forward over a
shared, paged pool. Chapter 01 starts with the simplest case: ONE sequence
that owns a cache of its own, its blocks in order. :func:`contiguous_kv_cache`
makes that cache and :func:`run_model` runs one forward over it, with the
same ``AttentionMetadata`` the model runner builds. Chapter 01, its exercise
(a greedy decode loop) and the exercise's check all use these two.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import AttentionMetadata

BLOCK_SIZE = 16


def contiguous_kv_cache(
    config: Any,
    max_tokens: int,
    block_size: int = BLOCK_SIZE,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list:
    """A KV cache for ONE sequence of up to max_tokens tokens: per layer a (K, V) pair.

    Same layout as the engine's pool, [num_blocks, block_size, num_kv_heads, head_dim],
    but this sequence owns every block, in order: its block table is [0, 1, 2, ...],
    so token p is stored in row p of the flattened cache (chapter 03 does the general case).
    """
    num_blocks = -(-max_tokens // block_size)  # ceiling division
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]


@torch.inference_mode()
def run_model(
    model: Any, kv_caches: list, token_ids: list[int], positions: list[int], seq_len: int, *, all_logits: bool = False
) -> torch.Tensor:
    """One forward pass of ONE sequence; returns the logits of the last token fed.

    token_ids, positions: the tokens to compute now and where they sit in the sequence.
    seq_len: how many tokens the sequence has in the cache AFTER this forward (those
    already cached + those fed now); attention reads exactly that many.
    Every layer first writes the new tokens' K/V into the cache, then attends over it.
    all_logits: return the logits of every token fed, [len(token_ids), vocab_size].
    """
    device = kv_caches[0][0].device
    num_blocks = kv_caches[0][0].shape[0]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(positions, dtype=torch.int64, device=device),  # contiguous: slot == position
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],  # [[0, 1, 2, ...]]
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, len(token_ids)], dtype=torch.int32, device=device),
        max_query_len=len(token_ids),
        max_seq_len=seq_len,
    )
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    hidden = model(ids, torch.tensor(positions, dtype=torch.int64, device=device), kv_caches, metadata)
    return model.compute_logits(hidden if all_logits else hidden[-1])
