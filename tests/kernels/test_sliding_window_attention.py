"""Sliding-window attention (``AttentionMetadata.sliding_window``) in every backend and kernel.

With a window ``W`` the query at position ``p`` sees only the keys at ``p - W + 1 .. p``.
Every implementation -- ``mini_vllm.kernels.reference``, the torch backend (decode, prefill and
chunked-prefill paths), the torch backend with kernel parts, the triton backend,
the two Triton kernels, the cpu backend and its C decode kernel -- is compared with :func:`dense_attention`: one score matrix
per sequence and an explicit band mask, written here apart from all of them.

Before each call the step is put in the state a sliding-window KV-cache group hands
to attention (:func:`free_blocks_before_window`): every block that lies entirely
before a sequence's first query's window has been freed -- its table entry is the
null block's placeholder 0 -- and holds garbage (NaN), like block 0 itself. An
implementation that let those entries count would return NaN. The ``strict`` variant
also poisons the positions before the window inside the first block the window
reaches: it proves an implementation never *loads* a key before its first query's
window (it skips them, rather than masking them), so a decode step reads ``W`` keys
however long the sequence.

The triton cases run in Triton's interpreter on a CPU (compiled, on CUDA tensors, on
a GPU machine).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm import kernels
from attention_fixtures import metadata_of
from mini_vllm.kernels import reference
from mini_vllm.kernels.testing import PagedBatch, make_paged_batch
from mini_vllm.attention import TorchAttentionBackend
from mini_vllm.attention import torch_backend
from mini_vllm.attention.torch_backend import PartsAttentionBackend

DEVICE = "cpu" if kernels.TRITON_INTERPRETED or not kernels.TRITON_AVAILABLE else "cuda"
SCALE = 0.2
TOLERANCE = 1e-5  # float32, as in test_kernels_attention.py and test_torch_backend.py
needs_triton = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason=kernels.UNAVAILABLE_MESSAGE)

# seq_lens, query_lens
STEPS = {
    # A prefill over a cached prefix, a fresh prefill, a chunk of a prefill, a decode, a longer fresh prefill.
    "mixed": ([40, 12, 32, 19, 45], [8, 12, 16, 1, 45]),
    # Decodes of unequal lengths: one token, block-aligned, mid-block.
    "decode": ([1, 33, 17, 40, 64], [1, 1, 1, 1, 1]),
    # One prefill: windows just below, at and above its length.
    "one prefill": ([37], [37]),
}
# Windows smaller than a block (8), across blocks, equal to a sequence (40, 37), larger than every one.
WINDOWS = {
    "mixed": [1, 13, 40, 1000],
    "decode": [1, 13, 40, 1000],
    "one prefill": [36, 37, 38],
}


# --------------------------------------------------------------------------- the oracle and the step


def dense_attention(batch: PagedBatch, sliding_window: int | None) -> torch.Tensor:
    """Softmax attention per sequence with a dense ``[q_len, seq_len]`` mask: causal, and the band."""
    out = torch.zeros(batch.query.shape, dtype=torch.float32, device=batch.query.device)
    cu = batch.cu_seqlens_q.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = cu[s], cu[s + 1]
        if end == start:
            continue
        keys, values = reference.gather_kv(batch.k_cache, batch.v_cache, batch.block_tables[s], seq_len)
        query = batch.query[start:end].float()
        group = query.shape[1] // keys.shape[1]
        keys = keys.float().repeat_interleave(group, dim=1)
        values = values.float().repeat_interleave(group, dim=1)
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)[:, None]
        key_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = torch.einsum("qhd,khd->hqk", query, keys) * SCALE
        weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, values)
    return out


def first_key_of(seq_len: int, query_len: int, sliding_window: int | None) -> int:
    """The first query's window start: every query's window starts there or later."""
    if sliding_window is None or query_len == 0:
        return 0
    return max(0, seq_len - query_len - sliding_window + 1)


def free_blocks_before_window(
    batch: PagedBatch, sliding_window: int | None, fill: float = float("nan"), strict: bool = False
) -> int:
    """Free every block entirely before a sequence's first query's window (in place); return how many.

    A freed block's table entry becomes the placeholder 0 and its slots hold ``fill``
    (it may belong to another request by now). ``strict``: also ``fill`` the slots
    before the window in the first block the window reaches.
    """
    block_size = batch.k_cache.shape[1]
    query_lens = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).tolist()
    freed = 0
    for s, (seq_len, query_len) in enumerate(zip(batch.seq_lens.tolist(), query_lens)):
        first_key = first_key_of(seq_len, query_len, sliding_window)
        for logical in range(first_key // block_size):
            physical = int(batch.block_tables[s, logical])
            batch.k_cache[physical] = fill
            batch.v_cache[physical] = fill
            batch.block_tables[s, logical] = 0
            freed += 1
        if strict and first_key % block_size:
            physical = int(batch.block_tables[s, first_key // block_size])
            batch.k_cache[physical, : first_key % block_size] = fill
            batch.v_cache[physical, : first_key % block_size] = fill
    return freed


def make_step(
    step: str | tuple[list[int], list[int]],
    *,
    num_q_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 8,
    seed: int = 0,
    fill: float = float("nan"),
) -> PagedBatch:
    """A step whose new K/V are stored; block 0 is nobody's and holds ``fill``."""
    seq_lens, query_lens = STEPS[step] if isinstance(step, str) else step
    batch = make_paged_batch(
        seq_lens,
        query_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        block_zero_unused=True,
        fill=fill,
        device=DEVICE,
        generator=torch.Generator().manual_seed(seed),
    )
    batch.store_new_kv()
    return batch


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.isfinite(actual).all(), "not finite: a key outside the window (freed, garbage) was used"
    torch.testing.assert_close(actual.float(), expected.float(), rtol=TOLERANCE, atol=TOLERANCE)


# --------------------------------------------------------------------------- the implementations
# Each takes the step and, as a keyword, sliding_window (left out: the implementation's default).


def run_reference(batch: PagedBatch, **window) -> torch.Tensor:
    args = (batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables)
    return reference.unified_attention(*args, SCALE, **window)


def run_reference_paged(batch: PagedBatch, **window) -> torch.Tensor:
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    return reference.paged_attention(*args, SCALE, **window)


def run_torch_backend(batch: PagedBatch, **window) -> torch.Tensor:
    metadata = metadata_of(batch, **window)
    return TorchAttentionBackend().attention(batch.query, batch.k_cache, batch.v_cache, metadata, SCALE)


def full_attention_decode(query, k_cache, v_cache, block_table, seq_len, scale):
    """A ``paged_decode`` part knows no window: it attends over the whole table row."""
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=query.device)
    return reference.paged_attention(query[None], k_cache, v_cache, block_table[None], seq_lens, scale)[0]


def run_parts_backend(batch: PagedBatch, **window) -> torch.Tensor:
    backend = PartsAttentionBackend(paged_decode=full_attention_decode)
    return backend.attention(batch.query, batch.k_cache, batch.v_cache, metadata_of(batch, **window), SCALE)


def run_triton_backend(batch: PagedBatch, **window) -> torch.Tensor:
    from mini_vllm.attention.triton_backend import TritonAttentionBackend

    metadata = metadata_of(batch, **window)
    return TritonAttentionBackend().attention(batch.query, batch.k_cache, batch.v_cache, metadata, SCALE)


def run_unified_kernel(batch: PagedBatch, **window) -> torch.Tensor:
    args = (batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables)
    return kernels.unified_attention(*args, SCALE, max_query_len=batch.max_query_len, **window)


def paged_kernel(num_splits: int):
    def run_paged_kernel(batch: PagedBatch, **window) -> torch.Tensor:
        args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
        return kernels.paged_attention(*args, SCALE, num_splits=num_splits, **window)

    return run_paged_kernel


def on_cpu(batch: PagedBatch) -> PagedBatch:
    """The same step with every tensor on the CPU (the C kernel's device; a no-op on a CPU machine)."""
    fields = {name: getattr(batch, name) for name in batch.__dataclass_fields__}
    return PagedBatch(**{name: v.cpu() if isinstance(v, torch.Tensor) else v for name, v in fields.items()})


def run_cpu_backend(batch: PagedBatch, **window) -> torch.Tensor:
    from mini_vllm.attention.cpu_backend import CpuAttentionBackend

    batch_on_cpu = on_cpu(batch)
    metadata = metadata_of(batch_on_cpu, **window)
    out = CpuAttentionBackend().attention(
        batch_on_cpu.query, batch_on_cpu.k_cache, batch_on_cpu.v_cache, metadata, SCALE
    )
    return out.to(batch.query.device)


def run_c_kernel(batch: PagedBatch, **window) -> torch.Tensor:
    from mini_vllm.kernels.paged_attention_cpu import paged_attention_cpu

    b = on_cpu(batch)
    out = paged_attention_cpu(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, SCALE, **window)
    return out.to(batch.query.device)


# name -> (function, decode steps only, needs Triton)
IMPLEMENTATIONS = {
    "reference": (run_reference, False, False),
    "reference paged": (run_reference_paged, True, False),
    "torch backend": (run_torch_backend, False, False),
    "torch backend with a paged_decode part": (run_parts_backend, False, False),
    "triton backend": (run_triton_backend, False, True),
    "unified kernel": (run_unified_kernel, False, True),
    "paged kernel": (paged_kernel(1), True, True),
    "paged kernel, 3 splits": (paged_kernel(3), True, True),
    "cpu backend": (run_cpu_backend, False, False),
    "C paged kernel (paged_attention_cpu)": (run_c_kernel, True, False),
}


def implementations(step: str) -> list:
    """pytest params: the implementations that take ``step`` (decode-only ones need one query per sequence)."""
    is_decode = all(q == 1 for q in STEPS[step][1])
    return [
        pytest.param(name, marks=[needs_triton] if triton else [], id=name)
        for name, (_, decode_only, triton) in IMPLEMENTATIONS.items()
        if is_decode or not decode_only
    ]


def cases(windows: dict[str, list[int]] = WINDOWS) -> list:
    return [
        pytest.param(step, window, *param.values, marks=param.marks, id=f"{step}-W{window}-{param.id}")
        for step in windows
        for param in implementations(step)
        for window in windows[step]
    ]


# --------------------------------------------------------------------------- equal to the dense oracle


@pytest.mark.parametrize("step", STEPS)
def test_the_fixture_windows_change_the_result(step):
    """Windows shorter than a sequence change its output (so the comparisons below can fail); longer ones do not."""
    batch = make_step(step)
    full = dense_attention(batch, None)
    for window in WINDOWS[step]:
        windowed = dense_attention(batch, window)
        if window < max(STEPS[step][0]):
            assert not torch.allclose(windowed, full, rtol=1e-3, atol=1e-3), window
        else:
            torch.testing.assert_close(windowed, full, rtol=0, atol=0)


@pytest.mark.parametrize("step, window, impl", cases())
def test_equals_dense_masked_attention_with_freed_blocks(step, window, impl):
    batch = make_step(step)
    expected = dense_attention(batch, window)
    free_blocks_before_window(batch, window)

    actual = IMPLEMENTATIONS[impl][0](batch, sliding_window=window)

    assert_close(actual, expected)


GQA_WINDOWS = {"mixed": [6], "decode": [11]}


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=lambda h: f"{h[0]}q-{h[1]}kv")
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("step, window, impl", cases(GQA_WINDOWS))
def test_grouped_query_attention_and_block_sizes(step, window, impl, heads, block_size):
    batch = make_step(step, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=64, block_size=block_size, seed=3)
    expected = dense_attention(batch, window)
    free_blocks_before_window(batch, window)

    assert_close(IMPLEMENTATIONS[impl][0](batch, sliding_window=window), expected)


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("window", [1, 20, 64, 137, 150, 1000])
def test_torch_backend_long_prefills_in_query_chunks(monkeypatch, chunk, window):
    """Prefills longer than PREFILL_QUERY_CHUNK: each chunk's keys start at its own first query's window."""
    monkeypatch.setattr(torch_backend, "PREFILL_QUERY_CHUNK", chunk)
    batch = make_step(([150, 200], [150, 137]))  # a fresh prefill, one over 63 cached tokens
    expected = dense_attention(batch, window)
    free_blocks_before_window(batch, window, strict=True)

    assert_close(run_torch_backend(batch, sliding_window=window), expected)


@st.composite
def step_and_window(draw) -> tuple[list[int], list[int], int]:
    seq_lens = draw(st.lists(st.integers(1, 50), min_size=1, max_size=4))
    query_lens = [draw(st.integers(1, seq_len)) for seq_len in seq_lens]
    return seq_lens, query_lens, draw(st.integers(1, 60))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    lens_and_window=step_and_window(),
    group=st.integers(1, 4),
    block_size=st.sampled_from([8, 16, 32]),
    seed=st.integers(0, 2**16),
)
def test_random_steps(lens_and_window, group, block_size, seed):
    seq_lens, query_lens, window = lens_and_window
    batch = make_step((seq_lens, query_lens), num_q_heads=2 * group, block_size=block_size, seed=seed)
    expected = dense_attention(batch, window)
    free_blocks_before_window(batch, window, strict=True)

    assert_close(run_reference(batch, sliding_window=window), expected)
    assert_close(run_torch_backend(batch, sliding_window=window), expected)
    if kernels.TRITON_AVAILABLE:
        assert_close(run_unified_kernel(batch, sliding_window=window), expected)
        decode = make_step((seq_lens, [1] * len(seq_lens)), num_q_heads=2 * group, block_size=block_size, seed=seed)
        expected = dense_attention(decode, window)
        free_blocks_before_window(decode, window, strict=True)
        assert_close(paged_kernel(2)(decode, sliding_window=window), expected)


# --------------------------------------------------------------------------- keys outside the window are never read


def strict_cases() -> list:
    return [
        pytest.param(step, *param.values, marks=param.marks, id=f"{step}-{param.id}")
        for step in ("mixed", "decode")
        for param in implementations(step)
    ]


@pytest.mark.parametrize("step, impl", strict_cases())
def test_no_key_before_the_first_querys_window_is_loaded(step, impl):
    """NaN in every slot before each sequence's first query's window: skipped, so the output does not change."""
    window = 13  # not a multiple of the block size: the window starts inside a block
    run = IMPLEMENTATIONS[impl][0]
    batch = make_step(step)
    before = run(batch, sliding_window=window)

    freed = free_blocks_before_window(batch, window, strict=True)

    assert freed > 0
    # The poison lies where full attention reads: had anything before the window been loaded, even
    # to be masked out, it would show (0 * NaN is NaN).
    assert run_reference(batch).isnan().any()
    after = run(batch, sliding_window=window)
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert_close(after, dense_attention(make_step(step), window))


@pytest.mark.parametrize("step, impl", strict_cases())
def test_huge_values_in_freed_blocks_do_not_matter(step, impl):
    """Garbage that is finite but huge, in the freed blocks and in block 0 (the placeholder)."""
    window = 13
    batch = make_step(step, fill=1e30)
    expected, full = dense_attention(batch, window), dense_attention(batch, None)
    assert free_blocks_before_window(batch, window, fill=1e30) > 0

    # Read by full attention, the garbage swamps the result.
    assert not torch.allclose(run_reference(batch).float(), full, rtol=1e-3, atol=1e-3)
    assert_close(IMPLEMENTATIONS[impl][0](batch, sliding_window=window), expected)


# --------------------------------------------------------------------------- no window: today's results


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
@pytest.mark.parametrize("step, impl", strict_cases())
def test_no_window_is_full_causal_attention_bit_for_bit(step, impl):
    """sliding_window=None is the default, and a window longer than every sequence changes no bit."""
    run = IMPLEMENTATIONS[impl][0]
    batch = make_step(step)
    default = run(batch)

    torch.testing.assert_close(run(batch, sliding_window=None), default, rtol=0, atol=0)
    assert_close(default, dense_attention(batch, None))
    if impl != "torch backend with a paged_decode part":  # with a window it does not call the part
        torch.testing.assert_close(run(batch, sliding_window=batch.max_seq_len), default, rtol=0, atol=0)
        torch.testing.assert_close(run(batch, sliding_window=10**9), default, rtol=0, atol=0)


# --------------------------------------------------------------------------- bad windows


BAD_WINDOWS = [0, -1, 1.5, True, "4"]


@pytest.mark.parametrize("bad", BAD_WINDOWS, ids=repr)
@pytest.mark.parametrize("impl", [p.values[0] for p in implementations("decode")], ids=str)
def test_a_bad_sliding_window_raises_value_error_naming_it(impl, bad):
    run, _, triton = IMPLEMENTATIONS[impl]
    if triton and not kernels.TRITON_AVAILABLE:
        pytest.skip(kernels.UNAVAILABLE_MESSAGE)
    batch = make_step("decode")
    with pytest.raises(ValueError, match="sliding_window"):
        run(batch, sliding_window=bad)


def test_a_whole_number_of_another_integer_type_is_accepted():
    batch = make_step("decode")
    window = torch.tensor(5).numpy()[()]  # numpy.int64, as a config read with numpy might give
    assert_close(run_torch_backend(batch, sliding_window=window), dense_attention(batch, 5))
    assert_close(run_reference(batch, sliding_window=window), dense_attention(batch, 5))
    if kernels.TRITON_AVAILABLE:
        assert_close(paged_kernel(1)(batch, sliding_window=window), dense_attention(batch, 5))
