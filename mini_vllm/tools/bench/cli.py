"""Benchmarks: ``python -m mini_vllm bench [--quick] [--json PATH] [--model PATH] [--no-vllm]`` (chapter 10, README).

The command line: runs the benchmarks on the bundled model (or ``--model``), then per model the
roofline, real vLLM and the HTTP servers, writes ``benchmarks/results/bench.json``
and the plots, and prints the table. vLLM's counterpart: ``vllm bench``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ...llm import LLM
from .engines import _device_name, cpu_description, fastest_attention_backend, model_name
from .prefix_caching import bench_shared_prefix
from .report import _plots, format_table, public
from .roofline import bench_roofline
from .serving import bench_serving_http
from .settings import BenchSettings
from .suite import BENCHMARKS, run_benchmarks
from .vs_vllm import bench_vs_vllm

RESULTS_DIR = Path("benchmarks/results")


def _real_model_path() -> str | None:
    """SmolLM2's folder when ``make real-model`` has converted it, else None."""
    from ..real_model import real_model_path

    return real_model_path()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (about 2 minutes on 2 CPU cores)")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "bench.json")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face folder, e.g. models/SmolLM2-135M-Instruct (make real-model); "
        "default: the bundled model",
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip the comparisons with real vLLM (make vllm)")
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="mini-vLLM's attention backend (default: 'cpu', decode attention in C, on a CPU where it builds; "
        "else 'auto')",
    )
    parser.add_argument(
        "--no-real-model",
        action="store_true",
        help="skip the second model (SmolLM2-135M, when make real-model has installed it)",
    )
    parser.add_argument(
        "--vllm-pythonpath",
        action="append",
        default=[],
        metavar="PATHS",
        help="a vLLM source tree (plus its pure-Python dependencies, joined with ':') whose KVCacheManager "
        "the block-manager benchmark also measures, e.g. vLLM 0.33's; repeatable",
    )
    args = parser.parse_args(argv)
    if args.model is not None:
        # A real model: every prefill costs ~100x the bundled model's, so fewer requests.
        settings = BenchSettings.real_model(args.model, args.device, quick=args.quick)
    else:
        settings = BenchSettings.quick(args.device) if args.quick else BenchSettings.full(args.device)

    from tqdm.auto import tqdm

    def progress(iterable: Iterable, desc: str) -> Iterable:
        return tqdm(iterable, desc=desc, leave=False)

    results: dict[str, Any] = {"versions": {"torch": torch.__version__, "python": platform.python_version()}}
    import transformers

    results["versions"]["transformers"] = transformers.__version__
    settings.vllm_pythonpaths = tuple(args.vllm_pythonpath)
    settings.use_vllm = not args.no_vllm
    settings.attention_backend = args.attention_backend or fastest_attention_backend(args.device)
    results["attention_backend"] = settings.attention_backend
    results.update(run_benchmarks(settings, BENCHMARKS, progress))
    # Per model: the decode step against the memory floor, and real vLLM side by side.
    # --quick leaves out vLLM (it starts in about a minute per round) and the second model.
    models = [(model_name(args.model), settings)]
    second = None if (args.model or args.quick or args.no_real_model) else _real_model_path()
    if second:
        second_settings = BenchSettings.real_model(second, args.device, quick=args.quick)
        second_settings.attention_backend = settings.attention_backend
        models.append((model_name(second), second_settings))
        results["models"] = {model_name(second): {"shared_prefix": bench_shared_prefix(second_settings, progress)}}
    results["roofline"] = {name: bench_roofline(model_settings, progress) for name, model_settings in models}
    results["vs_vllm"] = {}
    if not (args.quick or args.no_vllm):
        results["vs_vllm"] = {name: bench_vs_vllm(model_settings, progress) for name, model_settings in models}
    # Over HTTP: both OpenAI servers, one after the other, the same concurrent clients (--quick: none).
    results["serving"] = {}
    if not args.quick:
        results["serving"] = {name: bench_serving_http(model_settings) for name, model_settings in models}
    results["threads"] = torch.get_num_threads()
    results["device"] = _device_name(LLM(device=args.device, num_blocks=8))
    results["cpu"] = cpu_description()
    results["quick"] = args.quick
    results["model"] = model_name(args.model)
    results["date"] = time.strftime("%Y-%m-%d")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        results["plots"] = [str(p) for p in _plots(results, args.json.parent)]
    args.json.write_text(json.dumps(public(results), indent=2))
    print(format_table(results))
    print(f"\nwrote {args.json}")
    return 0
