"""The ``triton`` attention backend: the kernels of :mod:`mini_vllm.kernels` (chapter 07).

Same contract as the ``torch`` backend, same results up to float rounding, but
each step is one kernel launch for the whole batch instead of a Python loop
over sequences. On a GPU the kernels are compiled; on a CPU they run in
Triton's interpreter (correct, and slower than the torch backend: that mode is
for learning and testing, not for speed).
"""

from __future__ import annotations

import torch

from mini_vllm import kernels

from .base import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """``store_kv`` → :func:`mini_vllm.kernels.store_kv`; attention → the Triton attention kernels.

    An all-decode batch (one query token per sequence) goes to
    :func:`mini_vllm.kernels.paged_attention`, which can split long contexts across
    programs when the batch is small; everything else goes to
    :func:`mini_vllm.kernels.unified_attention`. Both take ``metadata.sliding_window``.
    """

    name = "triton"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if metadata.is_all_decode:
            return kernels.paged_attention(
                query,
                k_cache,
                v_cache,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                sliding_window=metadata.sliding_window,
                max_seq_len=metadata.max_seq_len,
            )
        return kernels.unified_attention(
            query,
            k_cache,
            v_cache,
            metadata.cu_seqlens_q,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            sliding_window=metadata.sliding_window,
            max_query_len=metadata.max_query_len,
        )
