"""The engine a benchmark runs, and where it runs: the factory, the attention backend, the device.

Every benchmark that runs an ``LLM`` builds it with ``engine``, a factory with
``LLM``'s signature (``engine(model, device=..., num_blocks=...,
attention_backend=..., **kwargs)``): ``LLM`` itself by default, or
``mini_vllm.course.learner_engine`` for the learner's parts (chapter 10). vLLM
has no counterpart: its benchmarks start ``vllm serve`` or ``LLM``.
"""

from __future__ import annotations

import os
import platform
import random
from collections.abc import Callable
from pathlib import Path

import torch

from ...attention import get_attn_backend
from ...llm import LLM
from ...llm_engine import resolve_device
from ...model import default_model_path
from ...sampling_params import SamplingParams

EngineFactory = Callable[..., LLM]
"""Builds the engine a benchmark measures: ``LLM`` or anything called like it (``learner_engine``)."""


def _llm(args, engine: EngineFactory = LLM, **kwargs) -> LLM:
    """``engine`` built with the settings' model, device, pool and attention backend (and ``kwargs``)."""
    return engine(
        getattr(args, "model", None),
        device=args.device,
        num_blocks=getattr(args, "num_blocks", None),
        attention_backend=getattr(args, "attention_backend", "auto"),
        **kwargs,
    )


def fastest_attention_backend(device: str) -> str:
    """The attention backend ``make bench`` measures mini-vLLM with: ``"cpu"`` (decode attention
    and the element-wise operations in C, as vLLM's CPU backend runs its own C++ kernels) where
    its factory accepts the device and its C files build; otherwise ``"auto"`` (Triton on a GPU).
    The chapters run the readable ``"torch"`` backend."""
    try:
        get_attn_backend("cpu", str(resolve_device(device)))
    except ValueError:
        return "auto"
    return "cpu"


def model_name(model: str | None) -> str:
    """How results name a model: its folder's name (``default_model`` for the bundled one)."""
    return Path(model or default_model_path()).name


def _warm_up(llm: LLM, num_tokens: int = 256) -> None:
    """One throw-away request of realistic length before measuring.

    The first forward passes of a fresh engine pay one-time costs (allocations,
    lazy initialization) that must not be charged to the first measured
    request. The warm-up's tokens are random and never start with a chat
    header, so it shares no block with the prompts measured after it.
    """
    rng = random.Random(12345)
    vocab = llm.llm_engine.model_config.vocab_size
    tokens = [rng.randrange(3, vocab) for _ in range(num_tokens)]
    llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=2))


def _device_name(llm: LLM) -> str:
    device = llm.llm_engine.device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This CPU as the figures depend on it: its model name, core count and whether it has AVX-512."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    avx512 = "with AVX-512" if "avx512f" in flags else "without AVX-512"
    return f"{model or platform.machine()}, {os.cpu_count()} cores, {avx512}"
