"""Drive vLLM's real ``KVCacheManager`` with a list of calls; print what it did (the differential test).

Run with the Python of a virtualenv that has vLLM (``.venv-vllm``, made by
``make vllm``): it imports only vLLM and the standard library, never
mini-vLLM. ``tests/vs_vllm/test_vs_vllm_kv_cache_manager.py`` sends it, on stdin, a
JSON object ``{"workloads": [...]}``; each workload is

    {"num_blocks": N, "block_size": B, "enable_caching": bool, "ops": [op, ...]}

(plus ``"sliding_window": W`` for a hybrid model: see below), and each op
one call a scheduler would make:

* ``{"op": "add", "rid", "tokens", "salt"}`` - a new request (salt may be null);
* ``{"op": "admit", "rid", "max_new_tokens"}`` - ``get_computed_blocks``, then
  ``allocate_slots`` for at most ``max_new_tokens`` of the rest; on success the
  scheduler's bookkeeping: ``record_prefix_cache_stats``, ``num_computed_tokens``;
* ``{"op": "alloc", "rid", "num_new_tokens", "num_lookahead_tokens"}`` - a running
  request's next chunk or decode token;
* ``{"op": "append", "rid", "tokens"}`` - sampled tokens (a block they fill gets a hash);
* ``{"op": "free", "rid"}``, ``{"op": "preempt", "rid"}``, ``{"op": "reset"}``.

It prints one JSON list per workload: a snapshot after every op, in
mini-vLLM's numbering (vLLM's block 0 is its null block, so vLLM id - 1, and
the null block is -1 as in mini-vLLM).

A workload with ``"groups": [None | W, ...]`` drives a *hybrid* model
(``tests/vs_vllm/test_vs_vllm_hybrid_kv_cache_manager.py``): one KV-cache group
per entry over one pool, in that order, full attention (None) or a sliding
window of ``W`` tokens (``"sliding_window": W`` alone: ``[None, W]``), with
``"retention_interval"`` as ``prefix_cache_retention_interval`` (default 0,
vLLM's engine default from ``CacheConfig``; the ``KVCacheConfig`` dataclass
alone would default to None, dense caching). With ``"events": true`` the
manager records KV events and every snapshot has ``"events"``, those of the op,
one entry per block (``flat_events``). Then every hit, new-block list and block table is one
list per group, each hashed block is reported with its group
(``[hash, group]``: vLLM's key is the hash followed by the group id in 4
bytes), the prefix-cache map as ``[hash, group, block]`` and an admission
also reports the ``shared_prefix_boundary`` that ``get_computed_blocks``
returned (the driver stores it in ``request.shared_prefix_boundary`` before
``allocate_slots``, as vLLM's scheduler does).
"""

from __future__ import annotations

import json
import sys


def _make_manager(
    num_blocks: int, block_size: int, enable_caching: bool, groups=None, retention_interval=0, events=False
):
    """vLLM's manager over ``num_blocks`` blocks (+ its null block); ``groups``: per KV-cache group, in order,
    None for full attention or a sliding window in tokens (None: one full-attention group)."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    def spec(window):
        if window is None:
            return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
        return SlidingWindowSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=window
        )

    if groups is None:
        config = KVCacheConfig(
            num_blocks=num_blocks + 1,  # + vLLM's null block
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec(None))],
        )
    else:
        config = KVCacheConfig(
            num_blocks=num_blocks + 1,  # + vLLM's null block
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], spec(window)) for i, window in enumerate(groups)],
            # The engine's default is CacheConfig.prefix_cache_retention_interval = 0: a
            # sliding-window group caches only the blocks a later hit can resume from.
            prefix_cache_retention_interval=retention_interval,
        )
    return KVCacheManager(
        kv_cache_config=config,
        max_model_len=1 << 16,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=enable_caching,
        enable_kv_cache_events=events,
        log_stats=True,
    )


def _ids(blocks) -> list[int]:
    """vLLM block ids in mini-vLLM's numbering (vLLM's null block 0 becomes -1, mini-vLLM's null block)."""
    return [block.block_id - 1 for block in blocks]


def _snapshot(manager, requests: dict, result: dict, hybrid: bool = False) -> dict:
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

    def hashed(key):  # a map key / block hash: the hash, and in a hybrid model its group too
        return [get_block_hash(key).hex(), get_group_id(key)] if hybrid else get_block_hash(key).hex()

    pool = manager.block_pool
    cached = []
    for key, entry in pool.cached_block_hash_to_block._cache.items():
        blocks = [entry] if not isinstance(entry, dict) else list(entry.values())
        for block in blocks:
            cached.append([*hashed(key), block.block_id - 1] if hybrid else [hashed(key), block.block_id - 1])
    stats = manager.prefix_cache_stats
    tables = {}
    for rid in requests:
        by_group = manager.get_block_ids(rid)
        if hybrid:
            if any(by_group):
                tables[rid] = [[block_id - 1 for block_id in ids] for ids in by_group]
        elif by_group[0]:
            tables[rid] = [block_id - 1 for block_id in by_group[0]]
    return {
        **result,
        "free_queue": [block.block_id - 1 for block in pool.free_block_queue.get_all_free_blocks()],
        "ref_cnt": [block.ref_cnt for block in pool.blocks[1:]],
        "block_hashes": [None if block.block_hash is None else hashed(block.block_hash) for block in pool.blocks[1:]],
        "cached": sorted(cached),
        "tables": tables,
        "request_hashes": {rid: [h.hex() for h in request.block_hashes] for rid, request in requests.items()},
        "stats": [
            stats.requests,
            stats.queries,
            stats.hits,
            stats.preempted_requests,
            stats.preempted_queries,
            stats.preempted_hits,
            stats.reset,
        ],
    }


def run_workload(workload: dict) -> list[dict]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request, RequestStatus

    block_size = workload["block_size"]
    groups = workload.get("groups")
    if groups is None and workload.get("sliding_window") is not None:
        groups = [None, workload["sliding_window"]]
    hybrid = groups is not None
    retention_interval = workload.get("retention_interval", 0)
    events = workload.get("events", False)
    manager = _make_manager(
        workload["num_blocks"], block_size, workload["enable_caching"], groups, retention_interval, events
    )
    if hybrid and workload["enable_caching"]:  # what the comparison means to test, still there
        coordinator = manager.coordinator
        expected = "HybridKVCacheCoordinator" if len(groups) > 1 else "UnitaryKVCacheCoordinator"
        assert type(coordinator).__name__ == expected, type(coordinator)
        assert coordinator.retention_interval == retention_interval, coordinator.retention_interval
    hasher = get_request_block_hasher(block_size, sha256)
    requests: dict = {}
    snapshots = []
    for op in workload["ops"]:
        kind = op["op"]
        result: dict = {"op": kind}
        if kind == "add":
            requests[op["rid"]] = Request(
                request_id=op["rid"],
                prompt_token_ids=list(op["tokens"]),
                sampling_params=SamplingParams(max_tokens=1 << 20),
                pooling_params=None,
                cache_salt=op["salt"],
                block_hasher=hasher,
            )
        elif kind == "admit":
            request = requests[op["rid"]]
            hits, num_hit_tokens, shared_prefix_boundary = manager.get_computed_blocks(request)
            # The scheduler keeps the junction on the request; cache_blocks reads it there.
            request.shared_prefix_boundary = shared_prefix_boundary
            num_new_tokens = min(request.num_tokens - num_hit_tokens, op["max_new_tokens"])
            new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
            result["hit_tokens"] = num_hit_tokens
            if hybrid:
                result["hit_ids"] = [_ids(group) for group in hits.blocks]
                result["shared_prefix_boundary"] = shared_prefix_boundary
            else:
                result["hit_ids"] = _ids(hits.blocks[0])
            if new_blocks is None:
                result["new_ids"] = None
            else:
                result["new_ids"] = _new_ids(new_blocks, hybrid)
                manager.record_prefix_cache_stats(request, num_hit_tokens)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_hit_tokens + num_new_tokens
        elif kind == "alloc":
            request = requests[op["rid"]]
            new_blocks = manager.allocate_slots(
                request, op["num_new_tokens"], num_lookahead_tokens=op["num_lookahead_tokens"]
            )
            if new_blocks is None:
                result["new_ids"] = None
            else:
                result["new_ids"] = _new_ids(new_blocks, hybrid)
                request.num_computed_tokens += op["num_new_tokens"]
        elif kind == "append":
            requests[op["rid"]].append_output_token_ids(list(op["tokens"]))
        elif kind == "free":
            manager.free(requests.pop(op["rid"]))
        elif kind == "preempt":
            request = requests[op["rid"]]
            manager.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_preemptions += 1
        elif kind == "reset":
            result["reset"] = manager.reset_prefix_cache()
        else:
            raise ValueError(f"unknown op {kind!r}")
        if events:
            result["events"] = flat_events(manager.take_events())
        snapshots.append(_snapshot(manager, requests, result, hybrid))
    return snapshots


def flat_events(events) -> list[list]:
    """KV events one block at a time: ``[kind, hash's last 64 bits, group]`` (``["AllBlocksCleared"]``).

    vLLM sends a sliding-window group's cached blocks in one ``BlockStored`` per
    call, mini-vLLM one per run of consecutive blocks: one entry per block
    compares what both say, in order.
    """
    flat = []
    for event in events:
        kind = type(event).__name__
        hashes = getattr(event, "block_hashes", None)
        if hashes is None:
            flat.append([kind])
            continue
        # vLLM may send a hash as its last 64 bits, an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): compare those.
        flat += [
            [kind, h if isinstance(h, int) else int.from_bytes(h, "big") & (2**64 - 1), event.group_idx] for h in hashes
        ]
    return flat


def _new_ids(new_blocks, hybrid: bool):
    """``allocate_slots``' new blocks: one list per group in a hybrid model, else group 0's."""
    by_group = [[block_id - 1 for block_id in ids] for ids in new_blocks.get_block_ids()]
    return by_group if hybrid else by_group[0]


def main() -> None:
    import logging

    logging.disable(logging.WARNING)
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    payload = json.load(sys.stdin)
    import vllm

    out = {"vllm_version": vllm.__version__, "results": [run_workload(w) for w in payload["workloads"]]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
