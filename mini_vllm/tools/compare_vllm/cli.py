"""``python -m mini_vllm compare-vllm [--model PATH] [--block-size N] [--workload NAME] [--json FILE]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import paths
from .harness import run_hybrid_side_by_side, run_matrix
from .references import write_references
from .tables import format_table
from .vllm_runner import vllm_missing_reason, vllm_python
from .workloads import DEFAULT_NUM_BLOCKS, WORKLOAD_NAMES, PromptDoesNotFit

DESCRIPTION = "mini-vLLM and real vLLM side by side: same prompts, same cache hits, same tokens."


def main(argv: list[str] | None = None) -> int:
    """``python -m mini_vllm compare-vllm``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mini_vllm compare-vllm", description=DESCRIPTION)
    parser.add_argument("--model", default=None, help="a local Hugging Face folder (default: the bundled model)")
    parser.add_argument(
        "--block-size",
        type=int,
        action="append",
        default=None,
        help="tokens per block, a multiple of 32 on a CPU (repeatable; default: 32 and 128)",
    )
    parser.add_argument(
        "--workload",
        action="append",
        default=None,
        choices=WORKLOAD_NAMES,
        help="one workload (repeatable; default: all)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="a prompt of your own (repeatable); without --workload only your prompts run",
    )
    parser.add_argument("--num-blocks", type=int, default=None, help=f"pool size (default {DEFAULT_NUM_BLOCKS})")
    parser.add_argument("--threads", type=int, default=1, help="compute threads for each engine (default 1)")
    parser.add_argument("--json", default=None, help="also write the full results to this file")
    parser.add_argument(
        "--write-references",
        action="store_true",
        help="re-run the chapters' comparisons and save them in benchmarks/reference_results/",
    )
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="the hybrid model (chapter 08b) and its workloads instead (block size 32; --model: another hybrid model)",
    )
    args = parser.parse_args(argv)
    bad_sizes = [size for size in args.block_size or () if size <= 0 or size % 32]
    if bad_sizes:
        parser.error(
            f"--block-size must be a positive multiple of 32 (vLLM's CPU backend refuses others), got {bad_sizes[0]}"
        )
    if args.prompt is not None and not all(args.prompt):
        parser.error("--prompt must not be empty")
    if vllm_python() is None:
        print(vllm_missing_reason())
        return 0
    if args.write_references:
        for path in write_references():
            print("wrote", path.relative_to(paths.REPO_ROOT))
        return 0
    if args.hybrid:
        result = run_hybrid_side_by_side(args.model, threads=args.threads)
    else:
        try:
            result = run_matrix(
                args.model,
                tuple(args.block_size or (32, 128)),
                args.workload,
                num_blocks=args.num_blocks,
                threads=args.threads,
                prompts=args.prompt,
            )
        except PromptDoesNotFit as error:  # found before either engine starts
            parser.error(str(error))
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    every = [w for run in result["runs"] for w in run["workloads"]]
    return 0 if all(w["counters_equal"] and w["tokens_equal"] for w in every) else 1


if __name__ == "__main__":
    sys.exit(main())
