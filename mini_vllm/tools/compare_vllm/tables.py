"""A comparison's result as text: ``format_table`` (counts and verdicts) and ``format_timings``."""

from __future__ import annotations


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def format_table(result: dict, timings: bool = True, header: bool = True) -> str:
    """One table for a ``run_matrix`` / ``run_side_by_side`` result.

    Per request: prompt tokens, cached tokens in each engine, greedy tokens equal.
    Per workload: prefix-cache queries / hits in each engine, preemptions, and
    (``timings=True``) mean TTFT and throughput — the only numbers that vary between runs.
    ``header=False`` leaves out the first line (vLLM's version, threads).
    """
    lines = []
    if header:
        lines.append(
            f"model {result['model']}, {result['dtype']}, vLLM {result['vllm_version']} vs mini-vLLM, "
            f"{result['threads']} compute thread(s) each"
        )
    else:
        lines.append(f"model {result['model']}, {result['dtype']}")
    for run in result["runs"]:
        lines.append("")
        lines.append(f"block size {run['block_size']}, pool of {run['num_blocks']} blocks")
        lines.append(
            "  per request (call:prompt, both counted from 0 in the workload): prompt tokens, num_cached_tokens, "
            "greedy tokens equal?"
        )
        header = f"  {'workload':<24} {'request':>9} {'prompt':>6} {'cached mini':>11} {'cached vLLM':>11} {'tokens equal':>12}"
        lines.append(header)
        for workload in run["workloads"]:
            for position, row in enumerate(workload["rows"]):
                name = workload["name"] if position == 0 else ""
                request = f"{row['call']}:{row['index']}" + (f" n={row['n']}" if row["n"] > 1 else "")
                mark = (
                    ""
                    if row["cached_equal"]
                    else ("  (n>1: vLLM reports the last sample)" if row["n"] > 1 else "  <- differs")
                )
                lines.append(
                    f"  {name:<24} {request:>9} {row['num_prompt_tokens']:>6} {row['mini_cached']:>11} "
                    f"{row['vllm_cached']:>11} {_yes(row['tokens_equal']):>12}{mark}"
                )
        lines.append("")
        lines.append("  per workload: prefix-cache counters (tokens), preemptions, all equal?")
        lines.append(
            f"  {'workload':<24} {'queries mini/vLLM':>19} {'hits mini/vLLM':>15} {'preempt':>8} {'equal':>6}"
            + (f" {'TTFT ms mini/vLLM':>18} {'tok/s mini/vLLM':>16}" if timings else "")
        )
        for workload in run["workloads"]:
            mini, real = workload["mini"], workload["vllm"]
            equal = workload["counters_equal"] and workload["cached_equal"] and workload["tokens_equal"]
            line = (
                f"  {workload['name']:<24} {mini['prefix_cache_queries']:>9}/{real['prefix_cache_queries']:<9} "
                f"{mini['prefix_cache_hits']:>7}/{real['prefix_cache_hits']:<7} "
                f"{mini['num_preemptions']:>3}/{real['num_preemptions']:<4} {_yes(equal):>6}"
            )
            if timings:
                line += (
                    f" {mini['ttft_mean_ms'] or 0:>8.1f}/{real['ttft_mean_ms'] or 0:<9.1f}"
                    f" {mini['throughput_tok_s'] or 0:>7.0f}/{real['throughput_tok_s'] or 0:<8.0f}"
                )
            lines.append(line)
    return "\n".join(lines)


def format_timings(result: dict) -> str:
    """Mean TTFT and throughput per workload, both engines (these vary from run to run)."""
    lines = [f"{result['threads']} compute thread(s) per engine; TTFT = arrival -> first token, mean over requests"]
    lines.append(
        f"  {'block':>5} {'workload':<24} {'TTFT ms mini':>12} {'TTFT ms vLLM':>12} {'tok/s mini':>10} {'tok/s vLLM':>10}"
    )
    for run in result["runs"]:
        for workload in run["workloads"]:
            mini, real = workload["mini"], workload["vllm"]
            lines.append(
                f"  {run['block_size']:>5} {workload['name']:<24} {mini['ttft_mean_ms'] or 0:>12.1f} "
                f"{real['ttft_mean_ms'] or 0:>12.1f} {mini['throughput_tok_s'] or 0:>10.0f} {real['throughput_tok_s'] or 0:>10.0f}"
            )
    return "\n".join(lines)
