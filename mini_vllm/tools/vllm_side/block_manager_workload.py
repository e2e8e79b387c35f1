"""The block-manager benchmark's workload, written once for both managers.

``mini_vllm.tools.bench.block_manager_round`` runs it on mini-vLLM's
``KVCacheManager``; ``benchmarks/block_manager_vllm.py`` runs it, inside vLLM's
virtualenv, on vLLM's own. Like everything in ``vllm_side/`` it imports only the
standard library, so both sides time the very same calls.

The workload: requests of 64 blocks of 16 tokens whose first 48 blocks are a
shared prefix, each admitted (lookup + allocate), then decoded for 16 steps
(append a token + allocate a slot); at most 32 requests are alive, the oldest
is freed. Both managers' ``get_computed_blocks`` / ``allocate_slots`` / ``free``
take the same arguments for this.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
PREFIX_BLOCKS = 48
REQUEST_BLOCKS = 64
DECODE_STEPS = 16
MAX_LIVE = 32


def run_workload(
    manager: Any, new_request: Callable[[str, list[int]], Any], num_requests: int, seed: int = 0
) -> dict[str, float]:
    """One pass on ``manager``; the median microseconds of each operation.

    ``new_request(request_id, token_ids)`` builds a request whose block hashes
    are computed (that is the timed "build").
    """
    rng = random.Random(seed)
    shared = [rng.randrange(50_000) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
    timings: dict[str, list[float]] = {"build": [], "admit": [], "free": [], "append": [], "decode_alloc": []}
    live = []
    clock = time.perf_counter
    for i in range(num_requests):
        tokens = shared + [rng.randrange(50_000) for _ in range((REQUEST_BLOCKS - PREFIX_BLOCKS) * BLOCK_SIZE)]
        t0 = clock()
        request = new_request(f"r{i}", tokens)
        t1 = clock()
        hits, num_hit_tokens = manager.get_computed_blocks(request)[:2]
        manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
        request.num_computed_tokens = request.num_tokens
        t2 = clock()
        timings["build"].append(t1 - t0)
        timings["admit"].append(t2 - t1)
        for _ in range(DECODE_STEPS):
            t3 = clock()
            request.append_output_token_ids(rng.randrange(50_000))
            t4 = clock()
            manager.allocate_slots(request, 1)
            request.num_computed_tokens += 1
            t5 = clock()
            timings["append"].append(t4 - t3)
            timings["decode_alloc"].append(t5 - t4)
        live.append(request)
        if len(live) > MAX_LIVE:
            old = live.pop(0)
            t6 = clock()
            manager.free(old)
            timings["free"].append(clock() - t6)
    for request in live:
        manager.free(request)
    return {name: 1e6 * statistics.median(values) for name, values in timings.items()}
