"""The ``torch`` attention backend: PyTorch's fused attention over the paged cache (chapter 07).

Same contract and same numbers (up to float rounding) as :mod:`mini_vllm.kernels.reference`,
the plain functions the Triton kernels are tested against, but shaped for speed
on a CPU:

* an all-decode batch (one query per sequence, the common step) is one
  ``scaled_dot_product_attention`` call per sequence, over its own blocks
  gathered through its block table and cut at its length: no row is padding,
  so no mask is needed (a padded batch with a mask takes PyTorch's slower masked
  path: 1.2-2.3x the time in isolation on a CPU, measured in benchmarks/README.md);
* a prefill (or a prefill chunk over a cached prefix) is one fused call per
  sequence, with the causal mask aligned to the *end* of the sequence (its
  queries are its last ``q_len`` tokens).

With a sliding window ``W`` (``metadata.sliding_window``), a query at position
``p`` sees only the keys at ``p - W + 1 .. p``: nothing before the first
query's window is gathered (a decode reads its sequence's last ``W`` rows, a
prefill the rows from its first query's window start), so the freed blocks that
the table marks with the placeholder 0 are never read, and the band is masked.

Grouped-query attention is left to ``enable_gqa`` (no ``repeat_interleave``
copies of K/V). Blocks are gathered by the reference's own ``gather_kv`` (one
``index_select`` per cache) and new K/V stored with ``index_copy_``: the same
copies as the reference's indexing, at a quarter of its per-call cost (paid
once per layer and step). Computed in
float32, like the reference. The reference loop
(``mini_vllm.kernels.reference.unified_attention``) stays the readable oracle; the tests
compare this backend with it and with ``transformers``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.reference import gather_kv  # one gather: the kernels' PyTorch reference
from ..validation import check_sliding_window
from .base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    """Gathers each sequence's K/V through its block table, then fused attention."""

    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if bool(
            (slot_mapping < 0).any()
        ):  # tokens to skip (slot -1): dropped first, as mini_vllm.kernels.reference does
            keep = slot_mapping >= 0
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        # The cache viewed as one row per slot: index_copy_ writes row slot_mapping[i] from token i.
        slots = slot_mapping.long()
        k_cache.flatten(0, 1).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.flatten(0, 1).index_copy_(0, slots, value.to(v_cache.dtype))

    def attention(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        window = check_sliding_window(metadata.sliding_window)
        if metadata.is_all_decode:
            return decode_attention(
                query,
                k_cache,
                v_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.max_seq_len,
                scale,
                sliding_window=window,
            )
        out = torch.empty_like(query)
        cu = metadata.cu_seqlens_q.tolist()
        for s, seq_len in enumerate(metadata.seq_lens.tolist()):
            start, end = cu[s], cu[s + 1]
            if end == start:
                continue
            # The first query's window start: the keys before it are not gathered.
            first_key = 0 if window is None else max(0, seq_len - (end - start) - window + 1)
            if first_key == 0:
                keys, values = gather_kv(k_cache, v_cache, metadata.block_tables[s], seq_len)
            else:
                table, lengths = metadata.block_tables[s : s + 1], metadata.seq_lens[s : s + 1]
                keys, values, _ = gather_last_kv(k_cache, v_cache, table, lengths, seq_len - first_key)
                keys, values = keys[0], values[0]
            out[start:end] = prefill_attention(query[start:end], keys, values, scale, sliding_window=window)
        return out


def gather_last_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K/V of each sequence's *last* ``num_rows`` positions: ``[num_seqs, num_rows, Hkv, D]`` copies.

    Also returns those positions, ``[num_seqs, num_rows]``: a sequence shorter
    than ``num_rows`` gets negative positions in front, whose rows repeat its
    first token's K/V for the attention mask to hide. Only the table entries of
    the blocks that hold these positions are read.
    """
    block_size = k_cache.shape[1]
    positions = seq_lens[:, None].long() - num_rows + torch.arange(num_rows, device=k_cache.device)[None, :]
    capped = positions.clamp(min=0)
    blocks = block_tables.gather(1, capped // block_size).long()
    slots = (blocks * block_size + capped % block_size).flatten()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache.flatten(0, 1).index_select(0, slots).view(*positions.shape, *cache.shape[2:])

    return gather(k_cache), gather(v_cache), positions


# Queries per attention call in a long prefill. PyTorch's CPU flash kernel takes up to 512 keys
# at a time, so below that it computes every key for every query and masks the upper triangle
# away; giving each chunk of queries only the keys it can see skips that half (~30% of a
# 300-token prefill's attention on one CPU thread, measured).
PREFILL_QUERY_CHUNK = 64


def prefill_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One sequence: its last ``q_len`` tokens' queries ``[q_len, Hq, D]`` over ``seq_len`` keys, causal.

    Query ``i`` sits at position ``seq_len - q_len + i`` and sees keys ``0..`` that
    position; with a sliding window ``W``, only the last ``W`` of those. (``keys`` may
    start anywhere before the first query's window: positions count from ``keys[0]``.)
    On a CPU, long prefills go in chunks of ``PREFILL_QUERY_CHUNK`` queries, each
    over only the keys its queries can see.
    """
    q_len, seq_len = query.shape[0], keys.shape[0]
    num_cached = seq_len - q_len
    # With a batch dimension of 1: 4-D inputs take PyTorch's fused (flash) CPU kernel, 3-D ones its slow path.
    q = query.float().transpose(0, 1)[None]  # [1, Hq, q_len, D]
    k = keys.float().transpose(0, 1)[None]  # [1, Hkv, seq_len, D]
    v = values.float().transpose(0, 1)[None]
    chunks = []
    # GPU kernels skip the masked-out tiles themselves: one call there.
    chunk = PREFILL_QUERY_CHUNK if query.device.type == "cpu" else max(q_len, 1)
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        num_keys = num_cached + end  # what this chunk's last query can see
        # Does the window hide some key from some query of the chunk? Then keys start at its first query's window.
        windowed = sliding_window is not None and sliding_window < num_keys
        first_key = max(0, num_cached + start - sliding_window + 1) if windowed else 0
        q_chunk, k_chunk, v_chunk = q[:, :, start:end], k[:, :, first_key:num_keys], v[:, :, first_key:num_keys]
        if num_cached == 0 and start == 0 and not windowed:  # the usual causal mask
            out = F.scaled_dot_product_attention(
                q_chunk, k_chunk, v_chunk, is_causal=True, scale=scale, enable_gqa=True
            )
        else:  # a lower triangle shifted by the keys before this chunk's first query
            diagonal = num_cached + start - first_key
            visible = torch.ones(end - start, num_keys - first_key, dtype=torch.bool, device=query.device).tril(
                diagonal
            )
            if windowed:  # ...and above it, the band's lower edge: key j visible while j > query position - W
                visible = visible.triu(diagonal - sliding_window + 1)
            out = F.scaled_dot_product_attention(
                q_chunk, k_chunk, v_chunk, attn_mask=visible, scale=scale, enable_gqa=True
            )
        chunks.append(out)
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)
    return out[0].transpose(0, 1).to(query.dtype)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query per sequence (``[num_seqs, Hq, D]``) over its whole context: one fused call per sequence.

    With a sliding window ``W`` shorter than ``max_seq_len``: over each sequence's last ``W`` keys
    only, all sequences in one call (a sequence shorter than ``W`` has padding rows, masked).
    """
    if sliding_window is not None and sliding_window < max_seq_len:
        keys, values, positions = gather_last_kv(k_cache, v_cache, block_tables, seq_lens, sliding_window)
        visible = (positions >= 0)[:, None, None, :]  # a sequence shorter than W: its front rows are padding
        return _decode_one_query(query, keys, values, visible, scale)
    outputs = []
    for s, seq_len in enumerate(seq_lens.tolist()):
        keys, values = gather_kv(k_cache, v_cache, block_tables[s], seq_len)  # every row its own: no mask
        outputs.append(_decode_one_query(query[s : s + 1], keys[None], values[None], None, scale))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _decode_one_query(query, keys, values, visible, scale) -> torch.Tensor:
    """``query`` ``[num_seqs, Hq, D]`` over ``keys``/``values`` ``[num_seqs, L, Hkv, D]``, in float32."""
    q = query.float()[:, :, None, :]  # [num_seqs, Hq, 1, D]
    out = F.scaled_dot_product_attention(
        q, keys.float().transpose(1, 2), values.float().transpose(1, 2), attn_mask=visible, scale=scale, enable_gqa=True
    )  # K/V as [num_seqs, Hkv, L, D]
    return out[:, :, 0, :].to(query.dtype)


class PartsAttentionBackend(TorchAttentionBackend):
    """The torch backend with the kernel extension points in it (``EngineParts.store_kv`` / ``paged_decode``).

    ``store_kv(key, value, k_cache, v_cache, slot_mapping)`` stores every
    layer's new K/V in every step; ``paged_decode(query, k_cache, v_cache,
    block_table, seq_len, scale)`` attends for one sequence's one query token
    and serves all-decode steps, one sequence at a time. Prefill steps, and
    sliding-window layers (``paged_decode`` takes no window), keep the torch
    backend's attention. A part left None is the torch backend's.
    The engine builds this backend only when a kernel part is given.
    """

    def __init__(self, store_kv=None, paged_decode=None) -> None:
        self.store_kv_fn = store_kv
        self.paged_decode_fn = paged_decode
        given = [label for label, fn in (("store_kv", store_kv), ("paged_decode", paged_decode)) if fn is not None]
        self.name = "torch, with the given " + " and ".join(given) if given else "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if self.store_kv_fn is None:
            return super().store_kv(key, value, k_cache, v_cache, slot_mapping)
        self.store_kv_fn(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        # Prefill, or a sliding window (the paged_decode part knows none): the torch backend's.
        if self.paged_decode_fn is None or metadata.max_query_len > 1 or metadata.sliding_window is not None:
            return super().attention(query, k_cache, v_cache, metadata, scale)
        outputs = [
            self.paged_decode_fn(query[s], k_cache, v_cache, metadata.block_tables[s], int(metadata.seq_lens[s]), scale)
            for s in range(metadata.num_seqs)
        ]
        return torch.stack(outputs)
