"""The ``mini_vllm.kernels`` package as a whole: imports without Triton, and no name clash.

Each check runs in a fresh interpreter: hiding Triton or importing
``transformers`` must not leak into the other tests.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from prerequisites import distribution_installed


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


def test_transformers_sees_the_hub_package_only_when_it_is_installed():
    # transformers integrates with Hugging Face's kernel hub package, imported as `kernels`
    # (5.25 and newer depend on it). It looks the name up on sys.path and checks the
    # distribution's version: it must never take ours for theirs.
    result = run_python(
        """
        import sys
        from transformers.utils.import_utils import is_kernels_available
        from mini_vllm import kernels as ours
        print("available:", is_kernels_available())
        if "kernels" in sys.modules:
            print("imported:", sys.modules["kernels"].__file__)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Installed, transformers may still turn it down for its version (5.23 wants another range than 5.25).
    if not distribution_installed("kernels"):
        assert result.stdout.splitlines()[0] == "available: False", result.stdout
    assert "mini_vllm" not in result.stdout.partition("imported:")[2], result.stdout


def test_our_package_defines_no_version():
    # transformers falls back to `kernels.__version__` when it finds no distribution metadata
    # for the name `kernels`; ours is never that name, and keeps no __version__ all the same.
    result = run_python(
        """
        from mini_vllm import kernels
        print(hasattr(kernels, "__version__"))
        """
    )
    assert result.stdout.strip() == "False", result.stdout + result.stderr[-3000:]


def test_the_kernels_folder_is_no_top_level_package():
    """kernels/ has no __init__.py: with the repository root first on sys.path, `import kernels`
    must not find the course's folder as a regular package (it would shadow Hugging Face's)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert not (root / "kernels" / "__init__.py").exists()
    result = subprocess.run(
        [sys.executable, "-c", "import kernels; print(getattr(kernels, '__file__', None))"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    # Either Hugging Face's package (a file in site-packages) or, without it, a namespace (no file).
    assert result.stdout.strip() == "None" or "site-packages" in result.stdout, result.stdout + result.stderr


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
def test_triton_imported_before_the_kernels_leaves_them_working():
    """A program may import Triton before mini_vllm.kernels chooses the interpreter (``import triton``,
    or ``torch._dynamo``, which PyTorch loads for ``torch.compile`` and for a model built on the meta
    device); a Triton engine must still run (it failed with "Cannot call @triton.jit'd outside of the
    scope of a kernel")."""
    result = run_python(
        """
        import os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        import triton.language  # before mini_vllm.kernels could choose: compiled-only helpers
        assert "mini_vllm.kernels" not in sys.modules
        from mini_vllm import LLM, SamplingParams
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        tokens = {}
        for backend in ("torch", "triton"):
            llm = LLM(device="cpu", attention_backend=backend)
            out = llm.generate(["A paged cache"], params)[0].outputs[0]
            tokens[backend] = (out.token_ids, out.finish_reason)
        assert tokens["torch"] == tokens["triton"], tokens
        print("OK")
        """
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr[-3000:]


def test_triton_loads_only_when_a_kernel_is_read():
    """The references and the torch backend never import Triton (seconds); the interpreter is chosen all
    the same, before anything imports it; a kernel module imported by its own name leaves the package's
    name the kernel (the course's parts import ``mini_vllm.kernels.store_kv``)."""
    result = run_python(
        """
        import importlib, os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        import torch
        import mini_vllm.kernels.reference
        from mini_vllm.attention import get_attn_backend
        assert get_attn_backend("torch").name == "torch"
        assert "triton" not in sys.modules, "the references or the torch backend imported Triton"

        from mini_vllm import kernels
        if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
            assert os.environ["TRITON_INTERPRET"] == "1"  # set before Triton is first imported
        available = kernels.TRITON_AVAILABLE
        assert ("triton" in sys.modules) == available
        if available:
            importlib.import_module("mini_vllm.kernels.store_kv")
            assert kernels.store_kv.__module__ == "mini_vllm.kernels.store_kv", kernels.store_kv
            from mini_vllm.kernels import paged_attention
            assert callable(paged_attention) and paged_attention is kernels.paged_attention
        print("OK")
        """
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr[-3000:]
