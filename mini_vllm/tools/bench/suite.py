"""The benchmarks by name: ``run_benchmarks(settings, ["shared_prefix", ...], engine=...)`` (``make bench``, chapter 10).

vLLM's counterpart: one ``benchmarks/benchmark_*.py`` script per benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...llm import LLM
from .block_manager import bench_block_manager
from .engines import EngineFactory
from .prefix_caching import bench_hybrid, bench_multi_turn, bench_no_sharing, bench_shared_prefix
from .roofline import bench_roofline
from .settings import BenchSettings, Progress, no_progress
from .vs_transformers import bench_vs_transformers

BENCHMARKS = ("shared_prefix", "no_sharing", "multi_turn", "vs_transformers", "block_manager")
"""What ``make bench`` runs on each model, in this order (then the roofline, vLLM and HTTP, per model)."""

# Every benchmark by name. All but block_manager (a KVCacheManager alone, no model) run
# engines built by ``engine``.
RUNNERS = {
    "shared_prefix": bench_shared_prefix,
    "no_sharing": bench_no_sharing,
    "multi_turn": bench_multi_turn,
    "vs_transformers": bench_vs_transformers,
    "roofline": bench_roofline,
    "hybrid": bench_hybrid,
}


def run_benchmarks(
    settings: BenchSettings,
    which: Sequence[str] = BENCHMARKS,
    progress: Progress = no_progress,
    engine: EngineFactory = LLM,
) -> dict:
    """Run the benchmarks named in ``which`` (``BENCHMARKS`` by default); returns their results by name.

    ``engine`` builds every engine they measure: ``LLM`` (the reference) by
    default, ``mini_vllm.course.learner_engine`` for the learner's parts
    (chapter 10 runs both, side by side). ``"hybrid"`` runs ``shared_prefix``
    on the hybrid model, where exercise 08b's part runs; ``"block_manager"``
    measures the reference ``KVCacheManager`` whatever ``engine`` is.

    Keys starting with ``_`` hold raw per-request data (for the plots); they
    are left out of the JSON file.
    """
    known = [*RUNNERS, "block_manager"]
    unknown = set(which) - set(known)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; choose from {known}")
    return {
        name: bench_block_manager(settings, progress)
        if name == "block_manager"
        else RUNNERS[name](settings, progress, engine=engine)
        for name in which
    }
