"""The committed results of real runs, for machines without vLLM (``benchmarks/reference_results/``).

``side_by_side_or_reference(key)`` is what the chapters call: a live run where
``make vllm`` has installed vLLM, else the committed file, with a note saying which.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

from .. import paths
from .harness import run_hybrid_side_by_side, run_matrix
from .vllm_runner import vllm_missing_reason, vllm_python

REFERENCE_DIR = paths.REFERENCE_RESULTS_DIR
# What each chapter compares: (model: "bundled" or "smollm2", block sizes, workloads or None = all).
# Appendix A also runs vLLM's probes (its cache classes driven directly).
REFERENCE_RUNS = {
    "appendix_a": ("bundled", (32, 128), None),
    "chapter_05": (
        "bundled",
        (32,),
        ("shared_system_prompt", "exact_block_multiple", "repeated_prompt", "n_greater_than_1"),
    ),
    "chapter_10": ("bundled", (32,), ("shared_system_prompt", "multi_turn_chat", "eviction_and_preemption")),
}
PROBES_WITH = "appendix_a"


def reference_path(key: str) -> Path:
    return REFERENCE_DIR / f"compare-vllm-{key}.json"


def _reference_model_path(model: str) -> str | None:
    if model == "bundled":
        return None
    from ..real_model import real_model_path

    path = real_model_path()
    if path is None:
        raise RuntimeError("SmolLM2-135M-Instruct is not converted: run `make real-model`")
    return path


HYBRID_REFERENCE_RUN = "chapter_08b"  # run_hybrid_side_by_side: the hybrid model, its own workloads
# Chapter 08b, section 8: a growing chat under each setting, on SmolLM2's first CHAT_NUM_LAYERS layers re-laid
# as Gemma 3 (5 sliding : 1 full; 6 layers give Gemma 3's six KV-cache groups, one layer each) in a roomy
# pool (run_relaid_side_by_side). tests/vs_vllm/test_vs_vllm_hybrid.py runs these engines among its own.
CHAT_REFERENCE_RUN = "chapter_08b_chat"
CHAT_NUM_LAYERS = 6
CHAT_SETTINGS = {  # the chapter's name for each setting: LLM(...) keywords, vLLM's names
    "retention 0 (default)": {},
    "retention None": {"prefix_cache_retention_interval": None},
    "retention 128": {"prefix_cache_retention_interval": 128},
    "hybrid manager off": {"disable_hybrid_kv_cache_manager": True},
}
CHAT_LAYOUTS = [("sssssf", 240, ["multi_turn_chat"], settings) for settings in CHAT_SETTINGS.values()]


def _run_chat_reference() -> dict:
    import tempfile

    from .harness import run_relaid_side_by_side

    with tempfile.TemporaryDirectory(prefix="relaid-") as folder:
        return run_relaid_side_by_side(
            _reference_model_path("smollm2"), CHAT_LAYOUTS, folder, num_layers=CHAT_NUM_LAYERS, at_once=True
        )


def _run_reference(key: str) -> dict:
    if key == HYBRID_REFERENCE_RUN:
        return run_hybrid_side_by_side()
    if key == CHAT_REFERENCE_RUN:
        return _run_chat_reference()
    model, block_sizes, workloads = REFERENCE_RUNS[key]
    return run_matrix(_reference_model_path(model), block_sizes, workloads, probes=key == PROBES_WITH)


def side_by_side_or_reference(key: str) -> tuple[dict, str]:
    """``REFERENCE_RUNS[key]`` (or one of chapter 08b's two runs) live when vLLM is installed, else the
    committed result.

    Returns ``(result, note)``; the note says which of the two it is (and why).
    """
    if key not in REFERENCE_RUNS and key not in (HYBRID_REFERENCE_RUN, CHAT_REFERENCE_RUN):
        keys = [*REFERENCE_RUNS, HYBRID_REFERENCE_RUN, CHAT_REFERENCE_RUN]
        raise ValueError(f"unknown reference run {key!r}; choose from {', '.join(keys)}")
    if vllm_python() is not None:
        result = _run_reference(key)
        return result, f"live run: vLLM {result['vllm_version']} from .venv-vllm/ vs this mini-vLLM"
    result = json.loads(reference_path(key).read_text())
    return result, (
        f"{vllm_missing_reason()}.\nShowing the committed results of a real run "
        f"(vLLM {result['vllm_version']}, {result.get('date', 'date unknown')}, {result.get('machine', '')})."
    )


def write_references(keys: Sequence[str] | None = None) -> list[Path]:
    """Run ``REFERENCE_RUNS`` for real and commit-ready save them (``compare-vllm --write-references``)."""
    import platform

    if vllm_python() is None:
        raise RuntimeError(vllm_missing_reason())
    written = []
    for key in keys or [*REFERENCE_RUNS, HYBRID_REFERENCE_RUN, CHAT_REFERENCE_RUN]:
        result = _run_reference(key)
        result["date"] = time.strftime("%Y-%m-%d")
        result["machine"] = f"{os.cpu_count()} {platform.machine()} cores, CPU only"
        path = reference_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        written.append(path)
    return written
