"""Shared set-up for the test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Under CI (CI=true) a skip for a missing prerequisite (Chromium, real vLLM, the real model, npm)
# fails the test instead: tests/prerequisites.py.
from prerequisites import pytest_configure, pytest_runtest_makereport  # noqa: F401

# Without a GPU the kernels run in Triton's interpreter; the variable must be set
# before triton is first imported (mini_vllm.kernels does the same). On a GPU
# machine the kernels compile, and the kernel tests run on CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The learner's parts (mini_vllm.course.parts) that notebooks run by the tests keep go
# to a fresh folder, never to the checkout's my-course/ (the kernels inherit this).
if "MINI_VLLM_PARTS" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["MINI_VLLM_PARTS"] = tempfile.mkdtemp(prefix="mini-vllm-parts-")
    atexit.register(shutil.rmtree, os.environ["MINI_VLLM_PARTS"], True)


@pytest.fixture(scope="session")
def default_model():
    """The bundled model with the torch attention backend (chapter 01's decode-loop check runs it)."""
    from mini_vllm.attention import TorchAttentionBackend
    from mini_vllm.model import default_model_path, load_model

    return load_model(default_model_path(), attn_backend=TorchAttentionBackend())


# -- tiers ----------------------------------------------------------------------------
# Each folder of tests/ is a layer, and its name is a marker (registered in pyproject.toml):
# `pytest -m engine`, `-m "not vs_vllm"`. make test-fast runs the folders below FAST_FOLDERS
# without the tests marked slow, real_model or vllm (what needs make real-model or make vllm).
TESTS = Path(__file__).resolve().parent
FOLDERS = ("engine", "kernels", "course", "notebooks", "server", "vs_vllm", "browser", "project")


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            folder = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/ (a notebook under nbval)
            continue
        if folder in FOLDERS:
            item.add_marker(folder)
