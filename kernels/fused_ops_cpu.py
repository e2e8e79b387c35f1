"""The decoder layer's element-wise operations, each one fused pass in C, for the CPU (chapter 07).

``rms_norm``, ``rotary_embedding_`` and ``silu_and_mul`` compute what
:func:`mini_vllm.model.rms_norm`, :func:`mini_vllm.model.apply_rotary_pos_emb` and
:func:`mini_vllm.model.silu_and_mul` compute (the readable definitions, which the
tests hold these to), for float32 tensors on the CPU. The loops are
``fused_ops_cpu.c``, beside this file.

Why: in a decode step of a few tokens, each PyTorch call costs more in overhead
than in arithmetic, and RMSNorm alone is six of them (``pow``, ``mean``, ``add``,
``rsqrt``, two multiplies); RoPE is five, SwiGLU's gate three. vLLM's CPU backend
runs the same three operations as fused C++ kernels. The ``cpu`` attention
backend turns these on for the whole model (:func:`mini_vllm.cpu_fast_path.install_cpu_fast_path`);
the chapters run the readable ones.

``linear`` is the odd one out: ``nn.functional.linear`` for a few rows, as plain dot
products streaming the weight (``CpuLinear`` uses it below ``PACKED_MIN_ROWS`` rows, where
on some CPUs MKL's matrix-vector path reads the weight well below memory speed).

Compiled on first use as :mod:`mini_vllm.kernels.paged_attention_cpu` is (:mod:`mini_vllm.kernels._c_build`);
:func:`available` says whether that worked.
"""

from __future__ import annotations

import ctypes
import functools
import math
import numbers
from pathlib import Path

import torch

from ._c_build import check_c_tensors, load_library

SOURCE = Path(__file__).with_name("fused_ops_cpu.c")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm_f32": (None, [_P, _P, _P, _I, _I, _F]),
    "silu_and_mul_f32": (None, [_P, _P, _I, _I]),
    "rotary_f32": (None, [_P, _P, _P, _I, _I, _I, _I]),
    "linear_f32": (None, [_P, _P, _P, _P, _I, _I, _I]),
}


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ctypes.CDLL | None, str]:
    """Compile (once per source, compiler and CPU) and load the C file: ``(library, "")`` or ``(None, why not)``."""
    return load_library(SOURCE, _SIGNATURES)


def available() -> bool:
    """True when the C file compiled and loaded on this machine."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    return _load()[1]


def _library(function: str, **tensors: torch.Tensor) -> ctypes.CDLL:
    """The loaded library, after :func:`~mini_vllm.kernels._c_build.check_c_tensors` (float32) on every tensor."""
    check_c_tensors(function, torch.float32, **tensors)
    lib, why_not = _load()
    if lib is None:
        raise RuntimeError(f"the C element-wise kernels are unavailable: {why_not}")
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dimension; a new tensor of ``x``'s shape."""
    lib = _library("rms_norm", x=x, weight=weight)
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least one dimension (the one normalised)")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < math.inf:
        raise ValueError(f"rms_norm: eps must be a finite number >= 0, got {eps!r}")
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({dim},) for x {tuple(x.shape)}")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    lib.rms_norm_f32(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.numel() // max(dim, 1), dim, eps)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(gate) * up`` where ``gate_up = [gate | up]`` along the last dimension."""
    lib = _library("silu_and_mul", gate_up=gate_up)
    width = gate_up.shape[-1] if gate_up.dim() else 1
    if width % 2:
        raise ValueError(f"silu_and_mul: the last dimension ({width}) must hold gate and up, two equal halves")
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], width // 2)
    lib.silu_and_mul_f32(out.data_ptr(), gate_up.data_ptr(), out.numel() // max(width // 2, 1), width // 2)
    return out


def rotary_embedding_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of ``x`` ``[n, heads, D]`` by RoPE's angles, in place; returns ``x``.

    ``cos``, ``sin``: ``[n, 1, D]`` (or ``[n, D]``) as :class:`mini_vllm.model.RotaryEmbedding`
    makes them. ``x``'s heads must be contiguous (strides ``(any, D, 1)``), so that ``x`` can
    be the query and key heads where they lie in the fused qkv projection's output.
    """
    lib = _library("rotary_embedding_", x=x, cos=cos, sin=sin)
    if x.dim() != 3:
        raise ValueError(f"rotary_embedding_: x must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    n, heads, head_dim = x.shape
    if head_dim % 2 or x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError(
            f"rotary_embedding_: x's heads must be contiguous with an even head_dim, "
            f"got shape {tuple(x.shape)}, strides {x.stride()}"
        )
    if n > 1 and x.stride(0) < heads * head_dim:
        raise ValueError(
            f"rotary_embedding_: x's tokens overlap in memory (strides {x.stride()}): each must be its own"
        )
    angles = ((n, 1, head_dim), (n, head_dim))
    if tuple(cos.shape) not in angles or tuple(sin.shape) not in angles:
        raise ValueError(
            f"rotary_embedding_: cos and sin must be [{n}, 1, {head_dim}] or [{n}, {head_dim}], "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    cos, sin = cos.contiguous(), sin.contiguous()
    lib.rotary_f32(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, heads, head_dim, x.stride(0))
    return x


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``nn.functional.linear(x, weight, bias)`` for ``x`` ``[rows, in]``: meant for a few rows
    (a decode step of one to three sequences), where the multiply only streams the weight."""
    tensors = {"x": x, "weight": weight} | ({} if bias is None else {"bias": bias})
    lib = _library("linear", **tensors)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [rows, in] and [out, in]"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()  # kept alive until the call returns
    bias_ptr = None if bias is None else bias.data_ptr()
    out = x.new_empty(x.shape[0], weight.shape[0])
    lib.linear_f32(out.data_ptr(), x.data_ptr(), weight.data_ptr(), bias_ptr, x.shape[0], x.shape[1], weight.shape[0])
    return out
