"""``paged_attention_cpu``: decode attention over the paged KV cache, in C, for the CPU (chapter 07).

The same contract as :func:`mini_vllm.kernels.paged_attention` (the Triton kernel) and
:func:`mini_vllm.kernels.reference.paged_attention` (the oracle both are tested against),
for float32 tensors on the CPU. The loop is ``paged_attention_cpu.c``, beside
this file: it reads each key and value row where it lies in the cache, through
the block table, instead of copying the sequence's blocks out first as the
``torch`` backend must (``index_select``) -- what vLLM's CPU backend does in C++.

Why C and not Triton: Triton compiles only for GPUs; on a CPU its kernels run in
an interpreter, hundreds of times slower. Why not PyTorch: a decode step's
attention is small (one query per sequence), so the torch backend's time there
goes to per-call overhead and the gather copies (``benchmarks/README.md``,
"Against vLLM", measured).

The C file is compiled once per machine with the system's C compiler (``cc``,
or ``$CC``) into ``~/.cache/mini_vllm`` (or ``$MINI_VLLM_CACHE_DIR``; a private
temporary folder when the home cannot be written) and loaded with :mod:`ctypes`
(:mod:`mini_vllm.kernels._c_build`); no PyTorch headers, so it takes under a second.
:func:`available` says whether that worked (no compiler: False, and the reason
in :func:`unavailable_reason`); the ``cpu`` attention backend needs it.
"""

from __future__ import annotations

import ctypes
import functools
import numbers
from pathlib import Path

import torch

from mini_vllm.validation import check_sliding_window

from ._c_build import check_c_tensors, load_library
from ._validate import check_attention

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")

# The C function's negative return codes (paged_attention_cpu.c).
_ERRORS = {
    -1: "seq_lens[{s}] is {seq_len}: it must be at least 1 and fit in its block_tables row "
    "({width} blocks of {block_size})",
    -2: "block_tables row {s} names a block outside the cache's {num_blocks} blocks",
    -3: "out of memory for the attention scores",
}


_SIGNATURES = {
    "paged_attention_f32": (
        ctypes.c_int,
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_void_p],
    )
}


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ctypes.CDLL | None, str]:
    """Compile (once per source, compiler and CPU) and load the C kernel: ``(library, "")`` or ``(None, why not)``."""
    return load_library(SOURCE, _SIGNATURES)


def available() -> bool:
    """True when the C kernel compiled and loaded on this machine."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    return _load()[1]


def paged_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention: ``query[s]`` (one token per sequence) over sequence ``s``'s cached context.

    Shapes and dtypes as :func:`mini_vllm.kernels.reference.paged_attention`: ``query``
    ``[num_seqs, num_q_heads, head_dim]``; caches ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; ``block_tables`` ``[num_seqs, max_num_blocks]`` and
    ``seq_lens`` ``[num_seqs]``, int32. All on the CPU, float32. ``scale`` defaults
    to ``head_dim ** -0.5``; ``sliding_window=W`` reads only each sequence's last
    ``W`` positions. Returns
    ``[num_seqs, num_q_heads, head_dim]``. ``ValueError`` names a bad argument, a
    sequence longer than its block-table row or a block id outside the cache (the
    C loop checks them before reading anything); ``RuntimeError`` where the kernel
    could not be built (:func:`unavailable_reason`). Inference only (no autograd), and
    the inputs must not change during the call: the block ids are checked, then read.
    """
    check_attention(query, k_cache, v_cache, block_tables, seq_lens, interpreted=True)
    check_sliding_window(sliding_window)
    check_c_tensors("paged_attention_cpu", torch.float32, query=query, k_cache=k_cache, v_cache=v_cache)
    check_c_tensors("paged_attention_cpu", None, block_tables=block_tables, seq_lens=seq_lens)  # int32: checked above
    lib, why_not = _load()
    if lib is None:
        raise RuntimeError(f"the C decode-attention kernel is unavailable: {why_not}")
    query = query.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # views of themselves when already so
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    num_seqs, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise ValueError(f"scale must be a number or None, got {scale!r}")
    scale = head_dim**-0.5 if scale is None else float(scale)
    out = torch.empty_like(query)
    bad_seq = ctypes.c_int64(0)
    code = lib.paged_attention_f32(
        out.data_ptr(),
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        num_seqs,
        num_q_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        block_tables.shape[1],
        min(sliding_window or 0, 2**62),  # a window longer than any sequence is no window (and fits int64)
        scale,
        ctypes.byref(bad_seq),
    )
    if code != 0:
        s = bad_seq.value
        message = _ERRORS.get(code, f"failed with code {code}").format(
            s=s, seq_len=int(seq_lens[s]), width=block_tables.shape[1], block_size=block_size, num_blocks=num_blocks
        )
        raise (MemoryError if code == -3 else ValueError)(f"paged_attention_cpu: {message}")
    return out
