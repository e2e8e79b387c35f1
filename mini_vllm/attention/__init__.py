"""Attention backends over the paged KV cache (chapter 07).

``get_attn_backend(name)`` returns a backend by name: ``"torch"`` (the reference,
always available), ``"triton"`` (the kernels in :mod:`kernels`; needs Triton), or
``"auto"`` (Triton on a CUDA device, the torch reference otherwise).
"""

from __future__ import annotations

from .base import AttentionBackend, AttentionMetadata
from .torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attn_backend"]


def get_attn_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """Return the attention backend called ``name`` (ValueError for unknown names)."""
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") and _triton_available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        if not _triton_available():
            raise ValueError(
                "attention_backend='triton' needs Triton, which is not installed "
                "(it is Linux-only); use attention_backend='torch'"
            )
        from .triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention_backend {name!r}; expected 'auto', 'torch' or 'triton'")


def _triton_available() -> bool:
    import kernels

    return kernels.TRITON_AVAILABLE
