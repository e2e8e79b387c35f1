"""paged_attention and unified_attention == their PyTorch references.

The kernels run in Triton's interpreter here, with small tiles (16 positions),
so short sequences already take several tiles, splits and block-table hops.
Every cache is NaN wherever no token lives: a kernel that reads a slot it
should not read (padding in the block table, the tail of a last block, an
unused block) turns the output into NaN and fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm import kernels
from mini_vllm.kernels import reference
from mini_vllm.kernels.testing import make_paged_batch

pytestmark = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason=kernels.UNAVAILABLE_MESSAGE)

# The interpreter runs on CPU tensors; compiled kernels (a GPU machine with
# TRITON_INTERPRET=0) need GPU tensors.
DEVICE = "cpu" if kernels.TRITON_INTERPRETED else "cuda"

# float32 must agree closely; float16 outputs are rounded to float16 (2**-11).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}

# (num_q_heads, num_kv_heads): GQA groups of 1, 2, 3 and 4.
HEADS = {1: (4, 4), 2: (4, 2), 3: (6, 2), 4: (8, 2)}

# One case per (dtype, head_dim), rotating through groups and block sizes.
CASES = [
    (torch.float32, 64, 1, 16),
    (torch.float32, 80, 3, 8),
    (torch.float32, 128, 4, 16),
    (torch.float16, 64, 2, 8),
    (torch.float16, 80, 4, 16),
    (torch.float16, 128, 3, 8),
]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any(), "the kernel produced NaN: it read a slot it should not read"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


# --------------------------------------------------------------------------- decode


# Lengths: a single token, exactly one full block, partial last blocks, and
# contexts of several 16-position tiles.
DECODE_SEQ_LENS = [1, 16, 37, 70, 9]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype, head_dim, group, block_size", CASES)
def test_paged_attention_matches_reference(dtype, head_dim, group, block_size, num_splits):
    num_q_heads, num_kv_heads = HEADS[group]
    batch = make_paged_batch(
        DECODE_SEQ_LENS,
        [1] * len(DECODE_SEQ_LENS),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        generator=torch.Generator().manual_seed(head_dim + group),
    )
    batch.store_new_kv()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)

    actual = kernels.paged_attention(*args, num_splits=num_splits)

    assert_close(actual, reference.paged_attention(*args), dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_attention_block_zero_padding_is_never_read(num_splits):
    # Block 0 holds only NaN and every table row is padded with it.
    batch = make_paged_batch(
        [5, 33],
        [1, 1],
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        block_size=16,
        block_zero_unused=True,
        extra_table_columns=3,
        device=DEVICE,
        generator=torch.Generator().manual_seed(1),
    )
    batch.store_new_kv()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)

    actual = kernels.paged_attention(*args, num_splits=num_splits)

    assert_close(actual, reference.paged_attention(*args), torch.float32)


def test_paged_attention_group_of_eight_and_custom_scale():
    batch = make_paged_batch(
        [40, 3],
        [1, 1],
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=64,
        block_size=8,
        device=DEVICE,
        generator=torch.Generator().manual_seed(2),
    )
    batch.store_new_kv()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.3)

    actual = kernels.paged_attention(*args, num_splits=2)

    assert_close(actual, reference.paged_attention(*args), torch.float32)


def test_paged_attention_bfloat16():
    # The interpreter truncates the float32 result to bfloat16 rather than
    # rounding it (one bf16 ulp, 2**-7 relative), hence the wider tolerance.
    batch = make_paged_batch(
        [29, 50],
        [1, 1],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.bfloat16,
        device=DEVICE,
        generator=torch.Generator().manual_seed(3),
    )
    batch.store_new_kv()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)

    actual = kernels.paged_attention(*args, num_splits=2)

    expected = reference.paged_attention(*args)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_paged_attention_equals_unified_attention_on_decode():
    batch = make_paged_batch(
        [1, 17, 48],
        [1, 1, 1],
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=80,
        block_size=16,
        device=DEVICE,
        generator=torch.Generator().manual_seed(4),
    )
    batch.store_new_kv()

    paged = kernels.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    unified = kernels.unified_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables
    )

    torch.testing.assert_close(paged, unified, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- mixed batches

# (seq_len, q_len): a prefill from scratch, a prefill over a cached prefix,
# a decode, a one-token sequence, a block-aligned chunk, a chunk ending mid-block.
MIXED = [(20, 20), (48, 13), (41, 1), (1, 1), (32, 16), (27, 9)]


@pytest.mark.parametrize("dtype, head_dim, group, block_size", CASES)
def test_unified_attention_matches_reference_on_a_mixed_batch(dtype, head_dim, group, block_size):
    num_q_heads, num_kv_heads = HEADS[group]
    batch = make_paged_batch(
        [s for s, _ in MIXED],
        [q for _, q in MIXED],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        generator=torch.Generator().manual_seed(head_dim * group),
    )
    batch.store_new_kv()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables)

    actual = kernels.unified_attention(*args)

    assert_close(actual, reference.unified_attention(*args), dtype)


def test_unified_attention_sequence_without_queries_and_custom_scale():
    # A sequence with q_len 0 sits between two others: it must not disturb them.
    batch = make_paged_batch(
        [18, 25, 7],
        [18, 0, 3],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=8,
        block_zero_unused=True,
        device=DEVICE,
        generator=torch.Generator().manual_seed(5),
    )
    batch.store_new_kv()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, 0.2)

    actual = kernels.unified_attention(*args, max_query_len=batch.max_query_len)

    assert_close(actual, reference.unified_attention(*args), torch.float32)


def test_unified_attention_strided_query_view():
    batch = make_paged_batch(
        [30, 12],
        [10, 12],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        device=DEVICE,
        generator=torch.Generator().manual_seed(6),
    )
    batch.store_new_kv()
    # The query as the first heads of a fused q|k|v projection: a strided view.
    fused = torch.cat([batch.query, batch.key, batch.value], dim=1)
    query = fused[:, :4]
    assert not query.is_contiguous()
    args = (query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables)

    actual = kernels.unified_attention(*args)

    assert_close(actual, reference.unified_attention(*args), torch.float32)


def test_unified_attention_is_causal():
    # Changing the last token's K/V must not change any earlier query's output.
    batch = make_paged_batch(
        [24],
        [24],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        block_size=8,
        device=DEVICE,
        generator=torch.Generator().manual_seed(7),
    )
    batch.store_new_kv()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables)
    before = kernels.unified_attention(*args)

    last_slot = int(batch.slot_mapping[-1])
    batch.k_cache.view(-1, 1, 64)[last_slot] += 5.0
    batch.v_cache.view(-1, 1, 64)[last_slot] += 5.0
    after = kernels.unified_attention(*args)

    torch.testing.assert_close(after[:-1], before[:-1], rtol=0, atol=0)
    assert not torch.allclose(after[-1], before[-1])


@st.composite
def seq_and_query_len(draw) -> tuple[int, int]:
    seq_len = draw(st.integers(1, 45))
    query_len = draw(st.integers(1, seq_len))
    return seq_len, query_len


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    group=st.integers(1, 8),
    num_kv_heads=st.integers(1, 2),
    head_dim=st.sampled_from([16, 48, 64, 80, 96, 128]),
    block_size=st.sampled_from([8, 16, 32]),
    lens=st.lists(seq_and_query_len(), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_unified_attention_random_shapes(group, num_kv_heads, head_dim, block_size, lens, seed):
    batch = make_paged_batch(
        [s for s, _ in lens],
        [q for _, q in lens],
        num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        device=DEVICE,
        generator=torch.Generator().manual_seed(seed),
    )
    batch.store_new_kv()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables)

    actual = kernels.unified_attention(*args)

    assert_close(actual, reference.unified_attention(*args), torch.float32)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    group=st.integers(1, 8),
    head_dim=st.sampled_from([32, 80, 128]),
    block_size=st.sampled_from([8, 16]),
    seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    num_splits=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_random_shapes(group, head_dim, block_size, seq_lens, num_splits, seed):
    batch = make_paged_batch(
        seq_lens,
        [1] * len(seq_lens),
        num_q_heads=group,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=block_size,
        device=DEVICE,
        generator=torch.Generator().manual_seed(seed),
    )
    batch.store_new_kv()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)

    actual = kernels.paged_attention(*args, num_splits=num_splits)

    assert_close(actual, reference.paged_attention(*args), torch.float32)


# --------------------------------------------------------------------------- validation


def _decode_args() -> dict[str, torch.Tensor]:
    return {
        "query": torch.randn(2, 4, 64, device=DEVICE),
        "k_cache": torch.zeros(4, 8, 2, 64, device=DEVICE),
        "v_cache": torch.zeros(4, 8, 2, 64, device=DEVICE),
        "block_tables": torch.zeros(2, 3, dtype=torch.int32, device=DEVICE),
        "seq_lens": torch.ones(2, dtype=torch.int32, device=DEVICE),
    }


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(query=a["query"][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.update(query=a["query"][:, :, :32]), "head_dim 32 does not match"),
        (lambda a: a.update(query=a["query"][:1]), "one query token per sequence"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be int32"),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be int32"),
        (lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables has 1 rows"),
        (lambda a: a.update(k_cache=a["k_cache"].flatten(0, 1)), "k_cache must be 4-D"),
        (lambda a: a.update(query=a["query"].double()), "query must be float16"),
    ],
)
def test_paged_attention_rejects_invalid_arguments(change, message):
    args = _decode_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(**args)


def test_unified_attention_rejects_bad_cu_seqlens():
    args = _decode_args()
    bad = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="num_seqs \\+ 1 = 3 entries"):
        kernels.unified_attention(
            args["query"], args["k_cache"], args["v_cache"], bad, args["seq_lens"], args["block_tables"]
        )
    with pytest.raises(ValueError, match="cu_seqlens_q must be int32"):
        kernels.unified_attention(
            args["query"],
            args["k_cache"],
            args["v_cache"],
            torch.tensor([0, 1, 2], device=DEVICE),
            args["seq_lens"],
            args["block_tables"],
        )


def test_default_scale_is_one_over_sqrt_head_dim():
    batch = make_paged_batch(
        [12],
        [1],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        block_size=8,
        device=DEVICE,
        generator=torch.Generator().manual_seed(8),
    )
    batch.store_new_kv()
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)

    torch.testing.assert_close(
        kernels.paged_attention(*args), kernels.paged_attention(*args, 1 / math.sqrt(64)), rtol=0, atol=0
    )
