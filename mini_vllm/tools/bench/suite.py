"""The benchmarks by name: ``run_benchmarks(settings, ["shared_prefix", ...])`` (``make bench``, chapter 10).

vLLM's counterpart: one ``benchmarks/benchmark_*.py`` script per benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence

from .block_manager import bench_block_manager
from .prefix_caching import bench_multi_turn, bench_no_sharing, bench_shared_prefix
from .settings import BenchSettings, Progress, no_progress
from .vs_transformers import bench_vs_transformers

BENCHMARKS = ("shared_prefix", "no_sharing", "multi_turn", "vs_transformers", "block_manager")


def run_benchmarks(
    settings: BenchSettings, which: Sequence[str] = BENCHMARKS, progress: Progress = no_progress
) -> dict:
    """Run the benchmarks named in ``which`` (all by default); returns their results by name.

    Keys starting with ``_`` hold raw per-request data (for the plots); they
    are left out of the JSON file.
    """
    functions = {
        "shared_prefix": bench_shared_prefix,
        "no_sharing": bench_no_sharing,
        "multi_turn": bench_multi_turn,
        "vs_transformers": bench_vs_transformers,
        "block_manager": bench_block_manager,
    }
    unknown = set(which) - set(functions)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; choose from {list(functions)}")
    return {name: functions[name](settings, progress) for name in which}
