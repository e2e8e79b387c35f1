"""Cache offsets past 2**31 elements: the kernels must compute them in 64 bits.

A block id (int32 in the block table) times the cache's block stride passes
2**31 in any cache larger than 2**31 elements (4 GiB of float16). Computed in
32 bits, the offset wraps around and the kernel writes or reads somewhere else,
or crashes the process. So the check runs in a subprocess, on a cache of just
over 4 GiB:

- ``torch.empty`` of that size only reserves address space: Linux commits a
  page of memory when it is first touched, and only a few pages are touched.
- Triton's interpreter works on the CPU tensor's own memory (for a CPU tensor
  it neither copies the cache nor compares it afterwards), and it does integer
  arithmetic with NumPy in the kernel's types, so an int32 product wraps
  around exactly as it would on a GPU.

K and V share that one big tensor, to reserve 4 GiB rather than 8: the test
stores the same rows as keys and values.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mini_vllm import kernels

pytestmark = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason=kernels.UNAVAILABLE_MESSAGE)

SCRIPT = textwrap.dedent(
    """
    import torch
    from mini_vllm import kernels
    from mini_vllm.kernels import reference

    # The interpreter works on CPU tensors; compiled kernels need GPU tensors.
    device = "cpu" if kernels.TRITON_INTERPRETED else "cuda"
    block_size, num_kv_heads, head_dim = 16, 1, 64
    elements_per_block = block_size * num_kv_heads * head_dim  # 1024
    far_block = 2**31 // elements_per_block + 5  # its first element is past 2**31
    cache = torch.empty((far_block + 1, block_size, num_kv_heads, head_dim), dtype=torch.float16, device=device)
    assert far_block * elements_per_block > 2**31

    # One sequence of 20 tokens: block 3 holds positions 0..15, the far block 16..19.
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(20, num_kv_heads, head_dim, generator=generator).half().to(device)
    block_tables = torch.tensor([[3, far_block]], dtype=torch.int32, device=device)
    slots = [3 * block_size + t for t in range(16)] + [far_block * block_size + t for t in range(4)]
    slots = torch.tensor(slots, device=device)

    # int32 slots: the kernel itself must widen them before multiplying.
    kernels.store_kv(rows, rows, cache, cache, slots.to(torch.int32))
    assert torch.equal(cache[far_block, :4], rows[16:]), "store_kv wrote the far rows to the wrong place"
    assert torch.equal(cache[3], rows[:16])
    kernels.store_kv(rows, rows, cache, cache, slots)  # int64 slots too
    assert torch.equal(cache[far_block, :4], rows[16:])

    seq_lens = torch.tensor([20], dtype=torch.int32, device=device)
    query = torch.randn(1, 2, head_dim, generator=generator).half().to(device)
    expected = reference.paged_attention(query, cache, cache, block_tables, seq_lens)
    for num_splits in (1, 2):
        actual = kernels.paged_attention(query, cache, cache, block_tables, seq_lens, num_splits=num_splits)
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-3, atol=2e-3)

    queries = torch.randn(6, 2, head_dim, generator=generator).half().to(device)
    cu_seqlens_q = torch.tensor([0, 6], dtype=torch.int32, device=device)
    expected = reference.unified_attention(queries, cache, cache, cu_seqlens_q, seq_lens, block_tables)
    actual = kernels.unified_attention(queries, cache, cache, cu_seqlens_q, seq_lens, block_tables)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-3, atol=2e-3)
    print("OK")
    """
)


def test_offsets_past_two_to_the_31_elements():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, (
        f"subprocess failed (exit code {result.returncode}; a negative code is a crash, "
        f"e.g. -11 for a segfault from a wrapped-around offset):\n{result.stdout}\n{result.stderr[-3000:]}"
    )
