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
  when Triton and the kernel modules below are imported; we set it here, first
  thing, and only when it is not already set (a user may ask for the interpreter
  on a GPU).
- Triton itself loads only when it is needed (it takes seconds): when a kernel or
  :data:`TRITON_AVAILABLE` is first read. :mod:`mini_vllm.kernels.reference` and
  the ``torch`` attention backend never load it.
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

import functools
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

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


def _choose_interpreter() -> None:
    """Ask for interpreted kernels where there is no GPU, before Triton is imported (it is not, here)."""
    if importlib.util.find_spec("triton") is None:
        return
    if not torch.cuda.is_available():
        # No GPU to compile for: interpret. setdefault keeps an explicit choice.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if "triton" in sys.modules:  # someone imported Triton before this package could choose
        _interpret_triton_language()


def _interpret_triton_language() -> None:
    """Make Triton's own ``@triton.jit`` helpers (``tl.zeros``, ``tl.max``, ...) interpretable.

    Triton decides compiled or interpreted when a function is decorated, and it
    decorates its standard library when it is first imported. A program that
    imports Triton before this package (``import triton``, or ``torch._dynamo``,
    which PyTorch loads for ``torch.compile``) leaves ``tl.zeros`` compiled-only:
    a kernel run in the interpreter then fails with "Cannot call @triton.jit'd
    outside of the scope of a kernel". When we interpret, each such helper is
    wrapped as Triton itself would have wrapped it.
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


_choose_interpreter()


@functools.cache
def _triton_imports() -> bool:
    """Import Triton (once, on first need) and report whether it imports."""
    try:
        import triton  # noqa: F401  (imported for its side effect of being checked)
    except ImportError:
        return False
    return True


UNAVAILABLE_MESSAGE = (
    "Triton is not installed, so the Triton kernels cannot run (Triton is Linux-only). "
    "Use the torch attention backend (LLM(attention_backend='torch')) or the "
    "plain PyTorch functions in mini_vllm.kernels.reference instead."
)

_KERNELS = ("paged_attention", "store_kv", "unified_attention")
"""The kernels: each is the function of the same name in the module of the same name."""


def _unavailable(*args, **kwargs):
    """A kernel without Triton: see :data:`UNAVAILABLE_MESSAGE`."""
    raise RuntimeError(UNAVAILABLE_MESSAGE)


class _KernelsPackage(types.ModuleType):
    """This package's module object: its Triton names are looked up when first read.

    - ``TRITON_AVAILABLE``: True when Triton is installed and importable (compiled or interpreted).
    - ``TRITON_INTERPRETED``: True when the kernels run in Triton's interpreter rather than
      compiled for a GPU.
    - ``store_kv``, ``paged_attention``, ``unified_attention``: the kernels (they import Triton;
      without it, functions that raise :data:`UNAVAILABLE_MESSAGE`).
    """

    def __getattr__(self, name: str) -> Any:  # called only for names not set yet
        if name == "TRITON_AVAILABLE":
            return _triton_imports()
        if name == "TRITON_INTERPRETED":
            return _triton_imports() and _interpreting()
        if name in _KERNELS:
            if not _triton_imports():
                return _unavailable
            importlib.import_module(f"{__name__}.{name}")  # binds the name: see __setattr__
            return vars(self)[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # Importing kernels/store_kv.py (by us, or by anyone) sets the package's `store_kv` to
        # that module; the package's name is the kernel, the module's function of that name.
        if name in _KERNELS and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsPackage

__all__ = [
    "TRITON_AVAILABLE",
    "TRITON_INTERPRETED",
    "UNAVAILABLE_MESSAGE",
    "paged_attention",
    "reference",
    "store_kv",
    "unified_attention",
]
