"""TorchAttentionBackend.forward == the plain reference (store, then unified attention), no Triton needed.

The caches start full of NaN: a backend that let a row outside a sequence's
context into its attention (padding, a slot not written yet, another
sequence's block) would return NaN, not a number close to the reference's.
"""

from __future__ import annotations

import pytest
import torch

from mini_vllm.kernels import reference
from attention_fixtures import metadata_of
from mini_vllm.kernels.testing import make_paged_batch
from mini_vllm.attention import TorchAttentionBackend
from mini_vllm.attention import torch_backend

CASES = {
    # seq_lens, query_lens: an all-decode batch of unequal lengths (padded rows), one decode,
    # a mixed step (prefill over a cached prefix, a fresh prefill, a chunk, a decode).
    "decode batch": ([1, 33, 17, 40], [1, 1, 1, 1]),
    "one decode": ([29], [1]),
    "mixed": ([40, 12, 32, 19], [8, 12, 16, 1]),
    # Prefills longer than PREFILL_QUERY_CHUNK (64) queries: a fresh one, one over 63 cached tokens.
    "long prefills in query chunks": ([150, 200], [150, 137]),
}


def forward_both(seq_lens: list[int], query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = make_paged_batch(
        seq_lens,
        query_lens,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=32,
        block_size=8,
        block_zero_unused=True,
        generator=torch.Generator().manual_seed(0),
    )
    metadata = metadata_of(batch)
    caches = (batch.k_cache.clone(), batch.v_cache.clone())
    actual = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, *caches, metadata, 0.2)
    batch.store_new_kv()
    torch.testing.assert_close(caches, (batch.k_cache, batch.v_cache), rtol=0, atol=0, equal_nan=True)
    expected = reference.unified_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, 0.2
    )
    return actual, expected


@pytest.mark.parametrize("case", CASES)
def test_torch_backend_equals_the_reference(case):
    actual, expected = forward_both(*CASES[case])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_any_query_chunk_size_gives_the_reference(monkeypatch, chunk):
    monkeypatch.setattr(torch_backend, "PREFILL_QUERY_CHUNK", chunk)
    actual, expected = forward_both(*CASES["long prefills in query chunks"])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_a_query_chunk_that_sees_too_few_keys_is_caught(monkeypatch):
    """The known-wrong variant: each chunk's mask starts at the cached tokens, not at its own first query.

    (Made by capping ``Tensor.tril``'s diagonal at the 63 cached tokens: only the backend's
    prefill calls ``tril`` here; the reference masks with ``masked_fill``.)
    """
    real_tril = torch.Tensor.tril
    monkeypatch.setattr(torch.Tensor, "tril", lambda self, diagonal=0: real_tril(self, min(diagonal, 63)))
    actual, expected = forward_both(*CASES["long prefills in query chunks"])
    assert not torch.allclose(actual, expected, rtol=1e-3, atol=1e-3)


def test_a_gather_that_reads_past_a_sequence_is_caught(monkeypatch):
    """The known-wrong variant: gather a sequence's whole blocks without cutting them at its length
    (the rows past its end are unwritten slots, NaN here) -- the comparison must fail."""

    def whole_blocks(k_cache, v_cache, block_table, seq_len):
        block_ids = block_table[: (seq_len + k_cache.shape[1] - 1) // k_cache.shape[1]].long()
        return tuple(cache.index_select(0, block_ids).flatten(0, 1) for cache in (k_cache, v_cache))

    monkeypatch.setattr(torch_backend, "gather_kv", whole_blocks)
    actual, expected = forward_both(*CASES["decode batch"])
    assert actual.isnan().any() and not expected.isnan().any()


def test_skipped_slots_are_not_stored():
    """Slot -1 means "do not store": the backend writes the other tokens only."""
    k_cache, v_cache = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    key = torch.arange(6.0).view(3, 1, 2)
    TorchAttentionBackend().store_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.flatten(0, 1)[5].tolist() == [[0.0, 1.0]] and k_cache.flatten(0, 1)[0].tolist() == [[4.0, 5.0]]
    assert v_cache.flatten(0, 1)[5].tolist() == [[-0.0, -1.0]]
    assert k_cache.abs().sum() == 10.0  # nothing else written
