"""The ``torch`` attention backend: PyTorch's fused attention over the paged cache (chapter 07).

Same contract and same numbers (up to float rounding) as :mod:`kernels.reference`,
the plain functions the Triton kernels are tested against, but shaped for speed
on a CPU:

* an all-decode batch (one query per sequence, the common step) is **one**
  ``scaled_dot_product_attention`` call for the whole batch: each sequence's
  blocks are gathered through its block table into ``[num_seqs, max_seq_len,
  num_kv_heads, head_dim]`` and a padding mask hides the rows past its length;
* a prefill (or a prefill chunk over a cached prefix) is one fused call per
  sequence, with the causal mask aligned to the *end* of the sequence (its
  queries are its last ``q_len`` tokens).

Grouped-query attention is left to ``enable_gqa`` (no ``repeat_interleave``
copies of K/V). Computed in float32, like the reference. The reference loop
(``kernels.reference.unified_attention``) stays the readable oracle; the tests
compare this backend with it and with ``transformers``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import reference

from .base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    """Gathers each sequence's K/V through its block table, then fused attention."""

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
        is_all_decode = metadata.max_query_len == 1 and query.shape[0] == metadata.num_seqs
        if is_all_decode:
            return decode_attention(query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                    metadata.max_seq_len, scale)
        out = torch.empty_like(query)
        cu = metadata.cu_seqlens_q.tolist()
        for s, seq_len in enumerate(metadata.seq_lens.tolist()):
            start, end = cu[s], cu[s + 1]
            if end > start:
                keys, values = reference.gather_kv(k_cache, v_cache, metadata.block_tables[s], seq_len)
                out[start:end] = prefill_attention(query[start:end], keys, values, scale)
        return out


def prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: its last ``q_len`` tokens' queries ``[q_len, Hq, D]`` over ``seq_len`` keys, causal."""
    q_len, seq_len = query.shape[0], keys.shape[0]
    # With a batch dimension of 1: 4-D inputs take PyTorch's fused (flash) CPU kernel, 3-D ones its slow path.
    q = query.float().transpose(0, 1)[None]  # [1, Hq, q_len, D]
    k = keys.float().transpose(0, 1)[None]  # [1, Hkv, seq_len, D]
    v = values.float().transpose(0, 1)[None]
    if q_len == seq_len:  # nothing cached: the usual causal mask
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at position seq_len - q_len + i and sees keys 0..that
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        visible = torch.arange(seq_len, device=query.device)[None, :] <= query_pos
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(query.dtype)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One query per sequence (``[num_seqs, Hq, D]``) over its whole context, all sequences at once."""
    block_size = k_cache.shape[1]
    num_blocks_used = (max_seq_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks_used].long()
    # Rows past a sequence's length belong to padding or to slots not written yet:
    # masked out, and zeroed, since a masked score times a NaN/inf there is still NaN.
    visible = torch.arange(max_seq_len, device=query.device)[None, :] < seq_lens[:, None]  # [num_seqs, L]
    hidden_rows = ~visible[:, :, None, None]
    # The gather copies; the zeroing then works in place on that copy.
    # [num_seqs, num_blocks_used * block_size, Hkv, D] -> [num_seqs, Hkv, max_seq_len, D]
    keys = k_cache[table].flatten(1, 2)[:, :max_seq_len].float().masked_fill_(hidden_rows, 0.0).transpose(1, 2)
    values = v_cache[table].flatten(1, 2)[:, :max_seq_len].float().masked_fill_(hidden_rows, 0.0).transpose(1, 2)
    q = query.float()[:, :, None, :]  # [num_seqs, Hq, 1, D]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None, :], scale=scale,
                                         enable_gqa=True)
    return out[:, :, 0, :].to(query.dtype)
