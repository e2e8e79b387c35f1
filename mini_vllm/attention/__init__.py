"""Attention backends over the paged KV cache (chapter 07).

``get_attn_backend(name)`` returns a backend by name: ``"torch"`` (the reference,
always available), ``"triton"`` (the kernels in :mod:`mini_vllm.kernels`; needs Triton),
``"cpu"`` (the torch backend with decode attention in C, and the model's element-wise
operations in C too, for speed on a CPU; needs a C compiler), or ``"auto"`` (Triton
on a CUDA device, the torch reference otherwise: the readable path the chapters show).

Each backend is one function registered with ``@register_attention_backend(name)``
below, which imports its class only when it is called: this module loads
without torch (``EngineConfig`` reads the names from it), and without the
``mini_vllm.kernels`` package, which decides on Triton's interpreter when it is imported
(only the ``triton`` backend needs it). The classes are imported on first use too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..registry import Registry
from ..validation import one_of

if TYPE_CHECKING:
    from .base import AttentionBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "attention_backend_names",
    "get_attn_backend",
    "register_attention_backend",
]

ATTENTION_BACKENDS: Registry[Callable[[str], AttentionBackend]] = Registry("attention backend")
"""name -> a function ``(device) -> AttentionBackend`` that returns a new backend for the
engine's device (and imports what it needs), or raises a ValueError saying what is missing."""


def register_attention_backend(name: str) -> Callable:
    """Decorator: register a function ``(device) -> AttentionBackend`` that returns the backend called ``name``.

    ``device`` is the engine's device string (``"cpu"``, ``"cuda:0"``, ...); a backend that
    cannot run there refuses it with a ValueError.

    That is the one edit a new backend needs besides its class: ``LLM(attention_backend=name)``,
    ``EngineConfig``'s check and ``get_attn_backend`` read the names from here.
    """
    return ATTENTION_BACKENDS.register(name)


@register_attention_backend("torch")
def create_torch_backend(device: str) -> AttentionBackend:
    """The reference: PyTorch's fused attention, on any device."""
    from .torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


@register_attention_backend("triton")
def create_triton_backend(device: str) -> AttentionBackend:
    """The Triton kernels of :mod:`mini_vllm.kernels` (compiled on a GPU, interpreted on a CPU)."""
    if not _triton_available():
        raise ValueError(
            "attention_backend='triton' needs Triton, which is not installed "
            "(it is Linux-only); use attention_backend='torch'"
        )
    from .triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


@register_attention_backend("cpu")
def create_cpu_backend(device: str) -> AttentionBackend:
    """The torch backend with decode attention in C (:mod:`mini_vllm.kernels.paged_attention_cpu`), and
    the model's norms, RoPE and SwiGLU's gate in C too (:mod:`mini_vllm.kernels.fused_ops_cpu`)."""
    if _device_type(device) != "cpu":
        raise ValueError(f"attention_backend='cpu' runs on the CPU, but the engine's device is {device!r}")
    from mini_vllm.kernels import fused_ops_cpu, paged_attention_cpu

    for module in (paged_attention_cpu, fused_ops_cpu):
        if not module.available():
            raise ValueError(
                f"attention_backend='cpu' needs its C kernels, which could not be built here "
                f"({module.unavailable_reason()}); use attention_backend='torch'"
            )
    from .cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend()


def attention_backend_names() -> tuple[str, ...]:
    """Every valid ``attention_backend``: "auto", then the registered backends."""
    return ("auto", *ATTENTION_BACKENDS.names())


def get_attn_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """Return the attention backend called ``name`` for ``device`` (ValueError for unknown names,
    and for a backend that cannot run on ``device``)."""
    device = str(device)
    if name == "auto":
        name = "triton" if _device_type(device) == "cuda" and _triton_available() else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; expected {one_of(attention_backend_names())}")
    return ATTENTION_BACKENDS[name](device)


def _device_type(device: str) -> str:
    """``"cuda:1"`` -> ``"cuda"`` (this module reads device strings without importing torch)."""
    return device.split(":", 1)[0]


def _triton_available() -> bool:
    from mini_vllm import kernels

    return kernels.TRITON_AVAILABLE


# The classes, imported when first used (they need torch): name -> its module.
_LAZY_NAMES = {
    "AttentionBackend": ".base",
    "AttentionMetadata": ".base",
    "TorchAttentionBackend": ".torch_backend",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_NAMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
