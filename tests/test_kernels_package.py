"""The ``mini_vllm.kernels`` package as a whole: imports without Triton, and no name clash.

Each check runs in a fresh interpreter: hiding Triton or importing
``transformers`` must not leak into the other tests.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=180)


def test_without_triton_kernels_import_and_explain_themselves():
    result = run_python(
        """
        import sys
        sys.modules["triton"] = None  # what an `import triton` sees on macOS: ImportError

        import pytest
        import torch

        from mini_vllm import kernels
        assert kernels.TRITON_AVAILABLE is False
        for kernel in (kernels.store_kv, kernels.paged_attention, kernels.unified_attention):
            with pytest.raises(RuntimeError, match="Triton is not installed.*torch attention backend"):
                kernel()

        # The references still work, and the engine falls back to them.
        cache = torch.zeros(1, 4, 1, 8)
        kernels.reference.store_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, cache.clone(), torch.tensor([2]))
        assert cache[0, 2].eq(1).all()

        from mini_vllm.attention import get_attn_backend
        assert get_attn_backend("auto", device="cpu").name == "torch"
        with pytest.raises(ValueError, match="needs Triton"):
            get_attn_backend("triton")
        from mini_vllm.attention.triton_backend import TritonAttentionBackend  # importable all the same
        print("OK")
        """
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr[-3000:]


def test_transformers_does_not_mistake_our_kernels_for_the_hub_package():
    # transformers integrates with an unrelated PyPI package also imported as
    # `kernels` (Hugging Face's kernel hub). It looks the name up on sys.path and
    # then checks its version; ours must not pass for it, or transformers would
    # try `from kernels import get_kernel` and fail.
    result = run_python(
        """
        import sys
        from transformers.utils.import_utils import is_kernels_available
        print("available:", is_kernels_available())
        print("imported ours:", "kernels" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "available: False" in result.stdout, result.stdout


def test_kernels_defines_no_version():
    # transformers falls back to `kernels.__version__` when it finds no
    # distribution metadata for the name `kernels` (e.g. a plain checkout on
    # PYTHONPATH); without one it reports the hub package as absent.
    result = run_python(
        """
        from mini_vllm import kernels
        print(hasattr(kernels, "__version__"))
        """
    )
    assert result.stdout.strip() == "False", result.stdout + result.stderr[-3000:]
