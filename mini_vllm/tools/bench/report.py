"""The report: the results as a table (``format_table``), as plots, and as the JSON file (``public``).

Reads only the results dicts the benchmarks return (or a results file), so
chapter 10 prints a committed ``bench.json`` with it too. vLLM's counterpart:
the printing at the end of each ``benchmarks/benchmark_*.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .vs_vllm import VLLM_COMPARABLE


def plot_ttft(shared: dict, ax) -> None:
    """Box plot of each request's TTFT (median over rounds): warm, cold, and a fresh prompt as
    long as what warm computes (``shared`` = results["shared_prefix"])."""
    ax.boxplot([[1000 * t for t in shared[key]] for key in ("_ttfts_on", "_ttfts_fresh", "_ttfts_off")])
    ax.set_xticks([1, 2, 3], ["warm (prefix cached)", "fresh, same uncached", "cold (caching off)"])
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


def plot_vs_vllm(vs_vllm: dict, ax) -> None:
    """mini-vLLM / vLLM per model: throughput, TTFT cold, TTFT warm (``vs_vllm`` = results["vs_vllm"])."""
    models = [name for name, r in vs_vllm.items() if "skipped" not in r]
    keys = [("throughput_ratio", "throughput"), ("ttft_cold_ratio", "TTFT cold"), ("ttft_warm_ratio", "TTFT warm")]
    width = 0.8 / max(1, len(models))
    for index, name in enumerate(models):
        positions = [k + index * width for k in range(len(keys))]
        ax.bar(positions, [vs_vllm[name][key] for key, _ in keys], width, label=name)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], [label for _, label in keys])
    ax.set_ylabel("mini-vLLM / vLLM")
    ax.legend(fontsize="small")
    ax.set_title("vs real vLLM, same CPU, 1 thread each")


def plot_roofline(roofline: dict, ax) -> None:
    """Per model: the measured decode step next to the floor of reading every weight once."""
    names = list(roofline)
    positions = range(len(names))
    ax.bar([x - 0.2 for x in positions], [roofline[n]["decode_step_ms"] for n in names], 0.4, label="decode step")
    ax.bar(
        [x + 0.2 for x in positions],
        [roofline[n]["weights_read_floor_ms"] for n in names],
        0.4,
        label="weights-read floor",
    )
    ax.set_xticks(list(positions), names)
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (log scale)")
    ax.legend(fontsize="small")
    ax.set_title("One request's decode step vs reading every weight once")


def _plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, plot, key in (
        ("ttft_on_off.png", plot_ttft, "shared_prefix"),
        ("hit_rate_per_turn.png", plot_hit_rate_per_turn, "multi_turn"),
        ("vs_transformers.png", plot_vs_transformers, "vs_transformers"),
        ("roofline.png", plot_roofline, "roofline"),
        ("vs_vllm.png", plot_vs_vllm, "vs_vllm"),
    ):
        if key in ("roofline", "vs_vllm") and not any("skipped" not in r for r in results.get(key, {}).values()):
            continue  # nothing measured (e.g. --quick leaves vLLM out)
        fig, ax = plt.subplots(figsize=(6, 3))
        plot(results[key], ax)
        paths.append(out_dir / name)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def _shared_prefix_rows(s: dict, label: str) -> list[tuple[str, str, str]]:
    low, high = s["ttft_speedup_range"]
    o_low, o_high = s["cache_overhead_ratio_range"]
    return [
        (
            f"{label}shared prefix: TTFT cold / warm (p50)",
            f"{s['ttft_speedup']:.2f}x",
            f"rounds {low:.2f}-{high:.2f}x; token ideal {s['ideal_speedup']:.2f}x, attainable (cold / fresh) {s['attainable_speedup']:.2f}x",
        ),
        (
            f"{label}shared prefix: cache overhead warm / fresh",
            f"{s['cache_overhead_ratio']:.3f}",
            f"rounds {o_low:.3f}-{o_high:.3f}; {s['ttft_p50_on_ms']:.1f} vs {s['ttft_fresh_same_uncached_ms']:.1f} ms; "
            + (f"in FLOPs {s['cache_overhead_flops_ratio']:.3f}; " if "cache_overhead_flops_ratio" in s else "")
            + "goal: <= vLLM's (the vs vLLM rows)",
        ),
        (
            f"{label}shared prefix: hit rate",
            f"{s['hit_rate']:.1%}",
            f"prefill tokens {s['prefill_tokens_on']} vs {s['prefill_tokens_off']}",
        ),
        (
            f"{label}shared prefix: TTFT p50 / p90 warm",
            f"{s['ttft_p50_on_ms']:.1f} / {s['ttft_p90_on_ms']:.1f} ms",
            f"cold: {s['ttft_p50_off_ms']:.1f} / {s['ttft_p90_off_ms']:.1f} ms",
        ),
    ]


def serving_rows(name: str, r: dict) -> list[tuple[str, str, str]]:
    """The over-HTTP figures of one model: each server's median (range over rounds), and the ratio."""
    workload = f"{r['num_requests']} chats, {r['concurrency']} clients at a time, {r['max_tokens']} tokens each"
    rows = []
    for key, label, unit in (("throughput_tok_s", "throughput", "tok/s"), ("ttft_p50_ms", "TTFT p50", "ms")):
        mine = f"{r[f'mini_{key}']:.0f} {unit} ({r[f'mini_{key}_range'][0]:.0f}-{r[f'mini_{key}_range'][1]:.0f})"
        if "vllm_" + key in r:
            theirs = f"vLLM {r[f'vllm_{key}']:.0f} ({r[f'vllm_{key}_range'][0]:.0f}-{r[f'vllm_{key}_range'][1]:.0f})"
            ratio = r["throughput_ratio" if key == "throughput_tok_s" else "ttft_ratio"]
            rows.append((f"{name}: over HTTP, {label}", f"{ratio:.2f}x vLLM", f"{mine} vs {theirs}; {workload}"))
        else:
            rows.append((f"{name}: over HTTP, {label}", mine, f"{workload}; vLLM not installed"))
    return rows


def format_table(results: dict) -> str:
    s, n, m, v, b = (
        results[k] for k in ("shared_prefix", "no_sharing", "multi_turn", "vs_transformers", "block_manager")
    )
    rows = _shared_prefix_rows(s, "")
    rows += [
        (
            "no sharing: throughput on/off",
            f"{n['throughput_ratio_on_off']:.3f}",
            f"rounds {n['throughput_ratio_on_off_range'][0]:.3f}-{n['throughput_ratio_on_off_range'][1]:.3f}; goal >= 0.97",
        ),
        (
            "multi-turn: hit rate stable",
            f"{m['hit_rate_stable']:.1%}",
            f"timestamped template: {m['hit_rate_timestamped']:.1%}",
        ),
        (
            "vs transformers: throughput",
            f"{v['throughput_ratio']:.2f}x",
            f"rounds {v['throughput_ratio_range'][0]:.2f}-{v['throughput_ratio_range'][1]:.2f}x; "
            f"greedy outputs equal: {v['num_outputs_equal']}/{v['num_prompts']}",
        ),
        *(
            [
                (
                    "vs transformers generate_batch (continuous batching)",
                    f"{v['cb_throughput_ratio']:.2f}x",
                    f"greedy outputs equal: {v['cb_num_outputs_equal']}/{v['num_prompts']}",
                )
            ]
            if "cb_throughput_ratio" in v
            else []
        ),
    ]
    for key, label in (
        ("admit_free_us", "admit + free"),
        ("build_request_us", "build request (hash 64 blocks)"),
        ("decode_step_us", "decode step"),
        ("free_us", "free"),
    ):
        theirs = [
            f"vLLM {version}: {summary[key]:.1f} us ({b[key] / summary[key]:.2f}x)"
            for version, summary in b["vllm"].items()
        ]
        rows.append(
            (
                f"block manager: {label}",
                f"{b[key]:.1f} us",
                "; ".join(theirs) or "no vLLM measured (make vllm)",
            )
        )
    for name, model_results in results.get("models", {}).items():
        rows += _shared_prefix_rows(model_results["shared_prefix"], f"{name}: ")
    for name, r in results.get("roofline", {}).items():
        rows.append(
            (
                f"{name}: decode step (batch 1)",
                f"{r['decode_step_ms']:.1f} ms",
                f"weights-read floor {r['weights_read_floor_ms']:.1f} ms ({r['weight_bytes'] / 1e6:.0f} MB at "
                f"{r['memory_bandwidth_gbs']:.1f} GB/s): {r['decode_vs_floor']:.2f}x the floor; goal <= 1.8x",
            )
        )
    for name, r in results.get("vs_vllm", {}).items():
        if "skipped" in r:
            rows.append((f"{name}: vs vLLM", "skipped", r["skipped"]))
            continue
        rows += [
            (
                f"{name}: vs vLLM {r['vllm_version']}: throughput",
                f"{r['throughput_ratio']:.2f}x",
                f"{r['mini']['throughput_tok_s']:.0f} vs {r['vllm']['throughput_tok_s']:.0f} tok/s, {r['threads']} thread(s) "
                f"each; vLLM {r.get('vllm_configuration', VLLM_COMPARABLE)}; mini-vLLM's attention backend "
                f"{r.get('mini_attention_backend', 'torch')}",
            ),
            (
                f"{name}: vs vLLM: TTFT cold / warm",
                f"{r['ttft_cold_ratio']:.2f}x / {r['ttft_warm_ratio']:.2f}x",
                f"cold {r['mini']['ttft_cold_ms']:.1f} vs {r['vllm']['ttft_cold_ms']:.1f} ms, warm {r['mini']['ttft_warm_ms']:.1f} vs "
                f"{r['vllm']['ttft_warm_ms']:.1f} ms; cached tokens equal: {r['cached_tokens_equal']}, outputs equal: {r['outputs_equal']}",
            ),
        ]
        if "mini_cache_overhead_ratio" in r:  # files written before it was measured lack it
            rows.append(
                (
                    f"{name}: cost of caching, mini-vLLM / vLLM",
                    f"{r['mini_cache_overhead_ratio']:.3f} / {r['vllm_cache_overhead_ratio']:.3f}",
                    f"warm / fresh TTFT in each engine, same requests; fresh computes what warm does: "
                    f"{r['fresh_matches_warm']}",
                )
            )
        default = r.get("vllm_default")
        if default:
            rows.append(
                (
                    f"{name}: vs vLLM by default: throughput, TTFT cold / warm",
                    f"{default['throughput_ratio']:.2f}x, {default['ttft_cold_ratio']:.2f}x / {default['ttft_warm_ratio']:.2f}x",
                    f"{r['mini']['throughput_tok_s']:.0f} vs {default['vllm']['throughput_tok_s']:.0f} tok/s; "
                    f"vLLM {default['vllm_configuration']}",
                )
            )
    for name, r in results.get("serving", {}).items():
        rows += serving_rows(name, r)
    width = max(len(r[0]) for r in rows)
    lines = [f"device: {results['device']}", ""]
    lines += [f"{name:<{width}}  {value:>18}  {note}" for name, value, note in rows]
    return "\n".join(lines)


def public(results: Any) -> Any:
    """``results`` without the raw ``_`` keys, at any depth: what goes into the JSON file."""
    if isinstance(results, dict):
        return {k: public(v) for k, v in results.items() if not str(k).startswith("_")}
    return results
