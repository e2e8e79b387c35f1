"""Where things live in a checkout of the repository: one place for every path the tools and the course use.

The engine itself needs none of these (its bundled models sit inside the
package, ``mini_vllm/default_model`` and ``mini_vllm/hybrid_model``); the
benchmarks, the vLLM comparisons, the real-model converter and the course's
authoring tools do. Everything is relative to the checkout, so a copy of the
repository anywhere works the same.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # mini_vllm/tools/paths.py -> the checkout

PACKAGE_DIR = REPO_ROOT / "mini_vllm"
KERNELS_DIR = REPO_ROOT / "kernels"  # the Triton kernels and their PyTorch references
MODELS_DIR = REPO_ROOT / "models"  # real pretrained models (make real-model)
BENCHMARKS_DIR = REPO_ROOT / "benchmarks"
REFERENCE_RESULTS_DIR = BENCHMARKS_DIR / "reference_results"  # committed results of real runs
VLLM_VENV = REPO_ROOT / ".venv-vllm"  # real vLLM, in its own virtualenv (make vllm)
VLLM_SIDE_DIR = PACKAGE_DIR / "tools" / "vllm_side"  # scripts that run inside vLLM's virtualenv


def vllm_source_trees() -> list[Path]:
    """vLLM releases' Python files unpacked next to the checkout (``.vllm-0.33.0/src``, by ``make bench``)."""
    return sorted(REPO_ROOT.glob(".vllm-*/src"))


def is_checkout() -> bool:
    """True when the package runs from a checkout of the repository (not from an installed wheel)."""
    return (REPO_ROOT / "pyproject.toml").exists() and (REPO_ROOT / "solutions").is_dir()
