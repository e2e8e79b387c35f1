"""Shared helpers for the test suite."""

from __future__ import annotations

import os

# Kernels run through Triton's interpreter on machines without a GPU; set it
# before anything imports triton (kernels/__init__ also does this).
os.environ.setdefault("TRITON_INTERPRET", "1")
