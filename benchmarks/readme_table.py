"""The README's "Measured results, CPU" table, generated from a ``python -m mini_vllm bench`` JSON file.

    python benchmarks/readme_table.py benchmarks/reference_results/bench-cpu.json

prints the Markdown that goes into README.md between the markers
``<!-- bench-table:start -->`` and ``<!-- bench-table:end -->``; ``--write``
replaces that part of README.md itself. Every number comes from the file, so the
table cannot drift from the committed results.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"


def _ok(passed: bool) -> str:
    return "✓" if passed else "**missed**"


def _range(values: list[float], fmt: str) -> str:
    return f"{format(values[0], fmt)}–{format(values[1], fmt)}"


def _rounds(section: dict, key: str, before: str = "; ", after: str = "") -> str:
    """``; rounds 0.95–1.10×`` when the file has the range (older files have only the median)."""
    return f"{before}rounds {_range(section[key], '.2f')}×{after}" if key in section else ""


def shared_prefix_rows(s: dict, label: str) -> list[str]:
    return [
        f"| {label}shared system prompt, {s['num_requests_measured']} requests: hit rate | {s['hit_rate']:.1%} "
        f"({s['prefill_tokens_on']} vs {s['prefill_tokens_off']} prefill tokens) | |",
        f"| … TTFT speedup cold / warm (median of {s['rounds']} rounds) | **{s['ttft_speedup']:.2f}×** "
        f"({s['ttft_p50_off_ms']:.1f} vs {s['ttft_p50_on_ms']:.1f} ms; rounds {_range(s['ttft_speedup_range'], '.2f')}×); "
        f"attainable (cold / fresh) {s['attainable_speedup']:.2f}×, token ratio {s['ideal_speedup']:.1f}× | |",
        f"| … cost of caching: warm / fresh prompt of the same uncached length | **{s['cache_overhead_ratio']:.3f}** "
        f"({s['ttft_p50_on_ms']:.1f} vs {s['ttft_fresh_same_uncached_ms']:.1f} ms; rounds "
        f"{_range(s['cache_overhead_ratio_range'], '.3f')}){_flops(s)} | ≤ vLLM's: the vs-vLLM rows |",
    ]


def _flops(s: dict) -> str:
    """``; in FLOPs 1.18`` when the file has the FLOP ratio of the same work (older files do not)."""
    return (
        f"; the same ratio in FLOPs {s['cache_overhead_flops_ratio']:.3f}" if "cache_overhead_flops_ratio" in s else ""
    )


def _cost_of_caching(r: dict) -> str:
    """``; cost of caching 1.10 vs vLLM's 1.13`` when the file has each engine's warm / fresh ratio."""
    if "mini_cache_overhead_ratio" not in r:
        return ""
    return (
        f"; cost of caching (warm / fresh) {r['mini_cache_overhead_ratio']:.2f} vs vLLM's "
        f"{r['vllm_cache_overhead_ratio']:.2f} (rounds {_range(r['vllm_cache_overhead_ratio_range'], '.2f')})"
    )


def table(results: dict) -> str:
    s, n, m, v, b = (
        results[k] for k in ("shared_prefix", "no_sharing", "multi_turn", "vs_transformers", "block_manager")
    )
    lines = ["| benchmark | result | goal |", "|---|---|---|"]
    lines += shared_prefix_rows(s, f"{results.get('model', 'default_model')}: ")
    for name, model in results.get("models", {}).items():
        lines += shared_prefix_rows(model["shared_prefix"], f"{name}: ")
    lines += [
        f"| no sharing: throughput caching on / off (median of {n['rounds']} rounds) | {n['throughput_ratio_on_off']:.3f} "
        f"(rounds {_range(n['throughput_ratio_on_off_range'], '.3f')}) | ≥ 0.97 {_ok(n['throughput_ratio_on_off'] >= 0.97)} |",
        f"| multi-turn chat, hit rate per turn | {m['hit_rate_stable']:.1%} stable template, "
        f"{m['hit_rate_timestamped']:.1%} with a timestamp on top | |",
        f"| vs `transformers.generate` (padded batches of {v['transformers_batch_size']}), same prompts | "
        f"**{v['throughput_ratio']:.2f}×** throughput (rounds {_range(v['throughput_ratio_range'], '.2f')}×), greedy outputs "
        f"equal {v['num_outputs_equal']}/{v['num_prompts']} | ≥ 2× {_ok(v['throughput_ratio'] >= 2 and v['outputs_equal'])} |",
    ]
    for name, r in results.get("vs_vllm", {}).items():
        if "skipped" in r:
            lines.append(f"| {name}: vs real vLLM | skipped: {r['skipped']} | |")
            continue
        goal = f"throughput ≥ 1.0× {_ok(r['throughput_ratio'] >= 1.0)}"
        if "mini_cache_overhead_ratio" in r:
            goal += (
                f"; cost of caching ≤ vLLM's {_ok(r['mini_cache_overhead_ratio'] <= r['vllm_cache_overhead_ratio'])}"
            )
        if name.startswith("SmolLM2"):
            goal += f"; TTFT cold ≤ 1.1× {_ok(r['ttft_cold_ratio'] <= 1.1)}"
        configuration = r.get("vllm_configuration", "eager, synchronous scheduling, engine core in the same process")
        backend = r.get("mini_attention_backend", "torch")
        lines.append(
            f"| {name}: vs vLLM {r['vllm_version']} ({configuration}; float32, {r['threads']} thread each, "
            f"median of {r['rounds']} rounds; mini-vLLM's attention backend `{backend}`) | "
            f"throughput **{r['throughput_ratio']:.2f}×** ({r['mini']['throughput_tok_s']:.0f} vs "
            f"{r['vllm']['throughput_tok_s']:.0f} tok/s, 5 requests{_rounds(r, 'throughput_ratio_range')}); "
            f"TTFT cold {r['ttft_cold_ratio']:.2f}× ({r['mini']['ttft_cold_ms']:.0f} vs {r['vllm']['ttft_cold_ms']:.0f} ms"
            f"{_rounds(r, 'ttft_cold_ratio_range')}), warm {r['ttft_warm_ratio']:.2f}×{_rounds(r, 'ttft_warm_ratio_range', ' (', ')')}"
            f"{_cost_of_caching(r)}; "
            f"cached tokens equal: {'yes' if r['cached_tokens_equal'] else 'NO'}, outputs equal: "
            f"{'yes' if r['outputs_equal'] else 'NO'} | {goal} |"
        )
        default = r.get("vllm_default")
        if default:
            lines.append(
                f"| {name}: vs vLLM {r['vllm_version']} {default['vllm_configuration']} | "
                f"throughput **{default['throughput_ratio']:.2f}×** ({r['mini']['throughput_tok_s']:.0f} vs "
                f"{default['vllm']['throughput_tok_s']:.0f} tok/s{_rounds(default, 'throughput_ratio_range')}); "
                f"TTFT cold {default['ttft_cold_ratio']:.2f}× ({r['mini']['ttft_cold_ms']:.0f} vs "
                f"{default['vllm']['ttft_cold_ms']:.0f} ms{_rounds(default, 'ttft_cold_ratio_range')}), warm "
                f"{default['ttft_warm_ratio']:.2f}×; vLLM's cost of caching {default['vllm_cache_overhead_ratio']:.2f}; "
                f"outputs equal: {'yes' if default['outputs_equal'] else 'NO'} | |"
            )
    for name, r in results.get("roofline", {}).items():
        goal = f"≤ 1.8× {_ok(r['decode_vs_floor'] <= 1.8)}" if name.startswith("SmolLM2") else ""
        lines.append(
            f"| {name}: decode step, 1 request | {r['decode_step_ms']:.1f} ms = **{r['decode_vs_floor']:.2f}×** the floor "
            f"of reading every weight once ({r['weight_bytes'] / 1e6:.0f} MB at {r['memory_bandwidth_gbs']:.0f} GB/s = "
            f"{r['weights_read_floor_ms']:.1f} ms{_rounds(r, 'decode_vs_floor_range')}) | {goal} |"
        )
    for name, r in results.get("serving", {}).items():
        vllm_config = "vLLM's OpenAI server, eager, 1 thread" if "vllm_throughput_tok_s" in r else "no vLLM measured"
        theirs = (
            f" vs {r['vllm_throughput_tok_s']:.0f} ({_range(r['vllm_throughput_tok_s_range'], '.0f')}) tok/s, "
            f"**{r['throughput_ratio']:.2f}×**; TTFT p50 {r['mini_ttft_p50_ms']:.0f} vs {r['vllm_ttft_p50_ms']:.0f} ms "
            f"({r['ttft_ratio']:.2f}×)"
            if "vllm_throughput_tok_s" in r
            else f" tok/s; TTFT p50 {r['mini_ttft_p50_ms']:.0f} ms"
        )
        lines.append(
            f"| {name}: over HTTP ({vllm_config}; {r['num_requests']} streamed chats, {r['concurrency']} clients at a "
            f"time, median of {r['rounds']} rounds) | throughput {r['mini_throughput_tok_s']:.0f} "
            f"({_range(r['mini_throughput_tok_s_range'], '.0f')}){theirs} | |"
        )
    ours_vs = {version: ratios for version, ratios in b.get("ratio_vs_vllm", {}).items()}
    for key, label in (
        ("admit_free_us", "lookup + allocate + free, 64-block request, 48 hit"),
        ("free_us", "free (of that request)"),
        ("build_request_us", "build request (hash 64 blocks)"),
        ("decode_step_us", "one decode step (append + allocate)"),
    ):
        theirs = "; ".join(
            f"vLLM {version}: {b['vllm'][version][key]:.1f} µs ({ratios[key]:.2f}×)"
            for version, ratios in ours_vs.items()
        )
        worst = max((ratios[key] for ratios in ours_vs.values()), default=None)
        goal = f"≤ vLLM {_ok(worst <= 1.0)}" if worst is not None else ""
        lines.append(f"| block manager: {label} | {b[key]:.1f} µs ({theirs or 'no vLLM measured'}) | {goal} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = parser.parse_args()
    results = json.loads(args.json.read_text())
    text = table(results)
    if not args.write:
        print(text)
        return
    readme = ROOT / "README.md"
    content = readme.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(content):
        raise SystemExit(f"README.md has no {START} ... {END} markers")
    readme.write_text(pattern.sub(lambda _: f"{START}\n{text}\n{END}", content))
    print(f"wrote the table into {readme}")


if __name__ == "__main__":
    main()
