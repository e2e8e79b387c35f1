"""TritonAttentionBackend.forward == TorchAttentionBackend.forward on hand-built steps."""

from __future__ import annotations

import pytest
import torch

from mini_vllm import kernels
from attention_fixtures import metadata_of
from mini_vllm.kernels.testing import PagedBatch, make_paged_batch
from mini_vllm.attention import TorchAttentionBackend

pytestmark = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason=kernels.UNAVAILABLE_MESSAGE)

# The interpreter runs on CPU tensors; compiled kernels need GPU tensors.
DEVICE = "cpu" if kernels.TRITON_INTERPRETED else "cuda"


def forward_both(batch: PagedBatch, scale: float) -> None:
    from mini_vllm.attention.triton_backend import TritonAttentionBackend

    metadata = metadata_of(batch)
    torch_caches = (batch.k_cache.clone(), batch.v_cache.clone())
    triton_caches = (batch.k_cache.clone(), batch.v_cache.clone())

    expected = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, *torch_caches, metadata, scale)
    actual = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, *triton_caches, metadata, scale)

    torch.testing.assert_close(triton_caches, torch_caches, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_triton_backend_name():
    from mini_vllm.attention import get_attn_backend

    assert get_attn_backend("triton").name == "triton"


def test_mixed_step_matches_torch_backend():
    # A prefill over a cached prefix, a fresh prefill, a chunk and a decode.
    batch = make_paged_batch(
        [40, 12, 32, 19],
        [8, 12, 16, 1],
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=80,
        block_size=16,
        device=DEVICE,
        generator=torch.Generator().manual_seed(0),
    )
    forward_both(batch, scale=80**-0.5)


def test_decode_step_matches_torch_backend():
    # max_query_len == 1: the backend takes the paged_attention path.
    batch = make_paged_batch(
        [1, 33, 17],
        [1, 1, 1],
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        block_size=8,
        device=DEVICE,
        generator=torch.Generator().manual_seed(1),
    )
    forward_both(batch, scale=0.125)
