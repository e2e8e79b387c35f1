"""Differential test: mini-vLLM's KVCacheManager against vLLM's real one, call for call.

Seeded random workloads (pool sizes, block sizes 4 and 16, cache salts incl.
the empty one, chunked prefill, decode with lookahead slots, preemption,
failed allocations, prefix-cache resets, caching off) are generated against
mini-vLLM's ``KVCacheManager``; the same op lists then go, in one subprocess
for all workloads, to ``mini_vllm/tools/vllm_side/kv_cache_manager_driver.py`` running in
``.venv-vllm`` (``make vllm``), which drives vLLM's real ``KVCacheManager``.
After every op both sides must agree on: the hit (tokens and block ids), the
new block ids, the free queue's order, every block's ref count and hash, the
block tables, the prefix-cache map (hash bytes -> block), every request's
block hashes (bytes) and the prefix-cache counters (``requests``,
``queries``, ``hits``, ``preempted_*``, ``reset``).

Which vLLM runs: both of these, each test once per release:

* ``installed``: the one in ``.venv-vllm`` (vLLM 0.32.0, the newest CPU build);
* ``0.33.0``, the course's reference: that release's own Python files, from its
  wheel (``benchmarks/get_vllm_source.sh``, which ``make test-unit`` runs
  first, puts them in ``.vllm-0.33.0/src``), imported by ``.venv-vllm``'s
  Python with ``PYTHONPATH`` pointing there; its compiled kernels are
  deleted, the KV-cache manager is plain Python.

In the code these calls reach the two releases do not differ: 0.32 -> 0.33
changed ``vllm/v1/core`` only for null-block handling in
``touch``/``free_blocks`` (the null block is never in a full-attention table
here), hash lookahead for speculative decoding (``num_hash_lookahead_tokens``,
off by default) and EAGLE / Mamba / sliding window paths;
``FreeKVCacheBlockQueue``, ``free_blocks``' order, ``hash_block_tokens``,
``NONE_HASH`` and ``PrefixCacheStats`` are identical. Running both keeps it so.

Documented, intended differences, mapped before comparing:

* vLLM reserves block 0 as its null block: vLLM block id = mini-vLLM id + 1,
  and a pool of N blocks is vLLM's N + 1.
* vLLM's scheduler calls ``record_prefix_cache_stats`` after a successful
  admission; mini-vLLM's ``allocate_slots`` makes that call itself (the driver
  makes it on the vLLM side, where the scheduler would).

Skipped, with the reason, when ``.venv-vllm`` is missing. The 0.33.0 run is
skipped, with the fetch's reason, when its files could not be fetched (no
network), except under CI (``CI=true``), where that fails the test instead.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
from pathlib import Path

import pytest

from known_mistakes import free_one_at_a_time

from mini_vllm.block_pool import BlockPool
from mini_vllm.tools import paths
from mini_vllm.kv_cache_manager import KVCacheManager
from mini_vllm.request import Request
from prerequisites import missing, under_ci

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = paths.VLLM_SIDE_DIR / "kv_cache_manager_driver.py"
NUM_WORKLOADS = 40
# "installed": .venv-vllm's own vLLM; a version: that release's wheel files (benchmarks/get_vllm_source.sh).
VLLM_RELEASES = ["installed", "0.33.0"]


# -- the mini-vLLM side ---------------------------------------------------------------
class MiniSide:
    """Applies the driver's ops to mini-vLLM's KVCacheManager and snapshots it the same way."""

    def __init__(self, workload: dict, manager_class=KVCacheManager) -> None:
        self.block_size = workload["block_size"]
        self.manager = manager_class(workload["num_blocks"], self.block_size, workload["enable_caching"])
        self.requests: dict[str, Request] = {}

    def apply(self, op: dict) -> dict:
        manager, kind = self.manager, op["op"]
        result: dict = {"op": kind}
        if kind == "add":
            self.requests[op["rid"]] = Request(op["rid"], op["tokens"], self.block_size, cache_salt=op["salt"])
        elif kind == "admit":
            request = self.requests[op["rid"]]
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_hit_tokens, op["max_new_tokens"])
            new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
            result["hit_tokens"] = num_hit_tokens
            (hit_blocks,) = hits.blocks  # one KV-cache group: the driver reports vLLM's group 0
            result["hit_ids"] = [block.block_id for block in hit_blocks]
            result["new_ids"] = None if new_blocks is None else new_blocks.get_block_ids()[0]
            if new_blocks is not None:
                request.num_computed_tokens = num_hit_tokens + num_new_tokens
        elif kind == "alloc":
            request = self.requests[op["rid"]]
            new_blocks = manager.allocate_slots(
                request, op["num_new_tokens"], num_lookahead_tokens=op["num_lookahead_tokens"]
            )
            result["new_ids"] = None if new_blocks is None else new_blocks.get_block_ids()[0]
            if new_blocks is not None:
                request.num_computed_tokens += op["num_new_tokens"]
        elif kind == "append":
            self.requests[op["rid"]].append_output_token_ids(op["tokens"])
        elif kind == "free":
            manager.free(self.requests.pop(op["rid"]))
        elif kind == "preempt":
            request = self.requests[op["rid"]]
            manager.free(request)
            request.num_computed_tokens = 0
            request.num_preemptions += 1
        elif kind == "reset":
            result["reset"] = manager.reset_prefix_cache()
        manager.check_invariants()
        return {**result, **self.snapshot()}

    def snapshot(self) -> dict:
        cache = self.manager.snapshot()
        pool, stats = cache.block_pool, cache.prefix_cache_stats
        return {
            "free_queue": list(pool.free_block_queue),
            "ref_cnt": [block.ref_cnt for block in pool.blocks],
            "block_hashes": [None if block.block_hash is None else block.block_hash.hex() for block in pool.blocks],
            "cached": sorted(
                [h.hex(), block_id]
                for h, block_ids in pool.cached_block_hash_to_block.items()
                for block_id in block_ids
            ),
            "tables": {rid: list(ids) for rid in self.requests if (ids := cache.get_block_ids(rid))},
            "request_hashes": {rid: [h.hex() for h in r.block_hashes] for rid, r in self.requests.items()},
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


# -- seeded random workloads ------------------------------------------------------------
def make_workload(seed: int) -> dict:
    """A scheduler-like random call sequence, decided against mini-vLLM's state as it goes."""
    rng = random.Random(seed)
    block_size = rng.choice([4, 16])
    workload = {
        "seed": seed,
        "block_size": block_size,
        "num_blocks": rng.randint(3, 20),
        "enable_caching": seed % 8 != 7,
        "ops": [],
    }
    side = MiniSide(workload)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(1, 4) * block_size)] for _ in range(3)]
    waiting: list[str] = []
    running: list[str] = []
    num_added = 0

    def do(op: dict) -> dict:
        workload["ops"].append(op)
        return side.apply(op)

    for _ in range(rng.randint(40, 90)):
        action = rng.random()
        if action < 0.2 and num_added < 12:
            rid = f"r{num_added}"
            num_added += 1
            tokens = list(rng.choice(prefixes))[: rng.randint(0, 4 * block_size)]
            tokens += [rng.randrange(1000) for _ in range(rng.randint(1, 2 * block_size))]
            do({"op": "add", "rid": rid, "tokens": tokens, "salt": rng.choice([None, None, "", "t1", "t2"])})
            waiting.append(rid)
        elif action < 0.45 and waiting:
            rid = waiting[0]
            budget = rng.choice([1 << 20, rng.randint(1, 3 * block_size)])  # sometimes chunked
            if do({"op": "admit", "rid": rid, "max_new_tokens": budget})["new_ids"] is not None:
                running.append(waiting.pop(0))
        elif action < 0.8 and running:
            rid = rng.choice(running)
            request = side.requests[rid]
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining == 0:  # prefill done: sample a token, then decode it
                do({"op": "append", "rid": rid, "tokens": [rng.randrange(1000)]})
                op = {"op": "alloc", "rid": rid, "num_new_tokens": 1, "num_lookahead_tokens": rng.choice([0, 0, 2, 5])}
            else:  # the next prefill chunk
                op = {"op": "alloc", "rid": rid, "num_new_tokens": rng.randint(1, remaining), "num_lookahead_tokens": 0}
            if do(op)["new_ids"] is None:  # the pool is full: preempt it, as the scheduler would
                do({"op": "preempt", "rid": rid})
                running.remove(rid)
                waiting.insert(0, rid)
        elif action < 0.93 and running:
            rid = running.pop(rng.randrange(len(running)))
            do({"op": "free", "rid": rid})
        elif action >= 0.93:
            do({"op": "reset"})
    for rid in running:
        do({"op": "free", "rid": rid})
    do({"op": "reset"})
    return workload


WORKLOADS = [make_workload(seed) for seed in range(NUM_WORKLOADS)]


def first_difference(workload: dict, vllm_snapshots: list[dict], manager_class=KVCacheManager):
    """Replay ``workload`` on mini-vLLM; the first op whose snapshot differs from vLLM's, or None."""
    side = MiniSide(workload, manager_class)
    assert len(vllm_snapshots) == len(workload["ops"])
    for index, (op, theirs) in enumerate(zip(workload["ops"], vllm_snapshots)):
        ours = side.apply(op)
        if ours != theirs:
            fields = sorted(key for key in set(ours) | set(theirs) if ours.get(key) != theirs.get(key))
            return index, op, {key: (ours.get(key), theirs.get(key)) for key in fields}
    return None


def release_source(version: str, ci: bool, root: Path = ROOT) -> Path:
    """``.vllm-<version>/src``, fetched by ``benchmarks/get_vllm_source.sh``; skip (fail under CI) without it."""
    dest = root / f".vllm-{version}"
    if (dest / ".complete").exists():
        return dest / "src"
    unavailable = dest / ".unavailable"
    why = unavailable.read_text().strip() if unavailable.exists() else "it was not fetched"
    message = (
        f"vLLM {version}'s Python files are not in {dest}: {why} (run bash benchmarks/get_vllm_source.sh {version})"
    )
    if ci:
        pytest.fail(f"under CI the differential test must run against vLLM {version}: {message}")
    pytest.skip(message)


class DriverRun:
    """The driver (default: ``DRIVER``), started on every workload (default: ``WORKLOADS``) by .venv-vllm's Python.

    ``result()`` waits for it. On ``pythonpath``'s vLLM if given, else on the one installed there. Its
    input and output go through temporary files, so that several runs (one
    per release) can go on at once without filling a pipe.
    """

    def __init__(self, pythonpath: Path | None, workloads: list[dict] | None = None, driver: Path = DRIVER) -> None:
        # PYTHONHASHSEED, if set, passes through: both sides derive NONE_HASH from it the same way.
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        if pythonpath is not None:
            env["PYTHONPATH"] = str(pythonpath)
        self.stdin, self.stdout, self.stderr = (tempfile.TemporaryFile("w+") for _ in range(3))
        json.dump({"workloads": WORKLOADS if workloads is None else workloads}, self.stdin)
        self.stdin.seek(0)
        self.process = subprocess.Popen(
            [str(VLLM_PYTHON), str(driver)], stdin=self.stdin, stdout=self.stdout, stderr=self.stderr, env=env
        )

    def result(self) -> dict:
        try:
            returncode = self.process.wait(timeout=600)
            self.stderr.seek(0)
            assert returncode == 0, self.stderr.read()[-3000:]
            self.stdout.seek(0)
            return json.load(self.stdout)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the driver if it still runs, and drop its files."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for file in (self.stdin, self.stdout, self.stderr):
            file.close()


def run_driver(pythonpath: Path | None, workloads: list[dict] | None = None) -> dict:
    """The driver's snapshots of every workload (default: ``WORKLOADS``), run by .venv-vllm's Python (see DriverRun)."""
    return DriverRun(pythonpath, workloads).result()


@pytest.fixture(scope="module", params=VLLM_RELEASES)
def vllm_results(request):
    if not VLLM_PYTHON.exists():
        missing("vllm", "no .venv-vllm: run `make vllm` to install vLLM for the differential test")
    if request.param == "installed":
        return run_driver(None)
    results = run_driver(release_source(request.param, ci=under_ci()))
    # The snapshots must be that release's, not .venv-vllm's own vLLM found instead.
    assert results["vllm_version"] == request.param, results["vllm_version"]
    return results


def test_a_missing_release_skips_locally_and_fails_under_ci(tmp_path):
    (tmp_path / ".vllm-9.9.9").mkdir()
    (tmp_path / ".vllm-9.9.9" / ".unavailable").write_text("pip download vllm==9.9.9 failed (no network)\n")
    with pytest.raises(pytest.skip.Exception, match="no network"):
        release_source("9.9.9", ci=False, root=tmp_path)
    with pytest.raises(pytest.fail.Exception, match="under CI .* must run against vLLM 9.9.9: .*no network"):
        release_source("9.9.9", ci=True, root=tmp_path)
    (tmp_path / ".vllm-9.9.9" / ".complete").touch()
    assert release_source("9.9.9", ci=True, root=tmp_path) == tmp_path / ".vllm-9.9.9" / "src"


def test_the_workloads_cover_what_they_should():
    ops = [op for w in WORKLOADS for op in w["ops"]]
    kinds = {op["op"] for op in ops}
    assert kinds == {"add", "admit", "alloc", "append", "free", "preempt", "reset"}
    assert {w["block_size"] for w in WORKLOADS} == {4, 16}
    assert any(not w["enable_caching"] for w in WORKLOADS)
    assert {op["salt"] for op in ops if op["op"] == "add"} >= {None, "", "t1"}
    assert any(op["op"] == "alloc" and op["num_lookahead_tokens"] for op in ops)
    replays = [MiniSide(w) for w in WORKLOADS]
    outcomes = [side.apply(op) for side, w in zip(replays, WORKLOADS) for op in w["ops"]]
    assert any(o["op"] == "admit" and o["new_ids"] is None for o in outcomes)  # failed allocations
    assert any(o["op"] == "admit" and o["hit_tokens"] > 0 for o in outcomes)  # real hits
    assert any(o["op"] == "reset" and o["reset"] for o in outcomes)
    assert any(o["op"] == "reset" and not o["reset"] for o in outcomes)


@pytest.mark.parametrize("index", range(NUM_WORKLOADS))
def test_mini_vllm_matches_vllms_kv_cache_manager(vllm_results, index):
    workload = WORKLOADS[index]
    difference = first_difference(workload, vllm_results["results"][index])
    assert difference is None, (
        f"vLLM {vllm_results['vllm_version']}, workload seed {workload['seed']} "
        f"(block_size {workload['block_size']}, {workload['num_blocks']} blocks): op #{difference[0]} "
        f"{difference[1]} differs (mini-vLLM, vLLM): {difference[2]}"
    )


class _OneAtATimeFreePool(BlockPool):
    """A known-wrong pool: unhashed blocks go to the head one by one, which reverses them."""

    def free_blocks(self, ordered_blocks):
        free_one_at_a_time(self, ordered_blocks)


class _WrongFreeOrderManager(KVCacheManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.block_pool.__class__ = _OneAtATimeFreePool


class _EveryLookupCountsManager(KVCacheManager):
    """A known-wrong manager: counts every lookup, as mini-vLLM did before."""

    def get_computed_blocks(self, request):
        blocks, num_tokens = super().get_computed_blocks(request)
        self.prefix_cache_stats.record(request.num_tokens, num_tokens, preempted=False)
        return blocks, num_tokens

    def record_prefix_cache_stats(self, request, num_hits):
        pass


@pytest.mark.parametrize("wrong", [_WrongFreeOrderManager, _EveryLookupCountsManager])
def test_the_comparison_catches_a_wrong_manager(vllm_results, wrong):
    caught = [
        first_difference(workload, snapshots, wrong) for workload, snapshots in zip(WORKLOADS, vllm_results["results"])
    ]
    assert any(difference is not None for difference in caught)
