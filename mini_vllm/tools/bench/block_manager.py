"""Benchmark 5: the KV-cache manager's own cost, next to vLLM's ``KVCacheManager`` on the same workload.

The workload is ``mini_vllm/tools/vllm_side/block_manager_workload.py``; vLLM's
side runs it in ``benchmarks/block_manager_vllm.py`` (a subprocess per vLLM).
No model runs: only the manager, its pool and the requests' hashing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

from .. import paths
from .settings import Progress, no_progress

VLLM_BLOCK_MANAGER_SCRIPT = paths.BENCHMARKS_DIR / "block_manager_vllm.py"


def block_manager_round(num_requests: int, seed: int = 0) -> dict[str, float]:
    """One pass of the workload on a fresh ``KVCacheManager``; median microseconds per operation.

    The workload is ``mini_vllm/tools/vllm_side/block_manager_workload.py``, which
    ``benchmarks/block_manager_vllm.py`` runs on vLLM's manager: 4096 blocks of
    16 tokens, requests of 64 blocks whose first 48 are a shared prefix, 16
    decode steps each, at most 32 requests alive.
    """
    from ...kv_cache_manager import KVCacheManager
    from ...request import Request
    from ..vllm_side import block_manager_workload as workload

    manager = KVCacheManager(num_blocks=workload.NUM_BLOCKS, block_size=workload.BLOCK_SIZE)

    def new_request(request_id: str, token_ids: list[int]) -> Request:
        return Request(request_id, token_ids, block_size=workload.BLOCK_SIZE)

    return workload.run_workload(manager, new_request, num_requests, seed)


class VLLMBlockManagerRunner:
    """``benchmarks/block_manager_vllm.py --serve`` in a subprocess: one vLLM's manager, a round per call."""

    def __init__(self, python: str, pythonpath: str | None = None) -> None:
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        self.process = subprocess.Popen(
            [python, str(VLLM_BLOCK_MANAGER_SCRIPT), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        ready = self._next_json()
        if ready is None:
            self.close()
            raise RuntimeError(f"{python} could not import vllm (PYTHONPATH={pythonpath!r})")
        self.version = ready["vllm_version"]

    def _next_json(self) -> dict | None:
        """The next JSON line of the subprocess (vLLM may print other lines first); None at its end."""
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        return None

    def run_round(self, num_requests: int) -> dict[str, float]:
        self.process.stdin.write(f"{num_requests}\n")
        self.process.stdin.flush()
        answer = self._next_json()
        if answer is None:
            raise RuntimeError(f"vLLM {self.version}'s block-manager benchmark stopped")
        return answer["us"]

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def _vllm_block_manager_runners(args) -> list[VLLMBlockManagerRunner]:
    """vLLM's managers to measure next to ours: ``make vllm``'s, and each ``--vllm-pythonpath`` tree."""
    from ..compare_vllm import vllm_python

    if not getattr(args, "use_vllm", True):
        return []
    python = vllm_python()
    candidates = [(python, None)] if python else []
    # Other releases' Python files (benchmarks/get_vllm_source.sh), imported with make vllm's Python.
    sources = [str(src) for src in paths.vllm_source_trees()] if python else []
    candidates += [(python or sys.executable, path) for path in sources + list(getattr(args, "vllm_pythonpaths", ()))]
    runners = []
    for python_exe, pythonpath in candidates:
        try:
            runners.append(VLLMBlockManagerRunner(python_exe, pythonpath))
        except (RuntimeError, OSError, ValueError) as error:
            print(f"block manager: skipping a vLLM: {error}", file=sys.stderr)
    return runners


def _block_manager_summary(per_round: list[dict[str, float]]) -> dict[str, float]:
    """Median over rounds of each operation's per-round median, and the sums the table shows."""
    us = {name: statistics.median(r[name] for r in per_round) for name in per_round[0]}
    return {
        "admit_free_us": us["admit"] + us["free"],
        "decode_step_us": us["append"] + us["decode_alloc"],
        "build_request_us": us["build"],
        "lookup_allocate_us": us["admit"],
        "free_us": us["free"],
        "append_token_us": us["append"],
        "decode_allocate_us": us["decode_alloc"],
    }


def bench_block_manager(args, progress: Progress = no_progress) -> dict:
    """The KV-cache manager's own cost, next to vLLM's ``KVCacheManager`` on the same workload.

    Rounds interleave mini-vLLM with every vLLM found (each in its own
    subprocess, started once); ``ratio_vs_vllm[version][op]`` is ours / theirs
    (< 1: ours is faster). Without an installed vLLM there is nothing to
    compare with: the table says so (no figure measured elsewhere stands in).
    """
    runners = _vllm_block_manager_runners(args)
    ours: list[dict[str, float]] = []
    theirs: dict[str, list[dict[str, float]]] = {runner.version: [] for runner in runners}
    try:
        for round_index in progress(range(args.block_manager_rounds), "block manager"):
            ours.append(block_manager_round(args.block_manager_requests, seed=round_index))
            for runner in runners:
                theirs[runner.version].append(runner.run_round(args.block_manager_requests))
    finally:
        for runner in runners:
            runner.close()
    result: dict[str, Any] = _block_manager_summary(ours)
    result["rounds"] = len(ours)
    result["vllm"] = {version: _block_manager_summary(rounds) for version, rounds in theirs.items()}
    result["ratio_vs_vllm"] = {
        version: {key: result[key] / value for key, value in summary.items()}
        for version, summary in result["vllm"].items()
    }
    return result
