"""Throughput and time to first token over HTTP: both OpenAI servers under the same concurrent clients.

The measuring is ``mini_vllm.tools.compare_servers.bench_serving``; this module
runs it on one benchmark model. vLLM's counterpart: ``benchmarks/benchmark_serving.py``.
"""

from __future__ import annotations

from pathlib import Path

from ...model import default_model_path
from .settings import BenchSettings
from .workloads import VS_VLLM_BLOCK_SIZE


def bench_serving_http(settings: BenchSettings) -> dict:
    """Throughput and time to first token over HTTP: ``compare_servers.bench_serving`` on this model.

    16 chats over 5 system prompts, 4 clients at a time, 32 streamed tokens each, one compute
    thread per server; vLLM's own OpenAI server beside mini-vLLM's when ``make vllm`` has installed it.
    """
    import tempfile

    from ..compare_servers import ServerSpec, bench_serving
    from ..compare_vllm import vllm_python

    with_vllm = settings.use_vllm and vllm_python() is not None
    spec = ServerSpec(
        str(settings.model or default_model_path()),
        block_size=VS_VLLM_BLOCK_SIZE,
        num_blocks=256,
        attention_backend=settings.attention_backend,
    )
    with tempfile.TemporaryDirectory() as log_dir:
        return bench_serving(spec, Path(log_dir), rounds=3, with_vllm=with_vllm)
