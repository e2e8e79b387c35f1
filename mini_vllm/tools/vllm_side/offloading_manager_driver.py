"""Drive vLLM's real ``CPUOffloadingManager`` with a list of calls; print what it did (the differential test).

Run with the Python of a virtualenv that has vLLM (``.venv-vllm``, made by
``make vllm``), with vLLM 0.33.0's Python files first on ``PYTHONPATH``
(``.vllm-0.33.0/src``, from ``benchmarks/get_vllm_source.sh``): it imports
only vLLM and the standard library, never mini-vLLM.
``tests/vs_vllm/test_vs_vllm_offloading_manager.py`` sends it, on stdin, a
JSON object ``{"workloads": [...]}``; each workload is

    {"num_chunks": N, "cache_policy": "lru" | "arc", "ops": [op, ...]}

and each op one call the offloading connector's scheduler side would make,
keys written in hex:

* ``{"op": "new", "rid", "positions": {key: end token}}`` - a request's
  ``ReqContext`` (with its keys' positions) and ``on_new_request``;
* ``{"op": "lookup", "rid", "keys"}``, ``{"op": "prepare_load", "rid", "keys"}``,
  ``{"op": "touch", "rid", "keys"}``, ``{"op": "complete_load", "rid", "keys"}``,
  ``{"op": "prepare_store", "rid", "keys"}``,
  ``{"op": "complete_store", "rid", "keys", "success"}``, ``{"op": "finish", "rid"}``
  (``on_request_finished``), ``{"op": "events"}`` (``take_events``), ``{"op": "reset"}``.

The calls are made by :func:`apply_op`, which the test also runs on mini-vLLM's manager (one
dispatch for both sides). It prints one JSON list per workload, a snapshot after every op: the call's
result, every resident key's chunk id and ref_cnt, and the policy's own order
(LRU: each key's rank; ARC: its four lists and ``target_t1_size``).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _hex(keys) -> list[str]:
    return [bytes(key).hex() for key in keys]


def apply_op(manager, contexts: dict, op: dict, new_context, chunk_ids) -> Any:
    """Make ``op``'s call on ``manager``; return its result as the JSON both sides compare.

    One dispatch for both managers: the test applies the same ops to mini-vLLM's
    ``CPUOffloadingManager`` with this function. Where the two differ, the caller says how:
    ``new_context(req_id=...)`` makes a request's ``ReqContext``, ``chunk_ids(spec)`` reads a
    load or store spec's chunk ids (vLLM calls them ``block_ids``, mini-vLLM ``chunk_ids``).
    ``contexts`` maps each request id to its ``ReqContext``.
    """
    name = op["op"]
    keys = [bytes.fromhex(key) for key in op.get("keys", [])]
    context = contexts.get(op.get("rid"))
    if name == "new":
        context = contexts[op["rid"]] = new_context(req_id=op["rid"])
        for key, position in op["positions"].items():
            context.set_offload_key_position(bytes.fromhex(key), position)
        manager.on_new_request(context)
        return None
    if name == "lookup":
        return [manager.lookup(key, context).name for key in keys]
    if name == "prepare_load":
        return chunk_ids(manager.prepare_load(keys, context))
    if name == "touch":
        return manager.touch(keys, context)
    if name == "complete_load":
        return manager.complete_load(keys, context)
    if name == "prepare_store":
        output = manager.prepare_store(keys, context)
        if output is None:
            return None
        return {
            "keys_to_store": _hex(output.keys_to_store),
            "chunk_ids": chunk_ids(output.store_spec),
            "evicted_keys": _hex(output.evicted_keys),
        }
    if name == "complete_store":
        return manager.complete_store(keys, context, success=op["success"])
    if name == "finish":
        return manager.on_request_finished(context)
    if name == "events":
        return [[_hex(e.keys), e.medium.value, e.removed, e.metadata_only] for e in manager.take_events()]
    if name == "reset":
        return manager.reset_cache()
    raise ValueError(f"unknown op {name!r}")


def _vllm_chunk_ids(spec) -> list[int]:
    return [int(chunk_id) for chunk_id in spec.block_ids]


def _snapshot(manager, result) -> dict:
    policy = manager._policy
    if hasattr(policy, "t1"):  # ARC
        order = {
            "t1": _hex(policy.t1),
            "t2": _hex(policy.t2),
            "b1": _hex(policy.b1),
            "b2": _hex(policy.b2),
            "target_t1_size": policy.target_t1_size,
        }
        chunks = {**policy.t1, **policy.t2}
    else:  # LRU
        order = {"ranks": {bytes(key).hex(): list(rank) for key, rank in policy._ranks.items()}}
        chunks = policy.chunks
    resident = {bytes(key).hex(): [int(chunk.chunk_id), int(chunk.ref_cnt)] for key, chunk in chunks.items()}
    return {"result": result, "resident": resident, "policy": order}


def run_workload(workload: dict) -> list[dict]:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from vllm.v1.kv_offload.base import ReqContext

    manager = CPUOffloadingManager(workload["num_chunks"], cache_policy=workload["cache_policy"], enable_events=True)
    contexts: dict = {}
    snapshots = []
    for op in workload["ops"]:
        try:
            result = apply_op(manager, contexts, op, ReqContext, _vllm_chunk_ids)
        except Exception as error:  # an invalid call: recorded, and the workload stops here
            snapshots.append({"error": f"{type(error).__name__}: {error}"})
            break
        snapshots.append(_snapshot(manager, result))
    return snapshots


def drive(run_workload) -> None:
    """Read the workloads from stdin, run each with ``run_workload``, write vLLM's version and the results to stdout."""
    import logging

    logging.disable(logging.WARNING)
    payload = json.load(sys.stdin)
    import vllm

    out = {"vllm_version": vllm.__version__, "results": [run_workload(w) for w in payload["workloads"]]}
    json.dump(out, sys.stdout)


def main() -> None:
    drive(run_workload)


if __name__ == "__main__":
    main()
