"""KV-cache offloading on this machine: hit rate against pool size with and without the tier, and a load against a miss.

    OMP_NUM_THREADS=1 python benchmarks/kv_offloading.py [--quick] [--json benchmarks/results/kv_offloading.json]

Prints two tables and writes them as JSON (``mini_vllm/tools/offloading_bench.py``
says what each number is). The hit rates are counts: the same on every
machine. The timings are ratios taken within each round, engines alternating
which goes first, reported as the median over rounds with their range.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from mini_vllm.tools.offloading_bench import hit_rates, load_vs_recompute, prefix_workload


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload and 3 rounds")
    parser.add_argument("--json", default="benchmarks/results/kv_offloading.json", help="where the results go")
    args = parser.parse_args(argv)
    num_prefixes, prefix_len, rounds = (8, 64, 2) if args.quick else (16, 128, 3)
    pool_sizes = [16, 32, 64, 128] if args.quick else [16, 32, 64, 128, 256]
    prompts = prefix_workload(num_prefixes, prefix_len, suffix_len=8, num_rounds=rounds)
    rows = hit_rates(prompts, pool_sizes, device="cpu", max_num_seqs=1)
    print(f"{num_prefixes} prefixes of {prefix_len} tokens (+8 of their own), {rounds} rounds, one request at a time")
    print(f"{'pool blocks':>11} {'hit rate, pool only':>20} {'with the tier':>14} {'of which the tier':>18}")
    for row in rows:
        print(
            f"{row.num_blocks:>11} {row.hit_rate_pool:>20.2f} {row.hit_rate_with_tier:>14.2f} {row.tier_share:>18.2f}"
        )
    timing = load_vs_recompute(
        prefix_len=256 if args.quick else 512, num_rounds=3 if args.quick else 9, device="cpu", max_num_seqs=1
    )
    low, high = timing["miss_over_tier_hit_range"]
    print(
        f"\none request of {timing['prefix_len'] + timing['suffix_len']} tokens, its prefix evicted from the pool "
        f"(cached tokens: {timing['cached_tokens']}):"
    )
    print(f"  miss / tier hit:     {timing['miss_over_tier_hit']:.1f}x  (range {low:.1f} - {high:.1f})")
    low, high = timing["tier_hit_over_pool_hit_range"]
    print(f"  tier hit / pool hit: {timing['tier_hit_over_pool_hit']:.2f}x (range {low:.2f} - {high:.2f})")
    results = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/kv_offloading.py" + (" --quick" if args.quick else ""),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        "hit_rates": {
            "num_prefixes": num_prefixes,
            "prefix_len": prefix_len,
            "num_rounds": rounds,
            "rows": [row.__dict__ for row in rows],
        },
        "load_vs_recompute": timing,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwritten: {path}")
    return results


if __name__ == "__main__":
    main()
