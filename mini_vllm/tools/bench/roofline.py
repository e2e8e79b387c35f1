"""Benchmark 6, the roofline: one request's decode step against reading every weight once.

vLLM has no counterpart in its repository (its docs discuss the memory-bound decode).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from ...llm import LLM
from ...sampling_params import SamplingParams
from .engines import EngineFactory, _llm, _warm_up
from .settings import Progress, no_progress
from .workloads import _random_prompt


def measure_memory_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 7) -> dict[str, float]:
    """This machine's memory bandwidth as torch sees it, on torch's current number of threads.

    Two measurements on buffers far larger than any CPU cache: ``copy_``
    (reads and writes every byte: counted twice) and ``sum`` (reads only). The
    best of ``repeats`` runs is kept (other processes only ever slow it down).
    """
    source = torch.ones(num_bytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)

    def best(function) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            function()
            times.append(time.perf_counter() - start)
        return min(times)

    copy_gbs = 2 * num_bytes / best(lambda: target.copy_(source)) / 1e9
    read_gbs = num_bytes / best(lambda: source.sum()) / 1e9
    return {"copy_gbs": copy_gbs, "read_gbs": read_gbs, "bandwidth_gbs": max(copy_gbs, read_gbs)}


def weight_bytes(llm: LLM) -> int:
    """Bytes of every weight a decode step reads: each parameter once (a tied embedding counts once)."""
    model = llm.llm_engine.model_runner.model
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():  # parameters() already skips a tied duplicate
        if parameter.data_ptr() not in seen:
            seen.add(parameter.data_ptr())
            total += parameter.numel() * parameter.element_size()
    return total


def bench_roofline(args, progress: Progress = no_progress, llm: LLM | None = None, engine: EngineFactory = LLM) -> dict:
    """One request's decode step (median over its steps and rounds) against the memory floor.

    A decode step of one sequence must read every weight at least once (the
    output projection included: it multiplies the whole embedding matrix), so
    ``weights_read_floor_ms = weight_bytes / bandwidth`` bounds it from below.
    The step time is ``(finished - first token) / (tokens - 1)`` of a request
    of 300 random prompt tokens generating ``decode_tokens`` tokens. The bandwidth
    is measured in every round, right after its request, and ``decode_vs_floor`` is
    the median of the rounds' own ratios: a host whose speed drifts during the run
    moves both sides of a round's ratio together.
    """
    llm = llm or _llm(args, engine)
    _warm_up(llm)
    vocab_size = llm.llm_engine.model_config.vocab_size
    num_bytes = weight_bytes(llm)
    rng = random.Random(2)
    num_tokens = 32
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    steps, bandwidths, ratios = [], [], []
    for _ in progress(range(max(2, args.roofline_rounds)), "roofline"):
        output = llm.generate([{"prompt_token_ids": _random_prompt(rng, vocab_size, 300)}], params)[0]
        metrics = output.metrics
        steps.append((metrics.finished_time - metrics.first_token_time) / (num_tokens - 1))
        bandwidths.append(measure_memory_bandwidth(args.bandwidth_bytes, repeats=3))
        ratios.append(steps[-1] / (num_bytes / (bandwidths[-1]["bandwidth_gbs"] * 1e9)))
    bandwidth = {key: statistics.median(b[key] for b in bandwidths) for key in bandwidths[0]}
    return {
        "decode_step_ms": 1000 * statistics.median(steps),
        "decode_step_ms_range": [1000 * min(steps), 1000 * max(steps)],
        "weights_read_floor_ms": 1000 * num_bytes / (bandwidth["bandwidth_gbs"] * 1e9),
        "decode_vs_floor": statistics.median(ratios),
        "decode_vs_floor_range": [min(ratios), max(ratios)],
        "weight_bytes": num_bytes,
        "memory_bandwidth_gbs": bandwidth["bandwidth_gbs"],
        "copy_bandwidth_gbs": bandwidth["copy_gbs"],
        "read_bandwidth_gbs": bandwidth["read_gbs"],
        "rounds": len(steps),
        "threads": torch.get_num_threads(),
        "batch_size": 1,
    }
