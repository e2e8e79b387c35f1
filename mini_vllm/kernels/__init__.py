"""Triton kernels for the paged KV cache, and their PyTorch references (chapter 07).

Three kernels, the same three functions as :mod:`mini_vllm.kernels.reference`:

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
- Where Triton is not installed (it is Linux-only), ``from mini_vllm import kernels`` still
  works: :data:`TRITON_AVAILABLE` is ``False``, the reference functions work, and
  calling a kernel raises a :class:`RuntimeError` that says to use the ``torch``
  attention backend instead.

Where the code lives, and why it is imported by this name:

- The kernels' modules are the files of ``kernels/`` at the top of the
  repository (the course's layout: chapter 07 reads them there). This file is
  the package's ``__init__``; it points the package's ``__path__`` at that
  folder, so ``mini_vllm.kernels.store_kv`` is ``kernels/store_kv.py``.
- The import name is ``mini_vllm.kernels``, never a top-level ``kernels``:
  that name belongs to Hugging Face's kernel hub package, which ``transformers``
  5.25 and newer install and import (``from kernels import ...``). ``kernels/``
  therefore has no ``__init__.py``: with the repository root on ``sys.path``
  (``python -m ...`` from the root, ``PYTHONPATH=.``) it is no package that
  could shadow theirs, and theirs cannot shadow ours.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
KERNELS_DIR = _HERE.parents[1] / "kernels"
"""The folder that holds this package's modules: ``kernels/`` beside ``mini_vllm/``."""

if (KERNELS_DIR / "reference.py").is_file():  # a checkout, or an editable install of one
    __path__.append(str(KERNELS_DIR))  # noqa: F821 (a package's __path__ is set before its __init__ runs)
else:  # a wheel: setup.py copied the folder's files here
    KERNELS_DIR = _HERE

from . import reference  # noqa: E402


def _interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret its kernels (Triton reads it the same way)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _prepare_triton() -> bool:
    """Choose compiled or interpreted kernels, then report whether Triton imports."""
    if importlib.util.find_spec("triton") is None:
        return False
    imported_before = "triton" in sys.modules
    if not torch.cuda.is_available():
        # No GPU to compile for: interpret. setdefault keeps an explicit choice.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton  # noqa: F401  (imported for its side effect of being checked)
    except ImportError:
        return False
    if imported_before:
        _interpret_triton_language()
    return True


def _interpret_triton_language() -> None:
    """Make Triton's own ``@triton.jit`` helpers (``tl.zeros``, ``tl.max``, ...) interpretable.

    Triton decides compiled or interpreted when a function is decorated, and it
    decorates its standard library when it is first imported. PyTorch imports
    Triton on its own (building any ``nn.Module`` loads ``torch._dynamo``), so an
    engine on the torch backend, made before this package is imported, leaves
    ``tl.zeros`` compiled-only: a kernel run in the interpreter then fails with
    "Cannot call @triton.jit'd outside of the scope of a kernel". When we
    interpret, each such helper is wrapped as Triton itself would have wrapped it.
    """
    if not _interpreting():
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            for attribute, value in list(vars(module).items()):
                if type(value) is JITFunction:
                    setattr(module, attribute, InterpretedFunction(value.fn))


TRITON_AVAILABLE: bool = _prepare_triton()
"""True when Triton is installed and importable (compiled or interpreted)."""

TRITON_INTERPRETED: bool = TRITON_AVAILABLE and _interpreting()
"""True when the kernels run in Triton's interpreter rather than compiled for a GPU."""

UNAVAILABLE_MESSAGE = (
    "Triton is not installed, so the Triton kernels cannot run (Triton is Linux-only). "
    "Use the torch attention backend (LLM(attention_backend='torch')) or the "
    "plain PyTorch functions in mini_vllm.kernels.reference instead."
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
