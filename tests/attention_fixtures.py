"""What the attention-backend tests share: a ``mini_vllm.kernels.testing.PagedBatch`` as the engine's metadata."""

from __future__ import annotations

from mini_vllm.kernels.testing import PagedBatch
from mini_vllm.attention import AttentionMetadata


def metadata_of(batch: PagedBatch, sliding_window: int | None = None) -> AttentionMetadata:
    """The ``AttentionMetadata`` a model runner would build for ``batch``'s step (one KV-cache group's)."""
    return AttentionMetadata(
        slot_mapping=batch.slot_mapping,
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        cu_seqlens_q=batch.cu_seqlens_q,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        sliding_window=sliding_window,
    )
