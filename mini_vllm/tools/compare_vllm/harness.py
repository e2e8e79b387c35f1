"""The comparison harness: both engines on the same workloads, compared request by request.

``compare_workload`` only reads the two engines' results; ``run_matrix`` (every
workload at every block size), ``run_side_by_side`` (one block size) and
``run_hybrid_side_by_side`` (the hybrid model) and ``run_relaid_side_by_side``
(a model re-laid as hybrid layouts) build the engine specs and run both sides.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Sequence

from .mini_runner import run_mini
from .vllm_runner import run_vllm
from .workloads import (
    DEFAULT_NUM_BLOCKS,
    HYBRID_WORKLOAD_NAMES,
    build_hybrid_workloads,
    build_workloads,
    engine_max_model_len,
    your_prompts_workload,
)


def compare_workload(workload: dict, ours: dict, theirs: dict) -> dict:
    """One workload's rows and verdicts; ``ours`` / ``theirs`` are the engines' results for it."""
    rows = []  # one per request (a call with several prompts gives several)
    for mine, real in zip(ours["requests"], theirs["requests"]):
        n = workload["calls"][mine["call"]]["sampling"].get("n", 1)
        rows.append(
            {
                "call": mine["call"],
                "index": mine["index"],
                "n": n,
                "num_prompt_tokens": mine["num_prompt_tokens"],
                "mini_cached": mine["num_cached_tokens"],
                "vllm_cached": real["num_cached_tokens"],
                "cached_equal": mine["num_cached_tokens"] == real["num_cached_tokens"],
                "tokens_equal": mine["token_ids"] == real["token_ids"],
                "mini_ttft_s": mine["ttft_s"],
                "vllm_ttft_s": real["ttft_s"],
            }
        )

    def summary(result: dict) -> dict:
        ttfts = [r["ttft_s"] for r in result["requests"] if r["ttft_s"] is not None]
        elapsed = result["elapsed_s"]
        return {
            "prefix_cache_queries": result["prefix_cache_queries"],
            "prefix_cache_hits": result["prefix_cache_hits"],
            "num_preemptions": result["num_preemptions"],
            "ttft_mean_ms": 1000 * statistics.fmean(ttfts) if ttfts else None,
            "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else None,
            "throughput_tok_s": result["num_generated_tokens"] / elapsed if elapsed > 0 else None,
        }

    mini, real = summary(ours), summary(theirs)
    return {
        "name": workload["name"],
        "description": workload.get("description", ""),
        "rows": rows,
        "mini": mini,
        "vllm": real,
        "same_num_requests": len(ours["requests"]) == len(theirs["requests"]),
        "counters_equal": (mini["prefix_cache_queries"], mini["prefix_cache_hits"])
        == (real["prefix_cache_queries"], real["prefix_cache_hits"]),
        "cached_equal": all(r["cached_equal"] for r in rows if r["n"] == 1),
        "tokens_equal": all(r["tokens_equal"] for r in rows),
    }


def run_both(
    path: str,
    engines: list[dict],
    dtype: str = "float32",
    threads: int = 1,
    probes: bool = False,
    at_once: bool = False,
) -> tuple[dict, dict]:
    """Every engine spec through vLLM, then through mini-vLLM, and each workload compared.

    ``at_once``: mini-vLLM runs here while vLLM's subprocess runs (on two cores, the time of
    the longer side instead of the sum). The hits and tokens are the same either way; the
    timings are not comparable then (the two engines share the machine).

    Returns ``({"model", "dtype", "vllm_version", "threads", "runs": [{"block_size",
    "num_blocks", "workloads": [compare_workload(...)]}]}, vLLM's whole answer)``.
    """
    if at_once:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1) as vllm_side:  # the thread only waits for the subprocess
            pending = vllm_side.submit(run_vllm, path, engines, dtype=dtype, threads=threads, probes=probes)
            ours = run_mini(path, engines, dtype=dtype, threads=threads)
            theirs = pending.result()
    else:
        theirs = run_vllm(path, engines, dtype=dtype, threads=threads, probes=probes)
        ours = run_mini(path, engines, dtype=dtype, threads=threads)
    runs = []
    for spec, mine, real in zip(engines, ours, theirs["engines"]):
        compared = [
            compare_workload(w, m, r) for w, m, r in zip(spec["workloads"], mine["workloads"], real["workloads"])
        ]
        runs.append({"block_size": spec["block_size"], "num_blocks": spec["num_blocks"], "workloads": compared})
    result = {"model": Path(path).name, "dtype": dtype, "vllm_version": theirs["vllm_version"], "threads": threads}
    return dict(result, runs=runs), theirs


def run_matrix(
    model_path: str | None,
    block_sizes: Sequence[int] = (32, 128),
    workloads: Sequence[str] | None = None,
    dtype: str = "float32",
    num_blocks: int | None = None,
    threads: int = 1,
    probes: bool = False,
    prompts: Sequence[str] | None = None,
) -> dict:
    """Every workload at every block size, through both engines; vLLM starts once (one subprocess).

    ``prompts``: texts of your own, run as one more workload (``your_prompts_workload``);
    with ``prompts`` and no ``workloads``, only that one runs.

    Returns ``{"model", "vllm_version", "threads", "runs": [{"block_size", "num_blocks",
    "workloads": [compare_workload(...)]}]}``.
    """
    from transformers import AutoTokenizer

    from ...model import default_model_path

    path = str(Path(os.path.expanduser(model_path)).resolve()) if model_path else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engines = [
        {
            "block_size": block_size,
            "num_blocks": num_blocks or DEFAULT_NUM_BLOCKS,
            "workloads": (build_workloads(tokenizer, block_size, workloads) if workloads or not prompts else [])
            + (
                [
                    your_prompts_workload(
                        tokenizer,
                        prompts,
                        max_model_len=engine_max_model_len(block_size, num_blocks or DEFAULT_NUM_BLOCKS),
                    )
                ]
                if prompts
                else []
            ),
        }
        for block_size in block_sizes
    ]
    result, theirs = run_both(path, engines, dtype=dtype, threads=threads, probes=probes)
    result["vllm_probes"] = theirs.get("probes")
    return result


def run_side_by_side(
    workload: str | Sequence[str] | None,
    model_path: str | None,
    block_size: int,
    dtype: str = "float32",
    num_blocks: int | None = None,
    threads: int = 1,
) -> dict:
    """One block size: ``workload`` is a name, a list of names, or None for all of them.

    Returns ``run_matrix``'s dict with one run.
    """
    names = [workload] if isinstance(workload, str) else workload
    return run_matrix(model_path, (block_size,), names, dtype=dtype, num_blocks=num_blocks, threads=threads)


def run_hybrid_side_by_side(
    model_path: str | None = None, block_size: int = 32, pools: Sequence[int] = (64, 40), threads: int = 1
) -> dict:
    """The hybrid model through mini-vLLM and real vLLM, side by side (``run_matrix``'s dict).

    One run per pool size in ``pools``: the first runs every hybrid workload
    but the eviction one, the others only the eviction one (a pool small
    enough that requests are preempted and cached blocks evicted). vLLM runs
    the model with ``model_impl="transformers"``: its native Qwen3 does not
    implement per-layer windows (it refuses this config at start-up, and with
    ``max_window_layers`` equal to the layer count runs every layer with full
    attention); its Transformers backend honours ``layer_types`` and builds the
    same two KV-cache groups. ``max_model_len``
    is 512 so that vLLM's start-up check (a request of that length must fit,
    every group's blocks counted) passes with these pools.
    """
    from transformers import AutoTokenizer

    from ...model import hybrid_model_path

    path = model_path or hybrid_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    everything = [name for name in HYBRID_WORKLOAD_NAMES if name != "eviction_and_preemption"]
    engines = [
        {
            "block_size": block_size,
            "num_blocks": num_blocks,
            "max_model_len": 512,
            "model_impl": "transformers",
            "workloads": build_hybrid_workloads(
                tokenizer, block_size, everything if index == 0 else ["eviction_and_preemption"]
            ),
        }
        for index, num_blocks in enumerate(pools)
    ]
    result, theirs = run_both(path, engines, threads=threads)
    result["vllm_kv_cache"] = theirs["engines"][0].get("kv_cache")
    return result


def relay_model(model_path: str, pattern: str, sliding_window: int, folder: str, num_layers: int | None = None) -> str:
    """``model_path`` re-laid by its ``config.json``: layer ``i`` slides when ``pattern[i % len(pattern)]``
    is "s" (else full attention), with window ``sliding_window``. ``num_layers``: keep only the first
    ``num_layers`` layers (their real weights, the embeddings and the final norm, written to a new
    ``model.safetensors``); None keeps them all, and the weights are the same files (linked).
    Returns the new model folder, made in ``folder``."""
    source = Path(model_path)
    config = json.loads((source / "config.json").read_text())
    num_layers = config["num_hidden_layers"] if num_layers is None else num_layers
    if not 0 < num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be 1..{config['num_hidden_layers']}, got {num_layers}")
    truncated = num_layers < config["num_hidden_layers"]
    target = Path(folder) / (f"{source.name}-{pattern}" + (f"-{num_layers}-layers" if truncated else ""))
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.name != "config.json" and not (truncated and path.suffix == ".safetensors"):
            (target / path.name).symlink_to(path.resolve())
    if truncated:
        _write_first_layers(source, target, num_layers)
    config["num_hidden_layers"] = num_layers
    config["layer_types"] = [
        "sliding_attention" if pattern[i % len(pattern)] == "s" else "full_attention" for i in range(num_layers)
    ]
    config["sliding_window"] = sliding_window
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def _write_first_layers(source: Path, target: Path, num_layers: int) -> None:
    """Every tensor of ``source``'s ``model.safetensors`` but those of layers ``num_layers`` and up, to ``target``'s."""
    import re

    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    with safe_open(str(source / "model.safetensors"), "pt") as weights:
        for name in weights.keys():
            layer = re.search(r"\.layers\.(\d+)\.", name)
            if layer is None or int(layer.group(1)) < num_layers:
                tensors[name] = weights.get_tensor(name)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})


def run_relaid_side_by_side(
    model_path: str,
    layouts: Sequence[tuple[str, int, Sequence[str], dict]],
    folder: str,
    block_size: int = 32,
    sliding_window: int = 64,
    threads: int = 1,
    num_layers: int | None = None,
    at_once: bool = False,
) -> dict:
    """``model_path`` re-laid in several layouts, through both engines; vLLM starts once (one subprocess).

    ``layouts``: ``(pattern, num_blocks, workload names, settings)`` per engine (``relay_model``'s
    pattern; ``build_hybrid_workloads``' names; settings such as
    ``prefix_cache_retention_interval``, under vLLM's names, for both engines). ``max_model_len`` is 512.
    ``num_layers``: only the model's first layers (``relay_model``); ``at_once``: ``run_both``'s.
    Returns ``run_matrix``'s dict, each run with its ``"pattern"`` and ``"settings"``, and ``"num_layers"``.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    patterns = dict.fromkeys(pattern for pattern, *_ in layouts)  # each layout once, in order
    models = {pattern: relay_model(model_path, pattern, sliding_window, folder, num_layers) for pattern in patterns}
    engines = [
        {
            "model": models[pattern],
            "block_size": block_size,
            "num_blocks": num_blocks,
            "max_model_len": 512,
            "workloads": build_hybrid_workloads(tokenizer, block_size, names),
            **settings,
        }
        for pattern, num_blocks, names, settings in layouts
    ]
    result, theirs = run_both(model_path, engines, threads=threads, at_once=at_once)
    for run, (pattern, _, _, settings), engine in zip(result["runs"], layouts, theirs["engines"]):
        run.update(pattern=pattern, settings=settings, vllm_kv_cache=engine.get("kv_cache"))
    first = Path(models[next(iter(patterns))]) / "config.json"
    result["num_layers"] = json.loads(first.read_text())["num_hidden_layers"]
    return result
