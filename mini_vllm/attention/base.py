"""The attention backend interface and its per-step metadata (chapters 03, 07, 08).

The model runner builds one :class:`AttentionMetadata` per engine step; every
attention layer of the model receives it unchanged. A backend does two things
per layer, in this order:

1. ``store_kv``: write the K/V of *all* of this step's new tokens into their
   cache slots, and only then
2. attention: each sequence's new queries attend over its whole context, read
   from the paged cache through its block table.

The order matters: blocks are cached at schedule time, so a request admitted in
this step may hit a block that another request in this very step is computing.
Writing every new K/V of a layer before any attention of that layer reads the
cache makes that safe (vLLM relies on the same ordering).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step's batch (owned by the model runner).

    Sequences are packed back to back: sequence ``s`` owns rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of the step's tokens, and those rows are
    the last ``q_len`` of its ``seq_lens[s]`` tokens (cached prefix + new tokens).

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, the cache slot of each new token
            (``block_id * block_size + offset``), ``-1`` to skip a token.
        block_tables: ``[num_seqs, max_num_blocks]`` int32, physical block ids,
            padded with 0 past each sequence's last block (never read: masked
            by ``seq_lens``).
        seq_lens: ``[num_seqs]`` int32, tokens in each sequence *after* this step.
        cu_seqlens_q: ``[num_seqs + 1]`` int32, prefix sums of the query lengths.
        max_query_len: the longest query (1 for an all-decode batch).
        max_seq_len: the longest sequence.
        sliding_window: None for full attention; else the window ``W`` of a
            sliding-window layer: the query at position ``p`` attends only the
            keys at positions ``p - W + 1 .. p`` (``W`` tokens, itself
            included: transformers' and vLLM's convention). Where a request's
            table holds the null block (a block entirely before the window,
            already freed), ``block_tables`` holds the placeholder id 0: a
            backend must not let those entries change the result. The torch
            and triton backends never read them: each starts reading at its
            earliest query's window, so a decode reads ``W`` keys, not
            ``seq_len``.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int
    max_seq_len: int
    sliding_window: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def is_all_decode(self) -> bool:
        """One new token per sequence: the step every backend sends to its decode path."""
        return self.max_query_len == 1 and self.num_tokens == self.num_seqs


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache and computes attention over it.

    A backend owns no state between calls: the cache tensors belong to the
    model runner, the metadata to the step. Subclasses implement
    :meth:`store_kv` and :meth:`attention` (the types are written here, once);
    :meth:`forward` fixes their order.
    """

    name: str = "abstract"
    # True: the model runner installs the CPU's fast path (mini_vllm/cpu_fast_path.py: C kernels,
    # oneDNN-packed projections) on the model this backend serves. The ``cpu`` backend's.
    cpu_fast_path: bool = False

    @abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` (``[num_tokens, num_kv_heads, head_dim]``) into their slots."""

    @abstractmethod
    def attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``query`` (``[num_tokens, num_q_heads, head_dim]``) over the cache."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store this step's K/V for the whole batch, then attend (see module docstring)."""
        self.store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        return self.attention(query, k_cache, v_cache, metadata, scale)
