"""Benchmark 7: mini-vLLM and real vLLM (``make vllm``) on the same token ids, CPU and threads.

Each side's figures come from ``mini_vllm.tools.compare_vllm``'s runners (vLLM in
a subprocess of its own virtualenv); this module times them in rounds and
reports mini / vLLM ratios. vLLM's counterpart: ``benchmarks/benchmark_latency.py``
and ``benchmark_throughput.py``, one engine at a time.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ...llm import LLM
from ...model import default_model_path
from .engines import EngineFactory, _llm
from .settings import Progress, no_progress
from .workloads import TTFT_CALLS, VS_VLLM_BLOCK_SIZE, VS_VLLM_NUM_BLOCKS, _vs_vllm_workloads


# How vLLM runs in each column (compare_vllm.run_vllm's configuration; run_vllm.py says why).
VLLM_COMPARABLE = "eager, synchronous scheduling, engine core in the same process"
VLLM_DEFAULT = (
    "as it runs by default on a CPU: compiled (torch.compile), asynchronous scheduling, engine core in its own process"
)


def _fresh_matches_warm(requests: list[dict]) -> bool:
    """In one ``ttft`` workload's results: every fresh request computed as many tokens as the
    warm request before it, with no cache hit."""
    by_call = {r["call"]: r for r in requests}
    pairs = [(by_call[c - 1], by_call[c]) for c, kind in enumerate(TTFT_CALLS) if kind == "fresh"]
    return all(
        fresh["num_cached_tokens"] == 0
        and fresh["num_prompt_tokens"] == warm["num_prompt_tokens"] - warm["num_cached_tokens"]
        for warm, fresh in pairs
    )


def vs_vllm_figures(results: list[dict]) -> dict[str, float]:
    """One engine's figures from its ``ttft`` and ``throughput`` workload results: medians over workloads."""
    ttft: dict[str, list[float]] = {"cold": [], "warm": [], "fresh": []}
    throughput = []
    for workload in results:
        requests = [r for r in workload["requests"] if r["call"] > 0]  # call 0: the warm-up
        if workload["name"].startswith("ttft"):
            by_kind = {kind: [r["ttft_s"] for r in requests if TTFT_CALLS[r["call"]] == kind] for kind in ttft}
            for kind, values in by_kind.items():
                ttft[kind].append(statistics.median(values))
        else:
            generated = sum(len(ids) for r in requests for ids in r["token_ids"])
            throughput.append(generated / workload["elapsed_s"])
    warm, fresh = statistics.median(ttft["warm"]), statistics.median(ttft["fresh"])
    return {
        "ttft_cold_ms": 1000 * statistics.median(ttft["cold"]),
        "ttft_warm_ms": 1000 * warm,
        "ttft_fresh_ms": 1000 * fresh,
        "cache_overhead_ratio": warm / fresh,
        "throughput_tok_s": statistics.median(throughput),
    }


def bench_vs_vllm(args, progress: Progress = no_progress, engine: EngineFactory = LLM) -> dict:
    """mini-vLLM and real vLLM (``make vllm``): the same token ids, model, dtype (float32),
    block size, pool size and compute threads; TTFT cold, warm and fresh, and batch throughput.

    vLLM runs in its own process (``mini_vllm.tools.compare_vllm.run_vllm``), one per
    round, alternating with a fresh mini-vLLM engine (which goes first
    alternates); each side's figure is the median over its rounds.
    Ratios are mini / vLLM: below 1 means mini-vLLM is faster for TTFT,
    *slower* for throughput. The first call of each workload (a random prompt)
    only warms the engine up. ``mini_cache_overhead_ratio`` and
    ``vllm_cache_overhead_ratio`` are each engine's own cost of caching
    (warm / fresh TTFT, as in ``bench_shared_prefix``) on the same requests.
    """
    from ..compare_vllm import run_mini, run_vllm, vllm_missing_reason, vllm_python

    if vllm_python() is None:
        return {"skipped": vllm_missing_reason()}
    threads = args.vs_vllm_threads
    llm = _llm(args, engine)
    model_path = str(Path(args.model).expanduser().resolve()) if args.model else default_model_path()
    workloads = _vs_vllm_workloads(llm, args.vs_vllm_rounds, args.vs_vllm_max_tokens)
    ours, theirs, theirs_default = [], [], []
    sides = ["vllm", "mini"] + (["vllm_default"] if args.vs_vllm_default else [])
    for r in progress(range(args.vs_vllm_rounds), "vs vLLM"):
        # One round = each side once, on the same two workloads; the order rotates round by round.
        engines = [
            {
                "block_size": VS_VLLM_BLOCK_SIZE,
                "num_blocks": VS_VLLM_NUM_BLOCKS,
                "workloads": workloads[2 * r : 2 * r + 2],
            }
        ]
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
            if side == "mini":
                ours += run_mini(
                    model_path,
                    engines,
                    dtype="float32",
                    threads=threads,
                    attention_backend=args.attention_backend,
                    engine=engine,
                )[0]["workloads"]
            else:
                configuration = "default" if side == "vllm_default" else "comparable"
                ran = run_vllm(model_path, engines, dtype="float32", threads=threads, configuration=configuration)
                (theirs_default if side == "vllm_default" else theirs).extend(ran["engines"][0]["workloads"])
                vllm_version = ran["vllm_version"]

    def requests_of(results: list[dict]) -> list[dict]:
        return [r for w in results for r in w["requests"] if r["call"] > 0]

    ours_requests, their_requests = requests_of(ours), requests_of(theirs)
    result = {
        "vllm_version": vllm_version,
        "threads": threads,
        "vllm_configuration": VLLM_COMPARABLE,
        "mini_attention_backend": llm.llm_engine.model_runner.attn_backend.name,
        **_vs_vllm_ratios(ours, theirs, args.vs_vllm_rounds),
        "cached_tokens_equal": [r["num_cached_tokens"] for r in ours_requests]
        == [r["num_cached_tokens"] for r in their_requests],
        "outputs_equal": [r["token_ids"] for r in ours_requests] == [r["token_ids"] for r in their_requests],
        # Each fresh prompt computed exactly what the warm request before it did, and hit nothing.
        "fresh_matches_warm": all(_fresh_matches_warm(w["requests"]) for w in ours if w["name"].startswith("ttft")),
        "mini": vs_vllm_figures(ours),
        "vllm": vs_vllm_figures(theirs),
        "rounds": args.vs_vllm_rounds,
        "block_size": VS_VLLM_BLOCK_SIZE,
        "dtype": "float32",
    }
    if theirs_default:  # the same figures against vLLM as it runs by default
        result["vllm_default"] = {
            "vllm_configuration": VLLM_DEFAULT,
            **_vs_vllm_ratios(ours, theirs_default, args.vs_vllm_rounds),
            "vllm": vs_vllm_figures(theirs_default),
            "outputs_equal": [r["token_ids"] for r in ours_requests]
            == [r["token_ids"] for r in requests_of(theirs_default)],
        }
    return result


def _vs_vllm_ratios(ours: list[dict], theirs: list[dict], rounds: int) -> dict:
    """mini / vLLM per round (both sides ran seconds apart, under the same load): median and range.

    A round added two workloads to each side. Also each engine's own cost of caching
    (warm / fresh) per round.
    """
    per_round = [
        (vs_vllm_figures(ours[2 * r : 2 * r + 2]), vs_vllm_figures(theirs[2 * r : 2 * r + 2])) for r in range(rounds)
    ]
    ratios = {}
    for name, key in (("throughput", "throughput_tok_s"), ("ttft_cold", "ttft_cold_ms"), ("ttft_warm", "ttft_warm_ms")):
        values = [ours_round[key] / theirs_round[key] for ours_round, theirs_round in per_round]
        ratios[f"{name}_ratio"] = statistics.median(values)
        ratios[f"{name}_ratio_range"] = [min(values), max(values)]
    for side, index in (("mini", 0), ("vllm", 1)):
        values = [figures_pair[index]["cache_overhead_ratio"] for figures_pair in per_round]
        ratios[f"{side}_cache_overhead_ratio"] = statistics.median(values)
        ratios[f"{side}_cache_overhead_ratio_range"] = [min(values), max(values)]
    return ratios
