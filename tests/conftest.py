"""Shared set-up for the test suite."""

from __future__ import annotations

import os

import torch

# Without a GPU the kernels run in Triton's interpreter; the variable must be set
# before triton is first imported (kernels/__init__ does the same). On a GPU
# machine the kernels compile, and the kernel tests run on CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
