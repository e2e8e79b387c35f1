"""The block-manager benchmark of ``python -m mini_vllm bench``, run on vLLM's own ``KVCacheManager``.

Run it with a Python in which ``import vllm`` works (the one ``make vllm``
builds, or any vLLM install; a source tree on ``PYTHONPATH`` works too, the
manager needs none of vLLM's compiled parts)::

    .venv-vllm/bin/python benchmarks/block_manager_vllm.py --requests 400 --rounds 5

It prints one JSON object: vLLM's version and the median microseconds of each
operation, with the same names as ``mini_vllm.tools.bench.bench_block_manager``. The
workload is the same one: a pool of 4096 blocks of 16 tokens, requests of 64
blocks whose first 48 are a shared prefix, 16 decode steps each, at most 32
requests alive (the oldest is freed). SHA-256 block hashes (vLLM's default),
no KV events, no statistics. ``mini_vllm.tools.bench`` calls this script in a
subprocess and interleaves its rounds with mini-vLLM's own.

Constructor arguments changed between vLLM releases; only those the installed
version accepts are passed (checked with ``inspect.signature``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

# The workload itself, shared with mini_vllm.tools.bench; it imports only the standard
# library, so it is loaded by path (importing the mini_vllm package would need torch).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mini_vllm" / "tools" / "vllm_side"))
from block_manager_workload import BLOCK_SIZE, DECODE_STEPS, NUM_BLOCKS, REQUEST_BLOCKS, run_workload  # noqa: E402


def _accepted(function, **kwargs) -> dict:
    """The keyword arguments that ``function`` accepts."""
    parameters = inspect.signature(function).parameters
    return {name: value for name, value in kwargs.items() if name in parameters}


def make_manager():
    """A vLLM ``KVCacheManager`` for one full-attention group, as vLLM's unit tests build it."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        **_accepted(FullAttentionSpec, block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    )
    config = KVCacheConfig(
        **_accepted(
            KVCacheConfig,
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
    )
    return KVCacheManager(
        **_accepted(
            KVCacheManager.__init__,
            kv_cache_config=config,
            max_model_len=REQUEST_BLOCKS * BLOCK_SIZE * 2,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=True,
        )
    )


def make_request_factory():
    """``new_request(request_id, token_ids)`` -> a vLLM ``Request`` whose block hashes are SHA-256."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256)
    hasher_kwargs = _accepted(
        kv_cache_utils.get_request_block_hasher, hash_block_size=BLOCK_SIZE, block_size=BLOCK_SIZE
    )
    block_hasher = kv_cache_utils.get_request_block_hasher(caching_hash_fn=sha256, **hasher_kwargs)
    params = SamplingParams(max_tokens=DECODE_STEPS + 1)

    def new_request(request_id: str, token_ids: list[int]):
        return Request(
            **_accepted(
                Request.__init__,
                request_id=request_id,
                prompt_token_ids=token_ids,
                sampling_params=params,
                pooling_params=None,
                eos_token_id=None,
                block_hasher=block_hasher,
            )
        )

    return new_request


def run_round(num_requests: int, seed: int = 0) -> dict[str, float]:
    """One pass of the workload on a fresh manager; median microseconds per operation."""
    return run_workload(make_manager(), make_request_factory(), num_requests, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=1, help="rounds, one JSON line each (the caller takes medians)")
    parser.add_argument(
        "--serve",
        action="store_true",
        help="read a number of requests per line on stdin, answer one JSON line per round (lets the caller interleave)",
    )
    args = parser.parse_args()
    # This script's folder holds benchmarks/kernels.py, which would shadow the
    # ``kernels`` module some packages probe for: keep it off the import path.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [entry for entry in sys.path if str(Path(entry or ".").resolve()) != here]
    import vllm

    def report(round_index: int, num_requests: int) -> None:
        result = {
            "vllm_version": vllm.__version__,
            "round": round_index,
            "us": run_round(num_requests, seed=round_index),
        }
        print(json.dumps(result), flush=True)

    if args.serve:
        print(json.dumps({"vllm_version": vllm.__version__, "ready": True}), flush=True)
        for round_index, line in enumerate(sys.stdin):
            if not line.strip():
                break
            report(round_index, int(line))
        return
    for round_index in range(args.rounds):
        report(round_index, args.requests)


if __name__ == "__main__":
    main()
