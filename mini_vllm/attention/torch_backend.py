"""The ``torch`` attention backend: the readable reference (chapter 07).

It calls :mod:`kernels.reference`, the same plain-PyTorch functions the Triton
kernels are tested against, so this backend is correct by construction and
slow by design (one sequence at a time, the context gathered densely).
"""

from __future__ import annotations

import torch

from kernels import reference

from .base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: gather each sequence's K/V through its block table."""

    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return reference.unified_attention(
            query,
            k_cache,
            v_cache,
            metadata.cu_seqlens_q,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
        )
