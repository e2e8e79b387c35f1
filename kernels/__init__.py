"""Triton kernels for the paged KV cache, and their PyTorch references (chapter 07).

Three kernels, the same three functions as :mod:`kernels.reference`:

- :func:`store_kv` writes each new token's key/value into its cache slot;
- :func:`paged_attention` is decode attention (one query token per sequence),
  reading K/V through each sequence's block table;
- :func:`unified_attention` is the general case: every sequence brings the last
  ``q_len`` tokens of its context as queries, so a prefill over a cached prefix,
  a prefill chunk and a decode step are one launch.

Where they run:

- On a machine with a GPU, Triton compiles the kernels for it.
- On a machine without one, the same kernels run in Triton's *interpreter*
  (``TRITON_INTERPRET=1``): slow, but it executes every line of the kernel with
  NumPy, so the course and the tests run on a laptop. The variable has to be set
  before Triton decides how to build ``@triton.jit`` functions, which happens
  when the kernel modules below are imported; we set it here, first thing, and
  only when it is not already set (a user may ask for the interpreter on a GPU).
- Where Triton is not installed (it is Linux-only), ``import kernels`` still
  works: :data:`TRITON_AVAILABLE` is ``False``, the reference functions work, and
  calling a kernel raises a :class:`RuntimeError` that says to use the ``torch``
  attention backend instead.

This package deliberately defines no ``__version__``: Hugging Face
``transformers`` has an optional integration with an unrelated PyPI package that
is also imported as ``kernels``, and it decides whether that package is present
by looking up the version of whatever ``import kernels`` finds.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from . import reference


def _prepare_triton() -> bool:
    """Choose compiled or interpreted kernels, then report whether Triton imports."""
    if importlib.util.find_spec("triton") is None:
        return False
    if not torch.cuda.is_available():
        # No GPU to compile for: interpret. setdefault keeps an explicit choice.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton  # noqa: F401  (imported for its side effect of being checked)
    except ImportError:
        return False
    return True


TRITON_AVAILABLE: bool = _prepare_triton()
"""True when Triton is installed and importable (compiled or interpreted)."""

TRITON_INTERPRETED: bool = TRITON_AVAILABLE and os.environ.get("TRITON_INTERPRET", "0").lower() in (
    "1",
    "true",
    "yes",
    "on",
)
"""True when the kernels run in Triton's interpreter rather than compiled for a GPU."""

UNAVAILABLE_MESSAGE = (
    "Triton is not installed, so the Triton kernels cannot run (Triton is Linux-only). "
    "Use the torch attention backend (LLM(attention_backend='torch')) or the "
    "plain PyTorch functions in kernels.reference instead."
)

if TRITON_AVAILABLE:
    # Imported only now: these modules define @triton.jit functions, and Triton
    # reads TRITON_INTERPRET when they are defined.
    from .paged_attention import paged_attention
    from .store_kv import store_kv
    from .unified_attention import unified_attention
else:

    def store_kv(*args, **kwargs):  # type: ignore[no-redef]
        """Unavailable without Triton: see :data:`UNAVAILABLE_MESSAGE`."""
        raise RuntimeError(UNAVAILABLE_MESSAGE)

    def paged_attention(*args, **kwargs):  # type: ignore[no-redef]
        """Unavailable without Triton: see :data:`UNAVAILABLE_MESSAGE`."""
        raise RuntimeError(UNAVAILABLE_MESSAGE)

    def unified_attention(*args, **kwargs):  # type: ignore[no-redef]
        """Unavailable without Triton: see :data:`UNAVAILABLE_MESSAGE`."""
        raise RuntimeError(UNAVAILABLE_MESSAGE)


__all__ = [
    "TRITON_AVAILABLE",
    "TRITON_INTERPRETED",
    "UNAVAILABLE_MESSAGE",
    "paged_attention",
    "reference",
    "store_kv",
    "unified_attention",
]
