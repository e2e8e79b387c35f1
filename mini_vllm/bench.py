"""Benchmarks: ``python -m mini_vllm bench [--quick] [--json PATH]`` (chapter 10, README).

Every comparison runs side by side in this one process and is reported as a
ratio; absolute times are printed with the device they were measured on.

1. shared_prefix   many requests share one long system prompt: caching on vs off
2. no_sharing      random prompts: what hashing and bookkeeping cost when nothing hits
3. multi_turn      a conversation that grows turn by turn: a stable template vs one
                   that injects a timestamp at the top
4. vs_transformers the same model, prompts and device through transformers' generate
5. block_manager   the KV-cache manager's own cost per request and per decode step

From Python (chapter 10 runs a tiny version live)::

    from mini_vllm.bench import BenchSettings, run_benchmarks, format_table
    results = run_benchmarks(BenchSettings.tiny(), ["shared_prefix", "block_manager"])
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from .llm import LLM
from .model import default_model_path
from .sampling_params import SamplingParams

RESULTS_DIR = Path("benchmarks/results")
BENCHMARKS = ("shared_prefix", "no_sharing", "multi_turn", "vs_transformers", "block_manager")


@dataclass
class BenchSettings:
    """The size of every benchmark. ``full()`` is ``make bench``; ``quick()`` is ``--quick``;
    ``tiny()`` is what chapter 10 runs live (well under a minute on a laptop CPU)."""

    device: str = "auto"
    num_requests: int = 24
    max_tokens: int = 16
    num_turns: int = 8
    hf_batch_size: int = 8
    block_manager_requests: int = 400
    no_sharing_prompt_len: tuple[int, int] = (200, 400)
    no_sharing_rounds: int = 5  # pairs of on/off runs, alternating which goes first; the best of each is kept
    num_blocks: Optional[int] = None  # None: sized from the memory budget

    @classmethod
    def full(cls, device: str = "auto") -> "BenchSettings":
        return cls(device=device)

    @classmethod
    def quick(cls, device: str = "auto") -> "BenchSettings":
        return cls(device=device, num_requests=8, max_tokens=8, num_turns=4, block_manager_requests=100)

    @classmethod
    def tiny(cls, device: str = "auto") -> "BenchSettings":
        return cls(
            device=device,
            num_requests=4,
            max_tokens=4,
            num_turns=3,
            hf_batch_size=4,
            block_manager_requests=40,
            no_sharing_prompt_len=(100, 150),
            num_blocks=256,
        )


Progress = Callable[[Iterable, str], Iterable]


def no_progress(iterable: Iterable, desc: str) -> Iterable:
    return iterable


def _llm(args, **kwargs) -> LLM:
    return LLM(device=args.device, num_blocks=getattr(args, "num_blocks", None), **kwargs)


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


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _prompt_data() -> dict:
    return json.loads((Path(default_model_path()) / "prompts.json").read_text())


def _chat_ids(llm: LLM, system: Optional[str], user: str) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return llm.apply_chat_template(messages)


def _device_name(llm: LLM) -> str:
    device = llm.llm_engine.device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# -- 1. shared prefix ------------------------------------------------------------
def bench_shared_prefix(args, progress: Progress = no_progress) -> dict:
    data = _prompt_data()
    system = data["system_prompts"][0]
    users = [data["user_requests"][i % len(data["user_requests"])] for i in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    result: dict = {}
    for caching in (True, False):
        llm = _llm(args, enable_prefix_caching=caching)
        prompts = [{"prompt_token_ids": _chat_ids(llm, system, u)} for u in users]
        _warm_up(llm)
        # Requests arrive one after another, so TTFT is each prompt's own prefill.
        start = time.perf_counter()
        outputs = [llm.generate([p], params)[0] for p in progress(prompts, f"shared prefix, caching {'on' if caching else 'off'}")]
        total = time.perf_counter() - start
        label = "on" if caching else "off"
        ttfts = [o.metrics.time_to_first_token for o in outputs]
        result[label] = {
            "ttft_p50": statistics.median(ttfts),
            "ttft_p90": _percentile(ttfts, 0.9),
            "ttfts": ttfts,
            "total_s": total,
            "prefill_tokens": sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outputs),
            # From the outputs, not the engine's counters: those include the warm-up request.
            "hit_rate": sum(o.num_cached_tokens for o in outputs) / sum(len(o.prompt_token_ids) for o in outputs),
            "outputs": [o.outputs[0].token_ids for o in outputs],
        }
    on, off = result["on"], result["off"]
    return {
        "ttft_speedup": off["ttft_p50"] / on["ttft_p50"],
        # If prefill time were proportional to tokens computed, TTFT would shrink by this much.
        "ideal_speedup": off["prefill_tokens"] / on["prefill_tokens"],
        "hit_rate": on["hit_rate"],
        "prefill_tokens_on": on["prefill_tokens"],
        "prefill_tokens_off": off["prefill_tokens"],
        "ttft_p50_on_ms": 1000 * on["ttft_p50"],
        "ttft_p50_off_ms": 1000 * off["ttft_p50"],
        "ttft_p90_on_ms": 1000 * on["ttft_p90"],
        "ttft_p90_off_ms": 1000 * off["ttft_p90"],
        "total_on_s": on["total_s"],
        "total_off_s": off["total_s"],
        "outputs_equal_on_off": on["outputs"] == off["outputs"],
        "_ttfts_on": on["ttfts"],
        "_ttfts_off": off["ttfts"],
    }


# -- 2. no sharing ------------------------------------------------------------------
def bench_no_sharing(args, progress: Progress = no_progress) -> dict:
    """The same random prompts (no shared prefix) through an engine with caching on and off.

    Both engines are built and warmed up once; the timed runs alternate, and the
    prefix cache is reset before each run so repeated rounds cannot hit.
    """
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {caching: _llm(args, enable_prefix_caching=caching) for caching in (True, False)}
    vocab = engines[True].llm_engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(*args.no_sharing_prompt_len))]}
        for _ in range(args.num_requests)
    ]
    for llm in engines.values():
        _warm_up(llm)
    times: dict[bool, list[float]] = {True: [], False: []}
    orders = [(True, False), (False, True)] * args.no_sharing_rounds  # alternate which goes first
    for order in progress(orders, "no sharing"):
        for caching in order:
            llm = engines[caching]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(prompts, params)
            times[caching].append(time.perf_counter() - start)
    return {"throughput_ratio_on_off": min(times[False]) / min(times[True]), "time_on_s": min(times[True]), "time_off_s": min(times[False])}


# -- 3. multi-turn -------------------------------------------------------------------
def bench_multi_turn(args, progress: Progress = no_progress) -> dict:
    data = _prompt_data()
    system = data["system_prompts"][1]
    users = data["user_requests"][: args.num_turns]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    per_turn = {}
    for variant in ("stable", "timestamped"):
        llm = _llm(args)
        history: list[dict] = []
        rates = []
        for turn, user in enumerate(progress(users, f"multi-turn, {variant}")):
            system_text = system if variant == "stable" else f"Current time: 2026-11-30 09:{turn:02d}:{(7 * turn) % 60:02d}\n{system}"
            messages = [{"role": "system", "content": system_text}] + history + [{"role": "user", "content": user}]
            output = llm.chat(messages, params)[0]
            rates.append(output.num_cached_tokens / len(output.prompt_token_ids))
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": output.outputs[0].text}]
        per_turn[variant] = rates
    return {
        "hit_rate_stable": statistics.mean(per_turn["stable"][1:]),
        "hit_rate_timestamped": statistics.mean(per_turn["timestamped"][1:]),
        "_per_turn": per_turn,
    }


# -- 4. vs transformers ------------------------------------------------------------------
def bench_vs_transformers(args, progress: Progress = no_progress) -> dict:
    from transformers import AutoModelForCausalLM

    data = _prompt_data()
    system = data["system_prompts"][0]
    users = [data["user_requests"][i % len(data["user_requests"])] for i in range(args.num_requests)]
    llm = _llm(args)
    device = llm.llm_engine.device
    prompts = [_chat_ids(llm, system, u) for u in users]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=llm.llm_engine.dtype).to(device).eval()
    pad_id = llm.get_tokenizer().pad_token_id or 0

    def run_hf(batch_size: int) -> tuple[float, list[list[int]]]:
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            with torch.inference_mode():
                generated = hf.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                    do_sample=False, pad_token_id=pad_id,
                )
            outputs += generated[:, width:].tolist()
        return time.perf_counter() - start, outputs

    run_hf(len(prompts[:2]))  # warm-up
    _warm_up(llm)
    results = {}
    for _ in progress(range(1), "vs transformers"):
        hf_time, hf_outputs = run_hf(args.hf_batch_size)
        start = time.perf_counter()
        ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        our_time = time.perf_counter() - start
        ours_tokens = [o.outputs[0].token_ids for o in ours]
        results = {
            "throughput_ratio": hf_time / our_time,
            "time_ours_s": our_time,
            "time_transformers_s": hf_time,
            "transformers_batch_size": args.hf_batch_size,
            "outputs_equal": ours_tokens == hf_outputs,
            "num_outputs_equal": sum(a == b for a, b in zip(ours_tokens, hf_outputs)),
            "num_prompts": len(prompts),
        }
        results.update(_vs_transformers_continuous_batching(hf, prompts, args.max_tokens, ours_tokens, our_time))
    return results


def _vs_transformers_continuous_batching(hf, prompts, max_tokens, ours_tokens, our_time) -> dict:
    """transformers' own continuous batching (``generate_batch``, paged attention), where it exists."""
    from transformers import GenerationConfig

    try:
        if not hasattr(hf, "generate_batch"):
            return {"continuous_batching": "not available in this transformers"}
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        hf.generate_batch(inputs=prompts[:2], generation_config=config, progress_bar=False)  # warm-up
        start = time.perf_counter()
        outputs = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        elapsed = time.perf_counter() - start
    except Exception as error:  # an optional comparison must not sink the whole benchmark
        return {"continuous_batching": f"failed: {type(error).__name__}: {error}"[:200]}
    # Request ids are "req_0", "req_1", ...: put them back in prompt order.
    ordered = sorted(outputs, key=lambda request_id: int(str(request_id).rsplit("_", 1)[-1]))
    tokens = [list(outputs[request_id].generated_tokens) for request_id in ordered]
    return {
        "cb_throughput_ratio": elapsed / our_time,
        "time_transformers_cb_s": elapsed,
        "cb_num_outputs_equal": sum(a == b for a, b in zip(ours_tokens, tokens)),
    }


# -- 5. block manager ---------------------------------------------------------------------
def bench_block_manager(args, progress: Progress = no_progress) -> dict:
    """The issue's workload: 4096 blocks of 16, requests of 64 blocks, 48 of them a shared prefix."""
    from .kv_cache_manager import KVCacheManager
    from .request import Request

    block_size, prefix_blocks, request_blocks, decode_steps, max_live = 16, 48, 64, 16, 32
    rng = random.Random(0)
    shared = [rng.randrange(50_000) for _ in range(prefix_blocks * block_size)]
    manager = KVCacheManager(num_blocks=4096, block_size=block_size)
    timings: dict[str, list[float]] = {"build": [], "admit": [], "free": [], "append": [], "decode_alloc": []}
    live: list[Request] = []
    clock = time.perf_counter
    for i in progress(range(args.block_manager_requests), "block manager"):
        tokens = shared + [rng.randrange(50_000) for _ in range((request_blocks - prefix_blocks) * block_size)]
        t0 = clock()
        request = Request(f"r{i}", tokens, block_size=block_size)
        t1 = clock()
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
        request.num_computed_tokens = request.num_tokens
        t2 = clock()
        timings["build"].append(t1 - t0)
        timings["admit"].append(t2 - t1)
        for _ in range(decode_steps):
            t3 = clock()
            request.append_output_token_ids(rng.randrange(50_000))
            t4 = clock()
            manager.allocate_slots(request, 1)
            request.num_computed_tokens += 1
            t5 = clock()
            timings["append"].append(t4 - t3)
            timings["decode_alloc"].append(t5 - t4)
        live.append(request)
        if len(live) > max_live:
            old = live.pop(0)
            t6 = clock()
            manager.free(old)
            timings["free"].append(clock() - t6)
    for request in live:
        manager.free(request)
    us = {name: 1e6 * statistics.median(values) for name, values in timings.items()}
    return {
        "admit_free_us": us["admit"] + us["free"],
        "decode_step_us": us["append"] + us["decode_alloc"],
        "build_request_us": us["build"],
        "lookup_allocate_us": us["admit"],
        "free_us": us["free"],
        "append_token_us": us["append"],
        "decode_allocate_us": us["decode_alloc"],
        "vllm_reference_us": {"build_request": 183, "lookup_allocate": 121, "free": 11, "append_token": 1.9, "decode_allocate": 6.8},
    }


# -- report ----------------------------------------------------------------------------------
def plot_ttft(shared: dict, ax) -> None:
    """Box plot of each request's TTFT, caching on vs off (``shared`` = results["shared_prefix"])."""
    ax.boxplot([[1000 * t for t in shared["_ttfts_on"]], [1000 * t for t in shared["_ttfts_off"]]])
    ax.set_xticks([1, 2], ["caching on", "caching off"])
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("Shared system prompt: TTFT per request")


def plot_hit_rate_per_turn(multi_turn: dict, ax) -> None:
    """Hit rate per turn of a conversation, stable vs timestamped template."""
    for variant, rates in multi_turn["_per_turn"].items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=variant)
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt tokens from cache")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("Multi-turn chat: hit rate per turn")


def plot_vs_transformers(vs: dict, ax) -> None:
    """Seconds for the same requests: transformers' generate vs mini-vLLM."""
    ax.bar(["transformers generate", "mini-vLLM"], [vs["time_transformers_s"], vs["time_ours_s"]])
    ax.set_ylabel("seconds for the same requests")
    ax.set_title(f"vs transformers: {vs['throughput_ratio']:.1f}x throughput")


def _plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, plot, key in (
        ("ttft_on_off.png", plot_ttft, "shared_prefix"),
        ("hit_rate_per_turn.png", plot_hit_rate_per_turn, "multi_turn"),
        ("vs_transformers.png", plot_vs_transformers, "vs_transformers"),
    ):
        fig, ax = plt.subplots(figsize=(6, 3))
        plot(results[key], ax)
        paths.append(out_dir / name)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def format_table(results: dict) -> str:
    s, n, m, v, b = (results[k] for k in ("shared_prefix", "no_sharing", "multi_turn", "vs_transformers", "block_manager"))
    rows = [
        ("shared prefix: TTFT speedup (p50)", f"{s['ttft_speedup']:.2f}x", f"ideal {s['ideal_speedup']:.2f}x, achieved/ideal {s['ttft_speedup'] / s['ideal_speedup']:.0%}"),
        ("shared prefix: hit rate", f"{s['hit_rate']:.1%}", f"prefill tokens {s['prefill_tokens_on']} vs {s['prefill_tokens_off']}"),
        ("shared prefix: TTFT p50 / p90 on", f"{s['ttft_p50_on_ms']:.1f} / {s['ttft_p90_on_ms']:.1f} ms", f"off: {s['ttft_p50_off_ms']:.1f} / {s['ttft_p90_off_ms']:.1f} ms"),
        ("no sharing: throughput on/off", f"{n['throughput_ratio_on_off']:.3f}", "goal >= 0.97"),
        ("multi-turn: hit rate stable", f"{m['hit_rate_stable']:.1%}", f"timestamped template: {m['hit_rate_timestamped']:.1%}"),
        ("vs transformers: throughput", f"{v['throughput_ratio']:.2f}x", f"greedy outputs equal: {v['num_outputs_equal']}/{v['num_prompts']}"),
        *(
            [("vs transformers generate_batch (continuous batching)", f"{v['cb_throughput_ratio']:.2f}x", f"greedy outputs equal: {v['cb_num_outputs_equal']}/{v['num_prompts']}")]
            if "cb_throughput_ratio" in v
            else []
        ),
        ("block manager: admit + free", f"{b['admit_free_us']:.1f} us", f"vLLM 0.11: {121 + 11} us"),
        ("block manager: build request (hash 64 blocks)", f"{b['build_request_us']:.1f} us", "vLLM 0.11: 183 us"),
        ("block manager: decode step", f"{b['decode_step_us']:.2f} us", f"vLLM 0.11: {1.9 + 6.8:.1f} us"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"device: {results['device']}", ""]
    lines += [f"{name:<{width}}  {value:>18}  {note}" for name, value, note in rows]
    return "\n".join(lines)


def run_benchmarks(
    settings: BenchSettings, which: Sequence[str] = BENCHMARKS, progress: Progress = no_progress
) -> dict:
    """Run the benchmarks named in ``which`` (all by default); returns their results by name.

    Keys starting with ``_`` hold raw per-request data (for the plots); they
    are left out of the JSON file.
    """
    functions = {
        "shared_prefix": bench_shared_prefix,
        "no_sharing": bench_no_sharing,
        "multi_turn": bench_multi_turn,
        "vs_transformers": bench_vs_transformers,
        "block_manager": bench_block_manager,
    }
    unknown = set(which) - set(functions)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; choose from {list(functions)}")
    return {name: functions[name](settings, progress) for name in which}


def public(results: dict) -> dict:
    """``results`` without the raw ``_`` keys: what goes into the JSON file."""
    return {k: ({kk: vv for kk, vv in v.items() if not kk.startswith("_")} if isinstance(v, dict) else v) for k, v in results.items()}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (about 2 minutes on 2 CPU cores)")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "bench.json")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    settings = BenchSettings.quick(args.device) if args.quick else BenchSettings.full(args.device)

    from tqdm.auto import tqdm

    def progress(iterable: Iterable, desc: str) -> Iterable:
        return tqdm(iterable, desc=desc, leave=False)

    results: dict[str, Any] = {"versions": {"torch": torch.__version__, "python": platform.python_version()}}
    import transformers

    results["versions"]["transformers"] = transformers.__version__
    results.update(run_benchmarks(settings, BENCHMARKS, progress))
    results["device"] = _device_name(LLM(device=args.device, num_blocks=8))
    results["quick"] = args.quick
    results["date"] = time.strftime("%Y-%m-%d")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        results["plots"] = [str(p) for p in _plots(results, args.json.parent)]
    args.json.write_text(json.dumps(public(results), indent=2))
    print(format_table(results))
    print(f"\nwrote {args.json}")
    return 0
