"""The ``cpu`` attention backend: the torch backend, with decode steps in a C kernel (chapter 07).

On a CPU, a decode step's attention in the ``torch`` backend spends its time on
copies and per-call overhead: every layer gathers each sequence's blocks out of
the cache (``index_select``) and calls PyTorch's attention once per sequence.
This backend sends an all-decode batch of float32 CPU tensors to
:func:`mini_vllm.kernels.paged_attention_cpu.paged_attention_cpu` instead, a C loop that
reads each key and value row in place through the block table, one call for
the whole batch (as vLLM's CPU backend does in C++). Prefill steps, and other
dtypes or devices, stay the torch backend's: a prefill's attention is already
PyTorch's fused flash kernel, which this loop would not beat.

It is the CPU's fast path as a whole: with this backend the model runner
installs :mod:`mini_vllm.cpu_fast_path` on the model, which then runs RMSNorm,
RoPE and SwiGLU's gate as fused C kernels (:mod:`mini_vllm.kernels.fused_ops_cpu`,
what vLLM's CPU backend does in C++), projections of one to three rows as a C
loop and larger ones from oneDNN-packed weights, where the readable path makes
several PyTorch calls of each.

The C files are compiled on first use with the machine's C compiler; asking for
this backend where that failed is a ValueError naming the reason.
"""

from __future__ import annotations

import torch

from mini_vllm.kernels.paged_attention_cpu import paged_attention_cpu

from .base import AttentionMetadata
from .torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    """``store_kv`` and prefill as the torch backend; an all-decode float32 CPU batch in C."""

    name = "cpu"
    cpu_fast_path = True  # and the rest of the model in C and oneDNN (mini_vllm/cpu_fast_path.py)

    def attention(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        in_c = query.device.type == "cpu" and query.dtype == k_cache.dtype == torch.float32
        if not (metadata.is_all_decode and in_c):
            return super().attention(query, k_cache, v_cache, metadata, scale)
        tables, lengths = metadata.block_tables, metadata.seq_lens
        return paged_attention_cpu(
            query, k_cache, v_cache, tables, lengths, scale, sliding_window=metadata.sliding_window
        )
