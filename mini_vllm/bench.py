"""Benchmarks: ``python -m mini_vllm bench [--quick] [--json PATH]`` (chapter 10, README).

Every comparison runs side by side in this one process and is reported as a
ratio; absolute times are printed with the device they were measured on.

1. shared_prefix   many requests share one long system prompt: caching on vs off
2. no_sharing      random prompts: what hashing and bookkeeping cost when nothing hits
3. multi_turn      a conversation that grows turn by turn: a stable template vs one
                   that injects a timestamp at the top
4. vs_transformers the same model, prompts and device through transformers' generate
5. block_manager   the KV-cache manager's own cost per request and per decode step
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from .llm import LLM
from .model import default_model_path
from .sampling_params import SamplingParams

RESULTS_DIR = Path("benchmarks/results")


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
def bench_shared_prefix(args, progress) -> dict:
    data = _prompt_data()
    system = data["system_prompts"][0]
    users = [data["user_requests"][i % len(data["user_requests"])] for i in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    result: dict = {}
    for caching in (True, False):
        llm = LLM(device=args.device, enable_prefix_caching=caching)
        prompts = [{"prompt_token_ids": _chat_ids(llm, system, u)} for u in users]
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))  # warm-up
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
            "hit_rate": llm.llm_engine.get_stats().hit_rate,
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
def bench_no_sharing(args, progress) -> dict:
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    times = {}
    for caching in progress([True, False, True, False], "no sharing"):  # interleaved: drift hits both
        llm = LLM(device=args.device, enable_prefix_caching=caching)
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(200, 400))]} for _ in range(args.num_requests)]
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
        start = time.perf_counter()
        llm.generate(prompts, params)
        times.setdefault(caching, []).append(time.perf_counter() - start)
    return {"throughput_ratio_on_off": min(times[False]) / min(times[True]), "time_on_s": min(times[True]), "time_off_s": min(times[False])}


# -- 3. multi-turn -------------------------------------------------------------------
def bench_multi_turn(args, progress) -> dict:
    data = _prompt_data()
    system = data["system_prompts"][1]
    users = data["user_requests"][: args.num_turns]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    per_turn = {}
    for variant in ("stable", "timestamped"):
        llm = LLM(device=args.device)
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
def bench_vs_transformers(args, progress) -> dict:
    from transformers import AutoModelForCausalLM

    data = _prompt_data()
    system = data["system_prompts"][0]
    users = [data["user_requests"][i % len(data["user_requests"])] for i in range(args.num_requests)]
    llm = LLM(device=args.device)
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
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
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
    return results


# -- 5. block manager ---------------------------------------------------------------------
def bench_block_manager(args, progress) -> dict:
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
def _plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    shared = results["shared_prefix"]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.boxplot([[1000 * t for t in shared["_ttfts_on"]], [1000 * t for t in shared["_ttfts_off"]]])
    ax.set_xticks([1, 2], ["caching on", "caching off"])
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("Shared system prompt: TTFT per request")
    paths.append(out_dir / "ttft_on_off.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    turns = results["multi_turn"]["_per_turn"]
    fig, ax = plt.subplots(figsize=(6, 3))
    for variant, rates in turns.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=variant)
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt tokens from cache")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("Multi-turn chat: hit rate per turn")
    paths.append(out_dir / "hit_rate_per_turn.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    vs = results["vs_transformers"]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(["transformers generate", "mini-vLLM"], [vs["time_transformers_s"], vs["time_ours_s"]])
    ax.set_ylabel("seconds for the same requests")
    ax.set_title(f"vs transformers: {vs['throughput_ratio']:.1f}x throughput")
    paths.append(out_dir / "vs_transformers.png")
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
        ("block manager: admit + free", f"{b['admit_free_us']:.1f} us", f"vLLM 0.11: {121 + 11} us"),
        ("block manager: build request (hash 64 blocks)", f"{b['build_request_us']:.1f} us", "vLLM 0.11: 183 us"),
        ("block manager: decode step", f"{b['decode_step_us']:.2f} us", f"vLLM 0.11: {1.9 + 6.8:.1f} us"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"device: {results['device']}", ""]
    lines += [f"{name:<{width}}  {value:>18}  {note}" for name, value, note in rows]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (about 2 minutes on 2 CPU cores)")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "bench.json")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    args.num_requests = 8 if args.quick else 24
    args.max_tokens = 8 if args.quick else 16
    args.num_turns = 4 if args.quick else 8
    args.hf_batch_size = 8
    args.block_manager_requests = 100 if args.quick else 400

    from tqdm.auto import tqdm

    def progress(iterable, desc):
        return tqdm(iterable, desc=desc, leave=False)

    results: dict = {"versions": {"torch": torch.__version__, "python": platform.python_version()}}
    import transformers

    results["versions"]["transformers"] = transformers.__version__
    results["shared_prefix"] = bench_shared_prefix(args, progress)
    results["no_sharing"] = bench_no_sharing(args, progress)
    results["multi_turn"] = bench_multi_turn(args, progress)
    results["vs_transformers"] = bench_vs_transformers(args, progress)
    results["block_manager"] = bench_block_manager(args, progress)
    results["device"] = _device_name(LLM(device=args.device, num_blocks=8))
    results["quick"] = args.quick
    results["date"] = time.strftime("%Y-%m-%d")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        results["plots"] = [str(p) for p in _plots(results, args.json.parent)]
    public = {k: ({kk: vv for kk, vv in v.items() if not kk.startswith("_")} if isinstance(v, dict) else v) for k, v in results.items()}
    args.json.write_text(json.dumps(public, indent=2))
    print(format_table(results))
    print(f"\nwrote {args.json}")
    return 0
