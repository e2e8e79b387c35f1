"""Differential test: mini-vLLM's CPU offloading tier against vLLM 0.33's own ``CPUOffloadingManager``, call for call.

Seeded random workloads, half with LRU and half with ARC, on tiers of 2 to 8
chunks so that eviction, refusal (``prepare_store`` -> None) and ghost hits
happen, are generated against mini-vLLM's ``CPUOffloadingManager``: up to
three requests at once, each over a prefix of one of a few shared hash chains
(some with a second KV-cache group's keys, some without key positions), that
look their keys up, load the leading hits (touching the first few instead, as
the pool's own hits are), offer their blocks for storing a few at a time or
all again, complete loads and stores (a store fails now and then) in any
order, finish with transfers still in flight, and drain the events; now and
then the tier is reset. The same op lists then go, in one subprocess for all
workloads, to ``mini_vllm/tools/vllm_side/offloading_manager_driver.py``
running in ``.venv-vllm`` with vLLM 0.33.0's Python files first on its path.
After every op both sides must agree on: the call's result (lookup results,
chunk ids, ``keys_to_store``, the evicted keys, None, the events with their
medium), every resident key's chunk id and ref_cnt, and the policy's order
(LRU: each key's rank; ARC: t1, t2, b1, b2 and ``target_t1_size``).

vLLM's manager is run with its default ``store_threshold=1``, which
mini-vLLM's is (see ``mini_vllm/kv_offload/cpu_manager.py``). Only 0.33.0
runs: ``vllm/v1/kv_offload`` is that release's (the installed 0.32's request-
scoped accesses differ). Skipped with the reason without ``.venv-vllm`` or
the release's files, failed instead under CI.

Time: making the workloads and comparing take about 2 s, vLLM's side well
under a second; the rest is the driver importing vLLM's manager (torch and
the connector's metrics come with it): 20 s on an idle 2-core machine, 50 s
on a busy one.
"""

from __future__ import annotations

import functools
import hashlib
import random

import pytest

from mini_vllm.kv_offload import ARCCachePolicy, CPUOffloadingManager, LRUCachePolicy, ReqContext, make_offload_key
from mini_vllm.kv_offload.cpu_manager import CACHE_POLICIES
from mini_vllm.tools import paths
from mini_vllm.tools.vllm_side.offloading_manager_driver import apply_op
from prerequisites import missing, under_ci
from test_vs_vllm_kv_cache_manager import VLLM_PYTHON, DriverRun, release_source

DRIVER = paths.VLLM_SIDE_DIR / "offloading_manager_driver.py"
RELEASE = "0.33.0"
NUM_WORKLOADS = 40
NUM_OPS = 120
BLOCK_SIZE = 16  # tokens per block: a key's position is the end of its block


# -- the mini-vLLM side ---------------------------------------------------------------
class MiniSide:
    """Applies the driver's ops to mini-vLLM's CPUOffloadingManager and snapshots it the same way."""

    def __init__(self, workload: dict, manager_class=CPUOffloadingManager) -> None:
        self.manager = manager_class(workload["num_chunks"], workload["cache_policy"], enable_events=True)
        self.contexts: dict[str, ReqContext] = {}

    def apply(self, op: dict):
        """The driver's own dispatch (``apply_op``), on mini-vLLM's manager."""
        return apply_op(self.manager, self.contexts, op, ReqContext, lambda spec: spec.chunk_ids)

    def snapshot(self, result) -> dict:
        policy = self.manager.policy
        if isinstance(policy, ARCCachePolicy):
            order = {
                "t1": [key.hex() for key in policy.t1],
                "t2": [key.hex() for key in policy.t2],
                "b1": [key.hex() for key in policy.b1],
                "b2": [key.hex() for key in policy.b2],
                "target_t1_size": policy.target_t1_size,
            }
        else:
            order = {"ranks": {key.hex(): list(rank) for key, rank in policy.ranks.items()}}
        resident = {key.hex(): list(chunk) for key, chunk in self.manager.resident().items()}
        return {"result": result, "resident": resident, "policy": order}

    def do(self, op: dict):
        """Apply ``op``; return its result and the snapshot after it (as the driver prints it)."""
        result = self.apply(op)
        return result, self.snapshot(result)


# -- the workloads ---------------------------------------------------------------------
def make_workload(seed: int) -> dict:
    """A random workload: its ops are chosen by what mini-vLLM's tier answers along the way."""
    rng = random.Random(seed)
    workload = {"num_chunks": rng.choice([2, 3, 4, 6, 8]), "cache_policy": ("lru", "arc")[seed % 2], "ops": []}
    side = MiniSide(workload)

    def key(chain: int, index: int, group: int) -> str:
        block_hash = hashlib.sha256(f"{seed}/{chain}/{index}".encode()).digest()[:8]
        return make_offload_key(block_hash, group).hex()

    requests: dict[str, dict] = {}  # rid -> {"keys", "looked_up", "offered", "finished"}
    loads: list[tuple[str, list[str]]] = []  # in flight: (rid, keys)
    stores: list[tuple[str, list[str]]] = []
    next_rid = 0

    def do(op: dict):
        workload["ops"].append(op)
        return side.do(op)[0]

    while len(workload["ops"]) < NUM_OPS:
        active = [rid for rid, r in requests.items() if not r["finished"]]
        choice = rng.random()
        if not active or (choice < 0.15 and len(active) < 3):
            rid, next_rid = f"r{next_rid}", next_rid + 1
            chain, length = rng.randrange(3), rng.randint(1, 6)
            groups = (0, 1) if rng.random() < 0.25 else (0,)
            keys = [key(chain, index, group) for index in range(length) for group in groups]
            with_positions = rng.random() < 0.8
            positions = {k: (i // len(groups) + 1) * BLOCK_SIZE for i, k in enumerate(keys)} if with_positions else {}
            requests[rid] = {"keys": keys, "looked_up": False, "offered": 0, "finished": False}
            do({"op": "new", "rid": rid, "positions": positions})
            continue
        rid = rng.choice(active)
        request = requests[rid]
        if not request["looked_up"]:  # a new request's lookup, then the loads of its leading hits
            request["looked_up"] = True
            results = do({"op": "lookup", "rid": rid, "keys": request["keys"]})
            hits = 0
            while hits < len(results) and results[hits] == "HIT":
                hits += 1
            in_pool = rng.randint(0, hits)  # the pool's own hits: touched, not loaded
            if in_pool:
                do({"op": "touch", "rid": rid, "keys": request["keys"][:in_pool]})
            if hits > in_pool:
                to_load = request["keys"][in_pool:hits]
                do({"op": "prepare_load", "rid": rid, "keys": to_load})
                loads.append((rid, to_load))
        elif choice < 0.45:  # offer the next blocks computed, or all of them again
            if request["offered"] < len(request["keys"]) and rng.random() < 0.8:
                start = request["offered"]
                request["offered"] = min(len(request["keys"]), start + rng.randint(1, 3))
                offered = request["keys"][start : request["offered"]]
            else:
                offered = request["keys"][: max(1, request["offered"])]
            output = do({"op": "prepare_store", "rid": rid, "keys": offered})
            if output is not None and output["keys_to_store"]:
                stores.append((rid, output["keys_to_store"]))
        elif choice < 0.6 and stores:
            done_rid, keys = stores.pop(rng.randrange(len(stores)))
            do({"op": "complete_store", "rid": done_rid, "keys": keys, "success": rng.random() < 0.8})
        elif choice < 0.72 and loads:
            done_rid, keys = loads.pop(rng.randrange(len(loads)))
            do({"op": "complete_load", "rid": done_rid, "keys": keys})
        elif choice < 0.8:
            request["finished"] = True
            do({"op": "finish", "rid": rid})
        elif choice < 0.9:
            do({"op": "events"})
        elif choice < 0.93:
            start = rng.randrange(len(request["keys"]))
            do({"op": "touch", "rid": rid, "keys": request["keys"][start:]})
        elif choice < 0.95:
            # vLLM's scheduler never completes a transfer started before a reset.
            loads.clear()
            stores.clear()
            do({"op": "reset"})
        elif stores:  # a store finishing after its request did
            done_rid, keys = stores.pop(0)
            do({"op": "complete_store", "rid": done_rid, "keys": keys, "success": True})
    do({"op": "events"})
    return workload


@functools.cache
def workloads() -> list[dict]:
    """The workloads, made once, when a test first needs them (not when pytest collects this file)."""
    return [make_workload(seed) for seed in range(NUM_WORKLOADS)]


def first_difference(workload: dict, vllm_snapshots: list[dict], manager_class=CPUOffloadingManager):
    """(op index, op, {field: (mini-vLLM, vLLM)}) for the first op after which the two differ, else None."""
    side = MiniSide(workload, manager_class)
    for index, (op, theirs) in enumerate(zip(workload["ops"], vllm_snapshots, strict=True)):
        try:
            ours = side.do(op)[1]
        except (ValueError, RuntimeError) as error:
            ours = {"error": f"{type(error).__name__}: {error}"}
        if ours != theirs:
            fields = sorted(set(ours) | set(theirs))
            return index, op, {f: (ours.get(f), theirs.get(f)) for f in fields if ours.get(f) != theirs.get(f)}
    return None


@pytest.fixture(scope="module")
def vllm_results():
    if not VLLM_PYTHON.exists():
        missing("vllm", "no .venv-vllm: run `make vllm` to install vLLM for the differential test")
    results = DriverRun(release_source(RELEASE, ci=under_ci()), workloads(), driver=DRIVER).result()
    # The snapshots must be that release's, not .venv-vllm's own vLLM found instead.
    assert results["vllm_version"] == RELEASE, results["vllm_version"]
    return results["results"]


def test_the_workloads_cover_what_they_should():
    """Eviction, refusal, failed stores, ghost hits, pinned chunks, resets, both policies: all happen somewhere."""
    seen = {"evicted": 0, "refused": 0, "failed_store": 0, "loaded": 0, "reset": 0, "two_groups": 0, "no_positions": 0}
    ghost_hits = 0
    for workload in workloads():
        side = MiniSide(workload)
        for op in workload["ops"]:
            target = getattr(side.manager.policy, "target_t1_size", 0)
            result = side.do(op)[0]
            ghost_hits += getattr(side.manager.policy, "target_t1_size", 0) != target
            if op["op"] == "prepare_store":
                seen["refused"] += result is None
                seen["evicted"] += bool(result and result["evicted_keys"])
            seen["failed_store"] += op["op"] == "complete_store" and not op["success"]
            seen["loaded"] += op["op"] == "prepare_load"
            seen["reset"] += op["op"] == "reset"
            if op["op"] == "new":
                seen["no_positions"] += not op["positions"]
                seen["two_groups"] += any(key.endswith("00000001") for key in op["positions"])
    assert {policy for policy in CACHE_POLICIES} == {w["cache_policy"] for w in workloads()}
    assert all(count >= 3 for count in seen.values()), seen
    assert ghost_hits >= 3


@pytest.mark.parametrize("index", range(NUM_WORKLOADS))
def test_mini_vllm_matches_vllms_offloading_manager(vllm_results, index):
    workload = workloads()[index]
    assert len(vllm_results[index]) == len(workload["ops"]), vllm_results[index][-1]
    assert first_difference(workload, vllm_results[index]) is None


# -- the comparison catches a wrong tier ---------------------------------------------------
class LRUEvictingTheNewest(LRUCachePolicy):
    def evict(self, n, protected):
        candidates = sorted(((self.ranks[k], k) for k in self.evictable if k not in protected), reverse=True)
        if len(candidates) < n:
            return None
        evicted = [(key, self.chunks[key]) for _, key in candidates[:n]]
        for key, _ in evicted:
            self.remove(key)
        return evicted


class ARCWithoutGhosts(ARCCachePolicy):
    def on_store_miss(self, keys, req_context):
        pass


class LRUHeadFirst(LRUCachePolicy):
    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        for keys in key_groups:
            self._use(keys)  # head first: the tail ends up the most recent


class ManagerCountingStoresAsReuse(CPUOffloadingManager):
    def on_request_finished(self, req_context):
        access = req_context.notes.get(self)
        if access is not None:
            access.reused_keys |= access.inserted_keys
        super().on_request_finished(req_context)


def manager_with(policy_class):
    class Manager(CPUOffloadingManager):
        def __init__(self, num_chunks, cache_policy, enable_events):
            super().__init__(num_chunks, cache_policy, enable_events)
            if isinstance(self.policy, policy_class.__mro__[1]):
                self.policy = policy_class(num_chunks)

    return Manager


@pytest.mark.parametrize(
    "wrong",
    [
        manager_with(LRUEvictingTheNewest),
        manager_with(ARCWithoutGhosts),
        manager_with(LRUHeadFirst),
        ManagerCountingStoresAsReuse,
    ],
    ids=["lru-evicts-newest", "arc-without-ghosts", "lru-head-first", "stores-counted-as-reuse"],
)
def test_the_comparison_catches_a_wrong_tier(vllm_results, wrong):
    assert any(first_difference(w, r, wrong) is not None for w, r in zip(workloads(), vllm_results, strict=True))
