"""Random paged batches for testing and benchmarking the kernels (chapter 07).

:func:`make_paged_batch` builds what the model runner would hand to attention
in one step, with the awkward cases made deliberate:

- physical blocks are shuffled, so a sequence's blocks are not contiguous;
- every cache slot that no token owns holds NaN (or ``fill``), so a kernel that
  reads a slot it should not read produces NaN instead of a plausible number;
- the block table may be wider than needed, padded with block 0.

Only PyTorch is needed here (no Triton), so the notebooks can use it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference


@dataclass
class PagedBatch:
    """One step's attention inputs over a paged cache.

    Sequence ``s`` has ``seq_lens[s]`` tokens, of which the last
    ``query_lens[s]`` are new in this step: their queries are the rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of ``query``, their K/V are ``key``,
    ``value`` and belong in the slots ``slot_mapping``. The earlier tokens'
    K/V are already in the caches.
    """

    query: torch.Tensor  # [total_q, num_q_heads, head_dim]
    key: torch.Tensor  # [total_q, num_kv_heads, head_dim]
    value: torch.Tensor  # [total_q, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [total_q] int64
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int

    def store_new_kv(self) -> None:
        """Put the new tokens' K/V into the caches (with the reference store)."""
        reference.store_kv(self.key, self.value, self.k_cache, self.v_cache, self.slot_mapping)


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    fill: float = float("nan"),
    spare_blocks: int = 2,
    extra_table_columns: int = 1,
    block_zero_unused: bool = False,
) -> PagedBatch:
    """Build a :class:`PagedBatch` with random contents.

    Args:
        seq_lens, query_lens: per sequence; ``query_lens[s] <= seq_lens[s]``.
        spare_blocks: blocks that no sequence owns (they stay ``fill``).
        extra_table_columns: padding columns (block 0) in every table row.
        block_zero_unused: keep physical block 0 out of every sequence, so the
            table's padding points at a block full of ``fill``.
    """
    if len(seq_lens) != len(query_lens):
        raise ValueError("seq_lens and query_lens must have the same length")
    for seq_len, query_len in zip(seq_lens, query_lens):
        if not 0 <= query_len <= seq_len:
            raise ValueError(f"need 0 <= query_len <= seq_len, got {query_len} and {seq_len}")
    generator = generator if generator is not None else torch.Generator().manual_seed(0)

    blocks_per_seq = [(seq_len + block_size - 1) // block_size for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks + (1 if block_zero_unused else 0)
    # Shuffle the physical ids so that neighbouring logical blocks are far apart.
    first_id = 1 if block_zero_unused else 0
    physical_ids = (torch.randperm(num_blocks - first_id, generator=generator) + first_id).tolist()

    width = max(blocks_per_seq, default=0) + extra_table_columns
    block_tables = torch.zeros((len(seq_lens), max(width, 1)), dtype=torch.int32)
    for s, count in enumerate(blocks_per_seq):
        block_tables[s, :count] = torch.tensor(physical_ids[:count], dtype=torch.int32)
        physical_ids = physical_ids[count:]

    def slots_of(s: int, positions: range) -> list[int]:
        return [int(block_tables[s, t // block_size]) * block_size + t % block_size for t in positions]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, fill, dtype=dtype)
    v_cache = torch.full(cache_shape, fill, dtype=dtype)

    # The cached context: every token but the last query_len of each sequence.
    context_slots: list[int] = []
    for s, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        context_slots += slots_of(s, range(seq_len - query_len))
    if context_slots:
        n = len(context_slots)
        slots = torch.tensor(context_slots, dtype=torch.int64)
        reference.store_kv(randn(n, num_kv_heads, head_dim), randn(n, num_kv_heads, head_dim), k_cache, v_cache, slots)

    new_slots: list[int] = []
    for s, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        new_slots += slots_of(s, range(seq_len - query_len, seq_len))
    total_q = sum(query_lens)
    cu = [0]
    for query_len in query_lens:
        cu.append(cu[-1] + query_len)

    return PagedBatch(
        query=randn(total_q, num_q_heads, head_dim).to(device),
        key=randn(total_q, num_kv_heads, head_dim).to(device),
        value=randn(total_q, num_kv_heads, head_dim).to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
