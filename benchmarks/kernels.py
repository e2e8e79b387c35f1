"""Benchmark the Triton kernels against the PyTorch reference and SDPA (chapter 10).

    python benchmarks/kernels.py                 # on a GPU: the full table (< 3 min on an H200)
    python benchmarks/kernels.py --smoke         # tiny shapes; runs on a CPU (Triton interpreter)
    python benchmarks/kernels.py --sweep         # also time a few launch configurations

What it measures, in order:

1. The device's copy bandwidth: one large device-to-device copy, counting the
   bytes read *and* written. Decode attention reads the KV cache once and does
   little arithmetic, so this is the speed limit it is compared with.
2. Correctness: each kernel against ``torch.nn.functional.scaled_dot_product_attention``
   (SDPA) on the same K/V gathered into a dense tensor, before any timing.
3. Decode: ``paged_attention`` for batch sizes 1, 8, 64 and contexts 1k, 4k,
   16k (32 query heads, 8 KV heads, head_dim 128, bfloat16, 16-token blocks,
   shuffled blocks), next to ``unified_attention`` on the same batch, the
   PyTorch reference (small batches only: it is a Python loop) and SDPA on a
   pre-gathered dense cache (which skips the paging, so it is a bound, not a
   competitor).
4. Prefill over a cached prefix: ``unified_attention`` for 4 sequences of
   3k cached + 1k new tokens, against SDPA with a bottom-right causal mask.

Times are medians of ``triton.testing.do_bench`` (which also flushes the GPU's
L2 cache between runs, so a small KV cache cannot be served from L2). For each
row it prints microseconds, the KV bytes read per second, and that as a
percentage of the copy bandwidth. On a GPU, each fast row also shows the time
replayed from a CUDA graph (the GPU's time without Python's launch overhead)
and the CPU time one call takes to launch: where the launch takes longer than
the kernel, do_bench is timing Python. ``--json`` writes everything to a file.

Every configuration runs inside its own ``try``: one that fails (out of memory,
an SDPA variant this PyTorch lacks) is reported and the rest still run.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

# This file is benchmarks/kernels.py, and Python puts its folder first on
# sys.path, where a package that probes for Hugging Face's `kernels` (transformers does) would
# find this very script instead. Replace that entry with the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mini_vllm import kernels  # noqa: E402
from mini_vllm.kernels import reference  # noqa: E402

DEFAULT_JSON = _HERE / "results" / "kernels.json"


def log(*parts: object) -> None:
    print(*parts, flush=True)


# --------------------------------------------------------------------------- timing


def time_us(fn: Callable[[], object], on_gpu: bool, slow: bool = False) -> float:
    """Median time of ``fn()`` in microseconds."""
    if on_gpu:
        import triton.testing

        # A slow function (the reference) gets fewer repetitions.
        warmup, rep = (5, 30) if slow else (25, 100)
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3
    fn()  # warm-up (the interpreter has no compilation, but caches warm up)
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def copy_bandwidth_gbps(device: torch.device, on_gpu: bool, smoke: bool) -> float:
    """Bytes read + written per second by one large device-to-device copy."""
    num_bytes = (1 << 30) if on_gpu and not smoke else (64 << 20)
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    target = torch.empty_like(source)
    microseconds = time_us(lambda: target.copy_(source), on_gpu)
    return 2 * num_bytes / (microseconds * 1e-6) / 1e9


# --------------------------------------------------------------------------- inputs


class DecodeBatch:
    """A decode step: ``batch`` sequences of ``context`` tokens in shuffled 16-token blocks."""

    def __init__(self, batch, context, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
        generator = torch.Generator(device=device).manual_seed(seed)
        blocks_per_seq = math.ceil(context / block_size)
        num_blocks = batch * blocks_per_seq
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
        self.v_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
        order = torch.randperm(num_blocks, generator=generator, device=device)
        self.block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.query = torch.randn((batch, num_q_heads, head_dim), generator=generator, device=device, dtype=dtype)
        self.cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.kv_bytes = 2 * batch * context * num_kv_heads * head_dim * self.k_cache.element_size()
        self.context = context

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V gathered into ``[batch, num_kv_heads, context, head_dim]`` for SDPA."""
        batch = self.block_tables.shape[0]
        keys = self.k_cache[self.block_tables.long()].flatten(1, 2)[:, : self.context]
        values = self.v_cache[self.block_tables.long()].flatten(1, 2)[:, : self.context]
        assert keys.shape[0] == batch
        return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()


def sdpa_gqa(query, keys, values, attn_mask=None, is_causal=False):
    """SDPA with grouped-query attention; repeats K/V heads where enable_gqa is missing."""
    try:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True
        )
    except TypeError:
        group = query.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=attn_mask, is_causal=is_causal)


# --------------------------------------------------------------------------- benchmarks


def bench_decode(shape, batch, context, device, on_gpu, copy_gbps, reference_max_batch, results, sweep=False):
    log(f"\n-- decode B={batch} ctx={context}")
    data = DecodeBatch(batch, context, device=device, **shape)
    args = (data.query, data.k_cache, data.v_cache, data.block_tables, data.seq_lens)
    unified_args = (data.query, data.k_cache, data.v_cache, data.cu_seqlens_q, data.seq_lens, data.block_tables)

    candidates: dict[str, tuple[Callable[[], object], bool]] = {
        "triton paged_attention": (lambda: kernels.paged_attention(*args), False),
        "triton unified_attention": (lambda: kernels.unified_attention(*unified_args, max_query_len=1), False),
    }
    if batch <= reference_max_batch:
        candidates["torch reference"] = (lambda: reference.paged_attention(*args), True)
    try:
        keys, values = data.dense_kv()
        query = data.query.unsqueeze(2)  # [batch, heads, 1, head_dim]
        candidates["sdpa (dense, pre-gathered)"] = (lambda: sdpa_gqa(query, keys, values), False)
    except Exception as error:  # e.g. out of memory for the dense copy
        log(f"   sdpa skipped: {error!r}")

    for name, (fn, slow) in candidates.items():
        record_time(results, "decode", name, batch, context, data.kv_bytes, None, fn, on_gpu, copy_gbps, slow)

    if sweep:
        sweep_decode(args, data.kv_bytes, batch, context, on_gpu, copy_gbps, results)


def sweep_decode(args, kv_bytes, batch, context, on_gpu, copy_gbps, results):
    """Time paged_attention over a grid of launch settings (and of splits for small batches)."""
    if batch <= 8:
        for num_splits in (1, 2, 4, 8, 16, 32, 64):
            name = f"sweep paged num_splits={num_splits}"
            fn = lambda: kernels.paged_attention(*args, num_splits=num_splits)  # noqa: E731
            record_time(
                results, "decode-sweep", name, batch, context, kv_bytes, None, fn, on_gpu, copy_gbps, quiet=True
            )
    for block_n in (32, 64, 128):
        for num_warps in (4, 8):
            for num_stages in (2, 3, 4):
                name = f"sweep paged block_n={block_n} warps={num_warps} stages={num_stages}"
                config = {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
                fn = lambda: kernels.paged_attention(*args, **config)  # noqa: E731
                record_time(
                    results, "decode-sweep", name, batch, context, kv_bytes, None, fn, on_gpu, copy_gbps, quiet=True
                )
    best = min(
        (r for r in results if r["kind"] == "decode-sweep" and r["batch"] == batch and r.get("us")),
        key=lambda r: r["us"],
        default=None,
    )
    if best:
        log(f"   best: {best['name']}  {best['us']:.1f} us  {best.get('pct_of_copy', 0):.0f}% of copy")


def prefill_batch(num_seqs, cached, new, shape, device):
    """``num_seqs`` sequences with ``cached`` tokens in the cache and ``new`` query tokens."""
    context = cached + new
    data = DecodeBatch(num_seqs, context, device=device, **shape)
    generator = torch.Generator(device=device).manual_seed(1)
    query = torch.randn(
        (num_seqs * new, shape["num_q_heads"], shape["head_dim"]),
        generator=generator,
        device=device,
        dtype=shape["dtype"],
    )
    cu_seqlens_q = torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32, device=device)
    return data, query, cu_seqlens_q


def lower_right_causal_mask(new, context, device):
    """Query i (at position context - new + i) sees keys 0 .. context - new + i."""
    query_pos = torch.arange(context - new, context, device=device)[:, None]
    key_pos = torch.arange(context, device=device)[None, :]
    return key_pos <= query_pos


def bench_prefill(shape, num_seqs, cached, new, device, on_gpu, copy_gbps, results, sweep=False):
    log(f"\n-- prefill over a cached prefix: {num_seqs} seqs x ({cached} cached + {new} new)")
    data, query, cu_seqlens_q = prefill_batch(num_seqs, cached, new, shape, device)
    args = (query, data.k_cache, data.v_cache, cu_seqlens_q, data.seq_lens, data.block_tables)
    # Each query sees (cached + i + 1) keys: 4 flops per (query, key, head, dim) pair.
    pairs = num_seqs * sum(cached + i + 1 for i in range(new))
    flops = 4 * pairs * shape["num_q_heads"] * shape["head_dim"]

    keys, values = data.dense_kv()
    dense_query = query.view(num_seqs, new, shape["num_q_heads"], shape["head_dim"]).transpose(1, 2)
    mask = lower_right_causal_mask(new, cached + new, device)

    def sdpa_lower_right():
        from torch.nn.attention.bias import causal_lower_right

        return sdpa_gqa(dense_query, keys, values, attn_mask=causal_lower_right(new, cached + new))

    candidates = {
        "triton unified_attention": (lambda: kernels.unified_attention(*args, max_query_len=new), False),
        "torch reference": (lambda: reference.unified_attention(*args), True),
        "sdpa causal_lower_right": (sdpa_lower_right, False),
        "sdpa boolean mask": (lambda: sdpa_gqa(dense_query, keys, values, attn_mask=mask), False),
    }
    for name, (fn, slow) in candidates.items():
        record_time(results, "prefill", name, num_seqs, cached + new, data.kv_bytes, flops, fn, on_gpu, copy_gbps, slow)

    if sweep:
        for block_m in (64, 128):
            for block_n in (32, 64):
                for num_warps in (4, 8):
                    for num_stages in (2, 3):
                        config = {
                            "block_m": block_m,
                            "block_n": block_n,
                            "num_warps": num_warps,
                            "num_stages": num_stages,
                        }
                        name = "sweep unified " + " ".join(f"{k}={v}" for k, v in config.items())
                        fn = lambda: kernels.unified_attention(*args, max_query_len=new, **config)  # noqa: E731
                        record_time(
                            results,
                            "prefill-sweep",
                            name,
                            num_seqs,
                            cached + new,
                            data.kv_bytes,
                            flops,
                            fn,
                            on_gpu,
                            copy_gbps,
                            quiet=True,
                        )
        best = min(
            (r for r in results if r["kind"] == "prefill-sweep" and r.get("us")), key=lambda r: r["us"], default=None
        )
        if best:
            log(f"   best: {best['name']}  {best['us']:.1f} us  {best.get('tflops', 0):.1f} TFLOP/s")


def graph_and_cpu_us(fn: Callable[[], object]) -> tuple[float, float]:
    """(GPU time per call replayed from a CUDA graph, CPU time per call to launch it).

    For a small batch the kernel may take less time than Python takes to
    launch it, and do_bench then measures the launch. A CUDA graph (what vLLM
    uses for decode) replays the recorded launches without Python: its time is
    the GPU's alone (without an L2 flush, so a cache smaller than the L2 is
    partly served from there).
    """
    import triton.testing

    graph_us = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    calls = 50
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    cpu_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return graph_us, cpu_us


def record_time(results, kind, name, batch, context, kv_bytes, flops, fn, on_gpu, copy_gbps, slow=False, quiet=False):
    row = {"kind": kind, "name": name, "batch": batch, "context": context, "kv_bytes": kv_bytes}
    try:
        microseconds = time_us(fn, on_gpu, slow)
        row["us"] = microseconds
        row["kv_gbps"] = kv_bytes / (microseconds * 1e-6) / 1e9
        row["pct_of_copy"] = 100 * row["kv_gbps"] / copy_gbps
        if flops:
            row["tflops"] = flops / (microseconds * 1e-6) / 1e12
        graph_text = ""
        if on_gpu and not slow and not quiet:
            try:
                row["graph_us"], row["cpu_launch_us"] = graph_and_cpu_us(fn)
                row["graph_pct_of_copy"] = 100 * kv_bytes / (row["graph_us"] * 1e-6) / 1e9 / copy_gbps
                graph_text = (
                    f"  | graph {row['graph_us']:8.1f} us {row['graph_pct_of_copy']:5.1f}%"
                    f"  launch {row['cpu_launch_us']:5.1f} us"
                )
            except Exception as error:
                row["graph_error"] = repr(error)
                graph_text = f"  | graph: {error!r}"[:80]
        if not quiet:
            extra = f"  {row['tflops']:6.1f} TFLOP/s" if flops else ""
            log(
                f"   {name:<30} {microseconds:9.1f} us  {row['kv_gbps']:6.0f} GB/s  "
                f"{row['pct_of_copy']:5.1f}% of copy{extra}{graph_text}"
            )
    except Exception as error:
        row["error"] = repr(error)
        log(f"   {name:<34} FAILED: {error!r}")
        if not quiet:
            traceback.print_exc()
    results.append(row)
    if on_gpu:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- correctness


def check_against_sdpa(shape, device, smoke, checks):
    """Each kernel vs SDPA on one configuration (max abs difference, bf16-sized tolerance)."""
    tolerance = 3e-2 if shape["dtype"] in (torch.bfloat16, torch.float16) else 1e-4

    def report(name, actual, expected):
        error = (actual.float() - expected.float()).abs().max().item()
        passed = bool(error <= tolerance)
        checks.append({"name": name, "max_abs_error": error, "tolerance": tolerance, "passed": passed})
        log(f"   {name:<52} max |diff| {error:.2e}  {'PASS' if passed else 'FAIL'}")

    decode_cases = [(2, 64), (1, 48)] if smoke else [(64, 1024), (1, 4096)]
    for batch, context in decode_cases:
        try:
            data = DecodeBatch(batch, context, device=device, seed=7, **shape)
            keys, values = data.dense_kv()
            expected = sdpa_gqa(data.query.unsqueeze(2), keys, values).squeeze(2)
            actual = kernels.paged_attention(data.query, data.k_cache, data.v_cache, data.block_tables, data.seq_lens)
            report(f"paged_attention B={batch} ctx={context} vs sdpa", actual, expected)
            actual = kernels.unified_attention(
                data.query, data.k_cache, data.v_cache, data.cu_seqlens_q, data.seq_lens, data.block_tables
            )
            report(f"unified_attention (decode) B={batch} ctx={context} vs sdpa", actual, expected)
        except Exception as error:
            checks.append({"name": f"decode B={batch} ctx={context}", "error": repr(error), "passed": False})
            log(f"   decode check B={batch} ctx={context} FAILED: {error!r}")
            traceback.print_exc()

    num_seqs, cached, new = (2, 40, 24) if smoke else (2, 1000, 300)
    try:
        data, query, cu_seqlens_q = prefill_batch(num_seqs, cached, new, shape, device)
        keys, values = data.dense_kv()
        dense_query = query.view(num_seqs, new, shape["num_q_heads"], shape["head_dim"]).transpose(1, 2)
        mask = lower_right_causal_mask(new, cached + new, device)
        expected = sdpa_gqa(dense_query, keys, values, attn_mask=mask).transpose(1, 2).flatten(0, 1)
        actual = kernels.unified_attention(
            query, data.k_cache, data.v_cache, cu_seqlens_q, data.seq_lens, data.block_tables
        )
        report(f"unified_attention prefill {num_seqs}x({cached}+{new}) vs sdpa", actual, expected)
    except Exception as error:
        checks.append({"name": "prefill", "error": repr(error), "passed": False})
        log(f"   prefill check FAILED: {error!r}")
        traceback.print_exc()


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter friendly)")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configurations")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"where to write results ({DEFAULT_JSON})")
    options = parser.parse_args()

    if not kernels.TRITON_AVAILABLE:
        log(kernels.UNAVAILABLE_MESSAGE)
        return 1
    on_gpu = torch.cuda.is_available() and not kernels.TRITON_INTERPRETED
    device = torch.device("cuda" if on_gpu else "cpu")
    smoke = options.smoke or not on_gpu
    if not options.smoke and not on_gpu:
        log("no GPU (or TRITON_INTERPRET=1): running the --smoke sizes in Triton's interpreter")

    started = time.perf_counter()
    device_name = torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu"
    import triton

    log(
        f"device: {device_name} | torch {torch.__version__} | triton {triton.__version__} | "
        f"{'compiled' if on_gpu else 'interpreted'}"
    )

    if smoke:
        log("smoke sizes: these numbers check that everything runs; they say nothing about a GPU")
        shape = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32, "block_size": 16, "dtype": torch.bfloat16}
        batches, contexts, prefill = (1, 2), (64,), (2, 48, 16)
    else:
        shape = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": torch.bfloat16}
        batches, contexts, prefill = (1, 8, 64), (1024, 4096, 16384), (4, 3072, 1024)

    copy_gbps = copy_bandwidth_gbps(device, on_gpu, smoke)
    log(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s")

    checks: list[dict] = []
    results: list[dict] = []
    report = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "mode": "compiled" if on_gpu else "interpreted",
        "smoke": smoke,
        "shape": {key: str(value) for key, value in shape.items()},
        "copy_bandwidth_gbps": copy_gbps,
        "checks": checks,
        "results": results,
        "goal": None,
        "seconds": None,
    }

    def save() -> None:
        # Written after every section, so a run cut short still leaves its numbers.
        report["seconds"] = time.perf_counter() - started
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(report, indent=2))

    log("\ncorrectness against SDPA:")
    check_against_sdpa(shape, device, smoke, checks)
    save()

    for batch in batches:
        for context in contexts:
            try:
                bench_decode(
                    shape,
                    batch,
                    context,
                    device,
                    on_gpu,
                    copy_gbps,
                    reference_max_batch=8,
                    results=results,
                    sweep=options.sweep and context == 4096,
                )
            except Exception as error:
                log(f"   decode B={batch} ctx={context} FAILED: {error!r}")
                traceback.print_exc()
                results.append({"kind": "decode", "batch": batch, "context": context, "error": repr(error)})
            if on_gpu:
                torch.cuda.empty_cache()
            save()
            log(f"   ({time.perf_counter() - started:.0f} s elapsed)")
    try:
        bench_prefill(shape, *prefill, device, on_gpu, copy_gbps, results, sweep=options.sweep)
    except Exception as error:
        log(f"   prefill FAILED: {error!r}")
        traceback.print_exc()
        results.append({"kind": "prefill", "error": repr(error)})
    save()

    goal = None
    goal_batch, goal_context = 64, 4096
    for row in results:
        if (row["kind"], row.get("name"), row.get("batch"), row.get("context")) == (
            "decode",
            "triton paged_attention",
            goal_batch,
            goal_context,
        ) and "pct_of_copy" in row:
            goal = {
                "batch": goal_batch,
                "context": goal_context,
                "pct_of_copy": row["pct_of_copy"],
                "target_pct": 70.0,
                "met": row["pct_of_copy"] >= 70.0,
            }
    if goal:
        log(
            f"\ngoal: paged_attention at B={goal_batch}, ctx={goal_context} reads the KV cache at "
            f"{goal['pct_of_copy']:.0f}% of the copy bandwidth (target 70%): {'met' if goal['met'] else 'NOT met'}"
        )

    report["goal"] = goal
    save()
    log(f"\nwrote {options.json} ({report['seconds']:.0f} s)")
    return 0 if all(check.get("passed") for check in checks) else 2


if __name__ == "__main__":
    sys.exit(main())
