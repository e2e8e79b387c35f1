"""mini_vllm.kernels.store_kv == mini_vllm.kernels.reference.store_kv (Triton interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch

from mini_vllm import kernels
from mini_vllm.kernels import reference
from mini_vllm.kernels.testing import make_paged_batch

pytestmark = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason=kernels.UNAVAILABLE_MESSAGE)

# The interpreter runs on CPU tensors; compiled kernels (a GPU machine with
# TRITON_INTERPRET=0) need GPU tensors.
DEVICE = "cpu" if kernels.TRITON_INTERPRETED else "cuda"
NAN = float("nan")


def assert_same_cache(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-for-bit equal, NaN where NaN (the slots nobody wrote)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def new_tokens(
    num_kv_heads: int, head_dim: int, block_size: int, cache_dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens for shuffled slots of a NaN-filled cache; a few slots are -1."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks, num_tokens = 6, 37
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=cache_dtype)
    v_cache = torch.full(shape, NAN, dtype=cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=generator)[:5]] = -1
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    return key.to(DEVICE), value.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), slots.to(DEVICE)


@pytest.mark.parametrize(
    "num_kv_heads, head_dim, block_size, dtype",
    [
        (1, 64, 16, torch.float32),
        (2, 80, 8, torch.float32),
        (3, 128, 16, torch.float16),
        (2, 64, 8, torch.float16),
        (4, 80, 16, torch.bfloat16),
    ],
)
def test_store_kv_matches_reference(num_kv_heads, head_dim, block_size, dtype):
    key, value, k_cache, v_cache, slots = new_tokens(num_kv_heads, head_dim, block_size, dtype, seed=1)
    key, value = key.to(dtype), value.to(dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_expected, v_expected, slots)

    kernels.store_kv(key, value, k_cache, v_cache, slots)

    assert_same_cache(k_cache, k_expected)
    assert_same_cache(v_cache, v_expected)


def test_slot_minus_one_writes_nothing():
    key, value, k_cache, v_cache, _ = new_tokens(2, 64, 16, torch.float32, seed=2)
    slots = torch.full((key.shape[0],), -1, dtype=torch.int64, device=DEVICE)

    kernels.store_kv(key, value, k_cache, v_cache, slots)

    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()


def test_int32_slot_mapping_and_float16_into_float32_cache():
    key, value, k_cache, v_cache, slots = new_tokens(2, 80, 16, torch.float32, seed=3)
    key, value = key.half(), value.half()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_expected, v_expected, slots)

    kernels.store_kv(key, value, k_cache, v_cache, slots.to(torch.int32))

    assert_same_cache(k_cache, k_expected)
    assert_same_cache(v_cache, v_expected)


def test_float32_into_float16_cache_rounds_like_torch():
    key, value, k_cache, v_cache, slots = new_tokens(2, 64, 8, torch.float16, seed=4)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_expected, v_expected, slots)

    kernels.store_kv(key, value, k_cache, v_cache, slots)

    assert_same_cache(k_cache, k_expected)
    assert_same_cache(v_cache, v_expected)


def test_float32_into_bfloat16_cache_within_one_ulp():
    # Triton's CPU interpreter truncates float32 -> bfloat16 instead of rounding
    # to nearest even (a compiled kernel rounds like torch), so allow one ulp here.
    key, value, k_cache, v_cache, slots = new_tokens(2, 64, 8, torch.bfloat16, seed=5)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_expected, v_expected, slots)

    kernels.store_kv(key, value, k_cache, v_cache, slots)

    one_ulp = 2.0**-7
    torch.testing.assert_close(k_cache.float(), k_expected.float(), rtol=one_ulp, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.float(), v_expected.float(), rtol=one_ulp, atol=0, equal_nan=True)


def test_strided_key_and_value_views():
    # The model produces q, k, v as slices of one projection: non-contiguous views.
    generator = torch.Generator().manual_seed(6)
    num_tokens, num_q_heads, num_kv_heads, head_dim = 9, 4, 2, 80
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=generator).to(DEVICE)
    key = qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    value = qkv[:, num_q_heads + num_kv_heads :]
    assert not key.is_contiguous()
    k_cache = torch.full((3, 8, num_kv_heads, head_dim), NAN, device=DEVICE)
    v_cache = torch.full_like(k_cache, NAN)
    slots = torch.tensor([17, 3, 4, 5, -1, 0, 23, 8, 9], device=DEVICE)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_expected, v_expected, slots)

    kernels.store_kv(key, value, k_cache, v_cache, slots)

    assert_same_cache(k_cache, k_expected)
    assert_same_cache(v_cache, v_expected)


def test_store_then_read_back_through_block_tables():
    batch = make_paged_batch(
        [21, 1, 16],
        [21, 1, 5],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=8,
        device=DEVICE,
        generator=torch.Generator().manual_seed(7),
    )
    kernels.store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.slot_mapping)

    row = 0
    for s, (seq_len, q_len) in enumerate([(21, 21), (1, 1), (16, 5)]):
        keys, values = reference.gather_kv(batch.k_cache, batch.v_cache, batch.block_tables[s], seq_len)
        assert torch.equal(keys[seq_len - q_len :], batch.key[row : row + q_len])
        assert torch.equal(values[seq_len - q_len :], batch.value[row : row + q_len])
        row += q_len


def test_no_tokens_is_a_no_op():
    k_cache = torch.full((2, 8, 1, 64), NAN, device=DEVICE)
    v_cache = k_cache.clone()
    empty = torch.empty(0, 1, 64, device=DEVICE)
    kernels.store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.isnan(k_cache).all()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), "slot_mapping must be int64 or int32"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"][:-1]), "slot_mapping has 3 entries but there are 4"),
        (lambda a: a.update(key=a["key"][:, :, :32]), "key and value must have the same shape"),
        (lambda a: a.update(key=a["key"][:, :1], value=a["value"][:, :1]), "does not match the cache"),
        (lambda a: a.update(k_cache=a["k_cache"][0]), "k_cache must be 4-D"),
        (lambda a: a.update(v_cache=a["v_cache"][:1]), "same shape"),
        (lambda a: a.update(k_cache=a["k_cache"].double()), "k_cache must be float16, bfloat16 or float32"),
        (lambda a: a.update(key=a["key"].int(), value=a["value"].int()), "key must be float16"),
    ],
)
def test_invalid_arguments_raise_value_error(change, message):
    args = {
        "key": torch.randn(4, 2, 64, device=DEVICE),
        "value": torch.randn(4, 2, 64, device=DEVICE),
        "k_cache": torch.zeros(2, 8, 2, 64, device=DEVICE),
        "v_cache": torch.zeros(2, 8, 2, 64, device=DEVICE),
        "slot_mapping": torch.arange(4, device=DEVICE),
    }
    change(args)
    with pytest.raises(ValueError, match=message):
        kernels.store_kv(**args)
