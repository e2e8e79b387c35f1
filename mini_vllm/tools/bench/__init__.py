"""Benchmarks: ``python -m mini_vllm bench [--quick] [--json PATH] [--model PATH] [--no-vllm]`` (chapter 10, README).

Every comparison runs side by side in this one process (real vLLM in
subprocesses) and is reported as a ratio; absolute times are printed with the
device they were measured on. Timed comparisons run in rounds that alternate
which side goes first; each ratio is computed within a round and reported as
the median over rounds with its range (``*_range``: min, max), because the
machines this runs on are often shared with other work.

1. shared_prefix   many requests share one long system prompt: TTFT warm (prefix cached),
                   cold (caching off) and fresh (a prompt as long as what warm computes)
2. no_sharing      random prompts: what hashing and bookkeeping cost when nothing hits
3. multi_turn      a conversation that grows turn by turn: a stable template vs one
                   that injects a timestamp at the top
4. vs_transformers the same model, prompts and device through transformers' generate
5. block_manager   the KV-cache manager's own cost per request and per decode step, next to
                   vLLM's ``KVCacheManager`` on the same workload (benchmarks/block_manager_vllm.py)
6. roofline        one request's decode step against reading every weight once
7. vs_vllm         real vLLM (``make vllm``) on the same token ids: TTFT cold / warm, throughput,
                   and each engine's own cost of caching (warm / fresh)
   hybrid          1 on the hybrid model (sliding-window and full layers, chapter 08b); by name only

``main`` runs 1-5 on the bundled model (or ``--model``), and 6-7 plus a small
shared-prefix run on SmolLM2-135M too when ``make real-model`` has installed it;
``--quick`` leaves out vLLM and the second model.

From Python (chapter 10 runs a tiny version live)::

    from mini_vllm.tools.bench import BenchSettings, run_benchmarks, format_table
    results = run_benchmarks(BenchSettings.tiny(), ["shared_prefix", "block_manager"])

    from mini_vllm.course import learner_engine    # the same, on the learner's parts
    yours = run_benchmarks(BenchSettings.tiny(), ["shared_prefix", "hybrid"], engine=learner_engine)

One module per job: ``settings`` (sizes), ``engines`` (the engine factory, the
device), ``workloads`` (the prompts), the runners ``prefix_caching`` (1-3),
``vs_transformers`` (4), ``block_manager`` (5), ``roofline`` (6), ``vs_vllm``
(7), ``serving`` (over HTTP), ``suite`` (by name), ``report`` (table, plots,
JSON) and ``cli`` (``python -m mini_vllm bench``). This package re-exports what
chapter 10, the tests and ``benchmarks/`` use.
"""

from __future__ import annotations

from .block_manager import (
    VLLM_BLOCK_MANAGER_SCRIPT,
    VLLMBlockManagerRunner,
    bench_block_manager,
    block_manager_round,
)
from .cli import RESULTS_DIR, main
from .engines import EngineFactory, _llm, cpu_description, fastest_attention_backend, model_name
from .prefix_caching import bench_hybrid, bench_multi_turn, bench_no_sharing, bench_shared_prefix, prefill_flops
from .report import (
    format_table,
    plot_hit_rate_per_turn,
    plot_roofline,
    plot_ttft,
    plot_vs_transformers,
    plot_vs_vllm,
    public,
    serving_rows,
)
from .roofline import bench_roofline, measure_memory_bandwidth, weight_bytes
from .serving import bench_serving_http
from .settings import BenchSettings, Progress, no_progress
from .suite import BENCHMARKS, RUNNERS, run_benchmarks
from .vs_transformers import bench_vs_transformers
from .vs_vllm import VLLM_COMPARABLE, VLLM_DEFAULT, _fresh_matches_warm, bench_vs_vllm, vs_vllm_figures
from .workloads import TTFT_CALLS, VS_VLLM_BLOCK_SIZE, VS_VLLM_NUM_BLOCKS, _vs_vllm_workloads

__all__ = [
    "BENCHMARKS",
    "RESULTS_DIR",
    "RUNNERS",
    "TTFT_CALLS",
    "VLLM_BLOCK_MANAGER_SCRIPT",
    "VLLM_COMPARABLE",
    "VLLM_DEFAULT",
    "VS_VLLM_BLOCK_SIZE",
    "VS_VLLM_NUM_BLOCKS",
    "BenchSettings",
    "EngineFactory",
    "Progress",
    "VLLMBlockManagerRunner",
    "_fresh_matches_warm",
    "_llm",
    "_vs_vllm_workloads",
    "bench_block_manager",
    "bench_hybrid",
    "bench_multi_turn",
    "bench_no_sharing",
    "bench_roofline",
    "bench_serving_http",
    "bench_shared_prefix",
    "bench_vs_transformers",
    "bench_vs_vllm",
    "block_manager_round",
    "cpu_description",
    "fastest_attention_backend",
    "format_table",
    "main",
    "measure_memory_bandwidth",
    "model_name",
    "no_progress",
    "plot_hit_rate_per_turn",
    "plot_roofline",
    "plot_ttft",
    "plot_vs_transformers",
    "plot_vs_vllm",
    "prefill_flops",
    "public",
    "run_benchmarks",
    "serving_rows",
    "vs_vllm_figures",
    "weight_bytes",
]
