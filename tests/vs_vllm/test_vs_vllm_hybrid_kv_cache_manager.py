"""Differential test of a hybrid model's KV cache: mini-vLLM's KVCacheManager against vLLM's, call for call.

The hybrid sibling of ``tests/vs_vllm/test_vs_vllm_kv_cache_manager.py`` (same
driver, same releases, same skips): two KV-cache groups over one pool,
group 0 full attention and group 1 a sliding window of ``W`` tokens, with
block sizes 4 and 16 and ``W`` in {2 blocks, 3 blocks + 1 token, 7 tokens}
(a hit needs ``cdiv(W - 1, block_size)`` cached blocks in a row: 2, 3, 2
or 1). Then the layouts vLLM 0.33 groups into more groups or one
(``LAYOUTS``, grouped by ``make_kv_cache_config``: 2:1, Gemma 3's 5:1, every
layer sliding, a padded layout, two full-attention groups, two windows),
each under ``prefix_cache_retention_interval`` 0 and under None or 4 blocks. On the vLLM side ``mini_vllm/tools/vllm_side/kv_cache_manager_driver.py``
builds vLLM's ``KVCacheConfig`` with a ``FullAttentionSpec`` and a
``SlidingWindowSpec`` group and the engine's default
``prefix_cache_retention_interval=0`` (so vLLM's ``KVCacheManager`` runs
the ``HybridKVCacheCoordinator``), and stores ``get_computed_blocks``' third
value in ``request.shared_prefix_boundary`` before ``allocate_slots``, as
vLLM's scheduler does.

One scripted workload per configuration tells the junction story step by
step (``scripted_workload``); seeded random workloads then cover:
prompts several windows long; families of
prompts that share a long prefix and diverge at the same token (the second
finds a junction, ``shared_prefix_boundary``, and pins the sliding-window
blocks there; the third then hits them); prompts that extend an earlier
prompt (the sliding-window group shares only the window of blocks under that
prompt's replay boundary); repeated prompts; chunked prefill and decode
steps that move the window (blocks freed mid-request, null in their place);
preemption; failed allocations and evictions under pool pressure; resets;
caching off; cache salts. After every op both sides must agree on: the hit
(tokens, and block ids per group with the null block), the
``shared_prefix_boundary`` of a lookup, the new block ids per group, the
block tables per group (with nulls), the free queue's order, every block's
ref count, hash and group, the prefix-cache map (per group: hash -> block;
vLLM keys it by the hash followed by the 4-byte group id), every request's
block hashes and the prefix-cache counters.

Which vLLM runs: as in the single-group test, the installed 0.32.0 and
0.33.0's own files, each test once per release (both drivers start at once).
Their hybrid paths do the same in these calls (read in the diff of
``vllm/v1/core`` and checked by running both): 0.32's ``touch`` and
``free_blocks`` keep a reference count on the null block, which 0.33 skips,
and 0.32's ``pop_blocks_for_free`` hands a sliding-window table's leading
nulls to ``free_blocks``, which 0.33 trims first; both only move the null
block's own count, and the null block (vLLM's block 0) never enters the
free queue and is left out of the snapshots. The rest of that diff is EAGLE
and hash-lookahead paths, off here, and a cap of the blocks to cache at
``len(request.block_hashes)``, a no-op when hashes are per block.

Documented, intended differences, mapped before comparing: vLLM's block 0 is
its null block (vLLM id = mini-vLLM id + 1; the null block is -1 on both
sides after mapping), and vLLM keys its map by hash + group id where
mini-vLLM keys by the hash and picks the block of the group.

Skipped, with the reason, when ``.venv-vllm`` is missing; the 0.33.0 run is
skipped when its files could not be fetched, except under CI (``CI=true``),
where both fail instead (``tests/prerequisites.py``).
"""

from __future__ import annotations

import functools
import random

import pytest

from known_mistakes import cache_every_full_block, sliding_window_hit_from_the_left

from mini_vllm.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)
from mini_vllm.kv_cache_manager import KVCacheManager
from mini_vllm.request import Request
from prerequisites import missing, under_ci
from test_vs_vllm_kv_cache_manager import ROOT, VLLM_PYTHON, VLLM_RELEASES, DriverRun, release_source

from mini_vllm.tools import paths
from mini_vllm.tools.vllm_side.kv_cache_manager_driver import flat_events

GROUPS_DRIVER = paths.VLLM_SIDE_DIR / "kv_cache_groups_driver.py"

# (block_size, sliding_window): two blocks, three blocks and a token, and 7 tokens.
CONFIGS = [(4, 8), (4, 13), (4, 7), (16, 32), (16, 49), (16, 7)]
NUM_RANDOM_WORKLOADS = 36
NULL = -1  # the null block's id, on both sides after mapping


# Layouts of layers (s: sliding window, f: full attention), grouped by make_kv_cache_config as vLLM 0.33
# groups them: 2:1 (three groups), Gemma 3's 5:1 (six), every layer sliding (one sliding-window group),
# 6 sliding + 4 full (groups of 4, both sliding groups padded: at the manager, three groups), 2 full : 1
# sliding (two full-attention groups looked up together) and two windows (two sliding specs: the lookup
# runs to its fixed point). With a retention interval of 0 (the default), then None (every block) or N > 0.
LAYOUTS = ["ssf" * 3, "sssssf" * 2, "ssss", "sssff" * 2, "ffs" * 2, "fSs"]
RETENTIONS = [0, None, "4 blocks"]
NUM_LAYOUT_WORKLOADS = 2 * len(LAYOUTS)  # each layout under retention 0, then under None or 4 blocks (in turn)


def layout_groups(layout: str, sliding_window: int, block_size: int) -> list[int | None]:
    """Per KV-cache group, None (full attention) or its window, for a layout ("S": a second, longer window)."""
    windows = {"f": None, "s": sliding_window, "S": sliding_window + 2 * block_size}
    config = make_kv_cache_config([windows[kind] for kind in layout], block_size, 1)
    return [getattr(group.kv_cache_spec, "sliding_window", None) for group in config.kv_cache_groups]


def hybrid_config(num_blocks: int, block_size: int, groups: list[int | None]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks,
        tuple(
            KVCacheGroupSpec(
                (i,), FullAttentionSpec(block_size) if window is None else SlidingWindowSpec(block_size, window)
            )
            for i, window in enumerate(groups)
        ),
    )


def make_manager(workload: dict, manager_class: type[KVCacheManager] = KVCacheManager, **parts) -> KVCacheManager:
    num_blocks, block_size = workload["num_blocks"], workload["block_size"]
    config = hybrid_config(num_blocks, block_size, workload["groups"])
    return manager_class(
        num_blocks,
        block_size,
        workload["enable_caching"],
        workload.get("events", False),
        kv_cache_config=config,
        prefix_cache_retention_interval=workload["retention_interval"],
        **parts,
    )


# -- the mini-vLLM side ---------------------------------------------------------------
def _ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


class HybridMiniSide:
    """Applies the driver's ops to a hybrid mini-vLLM KVCacheManager and snapshots it as the driver does."""

    def __init__(self, workload: dict, make=make_manager) -> None:
        self.block_size = workload["block_size"]
        self.manager = make(workload)
        self.requests: dict[str, Request] = {}

    def apply(self, op: dict) -> dict:
        manager, kind = self.manager, op["op"]
        result: dict = {"op": kind}
        if kind == "add":
            self.requests[op["rid"]] = Request(op["rid"], op["tokens"], self.block_size, cache_salt=op["salt"])
        elif kind == "admit":
            request = self.requests[op["rid"]]
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            result["hit_tokens"] = num_hit_tokens
            result["hit_ids"] = [_ids(group) for group in hits.blocks]
            result["shared_prefix_boundary"] = manager.shared_prefix_boundary.get(request.request_id, 0)
            num_new_tokens = min(request.num_tokens - num_hit_tokens, op["max_new_tokens"])
            new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
            result["new_ids"] = None if new_blocks is None else [_ids(group) for group in new_blocks.blocks]
            if new_blocks is not None:
                request.num_computed_tokens = num_hit_tokens + num_new_tokens
        elif kind == "alloc":
            request = self.requests[op["rid"]]
            new_blocks = manager.allocate_slots(
                request, op["num_new_tokens"], num_lookahead_tokens=op["num_lookahead_tokens"]
            )
            result["new_ids"] = None if new_blocks is None else [_ids(group) for group in new_blocks.blocks]
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
        if self.manager.block_pool.enable_kv_cache_events:
            result["events"] = flat_events(manager.take_events())
        return {**result, **self.snapshot()}

    def snapshot(self) -> dict:
        cache = self.manager.snapshot()
        pool, stats = cache.block_pool, cache.prefix_cache_stats
        return {
            "free_queue": list(pool.free_block_queue),
            "ref_cnt": [block.ref_cnt for block in pool.blocks],
            "block_hashes": [
                None if block.block_hash is None else [block.block_hash.hex(), block.kv_cache_group_id]
                for block in pool.blocks
            ],
            "cached": sorted(
                [h.hex(), pool.blocks[block_id].kv_cache_group_id, block_id]
                for h, block_ids in pool.cached_block_hash_to_block.items()
                for block_id in block_ids
            ),
            "tables": {
                rid: [list(table) for table in tables]
                for rid in self.requests
                if any(tables := cache.get_block_ids_by_group(rid))
            },
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
def make_workload(seed: int, layout: str = "sf", retention_interval: int | str | None = 0) -> dict:
    """A scheduler-like random call sequence over prompt families, decided against mini-vLLM's state as it goes."""
    rng = random.Random(seed)
    block_size, sliding_window = CONFIGS[seed % len(CONFIGS)]
    groups = layout_groups(layout, sliding_window, block_size)
    if retention_interval == "4 blocks":
        retention_interval = 4 * block_size
    workload = {
        "seed": seed if layout == "sf" else f"{layout}-{retention_interval}-{seed}",
        "block_size": block_size,
        "sliding_window": sliding_window,
        "groups": groups,
        "retention_interval": retention_interval,
        # Each group holds its own table: room for a few requests in every group.
        "num_blocks": rng.randint(8, 36) * max(1, (len(groups) + 1) // 2),
        "enable_caching": seed % 9 != 8,
        "events": layout != "sf",  # the layouts compare the KV events, block by block, with their group
        "ops": [],
    }
    side = HybridMiniSide(workload)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000) for _ in range(n)]

    # Families: a long base prompt and two points where its siblings diverge (one on a block boundary).
    families = []
    for _ in range(3):
        base = tokens(rng.randint(3, 7) * block_size + rng.randrange(block_size))
        cuts = [rng.randint(2, len(base) // block_size) * block_size, rng.randint(block_size + 1, len(base))]
        families.append((base, cuts))
    prompts: list[list[int]] = []
    waiting: list[str] = []
    running: list[str] = []
    num_added = 0

    def do(op: dict) -> dict:
        workload["ops"].append(op)
        return side.apply(op)

    def new_prompt() -> list[int]:
        kind = rng.random()
        if kind < 0.15 or not prompts:  # unrelated, often longer than the window
            return tokens(rng.randint(1, 6 * block_size))
        if kind < 0.3:  # a repeated prompt: hits under its replay boundary
            return list(rng.choice(prompts))
        if kind < 0.45:  # an earlier prompt and more: the window under its boundary is shared
            return list(rng.choice(prompts)) + tokens(rng.randint(1, 3 * block_size))
        base, cuts = rng.choice(families)  # a sibling: shares the base up to a cut, then diverges
        return base[: rng.choice(cuts)] + tokens(rng.randint(1, 2 * block_size))

    for _ in range(rng.randint(50, 100)):
        action = rng.random()
        if action < 0.2 and num_added < 14:
            rid = f"r{num_added}"
            num_added += 1
            prompt = new_prompt()
            prompts.append(prompt)
            salt = rng.choice([None] * 6 + ["", "t1"])
            do({"op": "add", "rid": rid, "tokens": prompt, "salt": salt})
            waiting.append(rid)
        elif action < 0.45 and waiting:
            rid = waiting[0]
            budget = rng.choice([1 << 20, rng.randint(1, 3 * block_size)])  # sometimes chunked
            if do({"op": "admit", "rid": rid, "max_new_tokens": budget})["new_ids"] is not None:
                running.append(waiting.pop(0))
        elif action < 0.85 and running:
            rid = rng.choice(running)
            request = side.requests[rid]
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining == 0:  # prefill done: sample a token, then decode it (the window moves on)
                do({"op": "append", "rid": rid, "tokens": [rng.randrange(1000)]})
                op = {"op": "alloc", "rid": rid, "num_new_tokens": 1, "num_lookahead_tokens": rng.choice([0, 0, 0, 3])}
            else:  # the next prefill chunk, often shorter than the window
                op = {"op": "alloc", "rid": rid, "num_new_tokens": rng.randint(1, remaining), "num_lookahead_tokens": 0}
            if do(op)["new_ids"] is None:  # the pool is full: preempt it, as the scheduler would
                do({"op": "preempt", "rid": rid})
                running.remove(rid)
                waiting.insert(0, rid)
        elif action < 0.96 and running:
            rid = running.pop(rng.randrange(len(running)))
            do({"op": "free", "rid": rid})
        elif action >= 0.96:
            do({"op": "reset"})
    for rid in running:
        do({"op": "free", "rid": rid})
    do({"op": "reset"})
    return workload


def scripted_workload(block_size: int, sliding_window: int) -> dict:
    """The junction story, step by step: a prompt, two siblings that diverge after its prefix, an extension, a resend.

    ``a`` is a 4-block prefix and more; ``b`` shares only the prefix: its
    lookup finds the full-attention blocks but no sliding-window run there
    (``a`` kept only the blocks under its own replay boundary), so it hits
    nothing and reports the junction (``shared_prefix_boundary`` = 4
    blocks), chunked-prefills and caches its window blocks there, and decodes
    until blocks leave its window; ``c``, the third sibling, hits the 4
    blocks in both groups. ``d`` extends ``a`` (the sliding-window group
    shares only the window under ``a``'s boundary), ``e`` resends ``a``.
    """
    rng = random.Random(block_size * 1000 + sliding_window)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000) for _ in range(n)]

    workload = {
        "seed": f"scripted-{block_size}-{sliding_window}",
        "block_size": block_size,
        "sliding_window": sliding_window,
        "groups": [None, sliding_window],
        "retention_interval": 0,
        "num_blocks": 40,
        "enable_caching": True,
        "ops": [],
    }
    side = HybridMiniSide(workload)

    def do(op: dict) -> dict:
        workload["ops"].append(op)
        return side.apply(op)

    def run(rid: str, prompt: list[int], chunk: int, num_decodes: int) -> None:
        """Admit ``rid``, prefill the rest of its prompt in chunks of ``chunk`` tokens, decode, free."""
        do({"op": "add", "rid": rid, "tokens": prompt, "salt": None})
        assert do({"op": "admit", "rid": rid, "max_new_tokens": chunk})["new_ids"] is not None
        request = side.requests[rid]
        while (remaining := request.num_tokens - request.num_computed_tokens) > 0:
            do({"op": "alloc", "rid": rid, "num_new_tokens": min(chunk, remaining), "num_lookahead_tokens": 0})
        for _ in range(num_decodes):
            do({"op": "append", "rid": rid, "tokens": [rng.randrange(1000)]})
            do({"op": "alloc", "rid": rid, "num_new_tokens": 1, "num_lookahead_tokens": 0})
        do({"op": "free", "rid": rid})

    prefix = tokens(4 * block_size)
    a = prefix + tokens(2 * block_size + 1)
    run("a", a, 1 << 20, 0)
    run("b", prefix + tokens(block_size + 2), block_size - 1, sliding_window + block_size)
    run("c", prefix + tokens(block_size + 3), 1 << 20, sliding_window)
    run("d", a + tokens(block_size), 1 << 20, 1)
    run("e", list(a), 1 << 20, 1)
    do({"op": "reset"})
    return workload


SCRIPTED = [scripted_workload(block_size, window) for block_size, window in CONFIGS]
RANDOM = [make_workload(seed) for seed in range(NUM_RANDOM_WORKLOADS)]
LAYOUT_WORKLOADS = [
    make_workload(100 + seed, LAYOUTS[seed % len(LAYOUTS)], RETENTIONS[0 if seed < len(LAYOUTS) else 1 + seed % 2])
    for seed in range(NUM_LAYOUT_WORKLOADS)
]
WORKLOADS = SCRIPTED + RANDOM + LAYOUT_WORKLOADS
NUM_WORKLOADS = len(WORKLOADS)


def first_difference(workload: dict, vllm_snapshots: list[dict], make=make_manager):
    """Replay ``workload`` on mini-vLLM; the first op whose snapshot differs from vLLM's, or None."""
    side = HybridMiniSide(workload, make)
    assert len(vllm_snapshots) == len(workload["ops"])
    for index, (op, theirs) in enumerate(zip(workload["ops"], vllm_snapshots)):
        ours = side.apply(op)
        if ours != theirs:
            fields = sorted(key for key in set(ours) | set(theirs) if ours.get(key) != theirs.get(key))
            return index, op, {key: (ours.get(key), theirs.get(key)) for key in fields}
    return None


@pytest.fixture(scope="module")
def driver_runs():
    """One driver run per release whose vLLM is there, all started at once (each mostly waits on importing vLLM)."""
    runs = {}
    if VLLM_PYTHON.exists():
        for release in VLLM_RELEASES:
            if release == "installed":
                runs[release] = DriverRun(None, WORKLOADS)
            elif (ROOT / f".vllm-{release}" / ".complete").exists():
                runs[release] = DriverRun(ROOT / f".vllm-{release}" / "src", WORKLOADS)
        if (ROOT / ".vllm-0.33.0" / ".complete").exists():  # the grouping, from kv_cache_planning.py (0.33 on)
            runs["grouping"] = DriverRun(ROOT / ".vllm-0.33.0" / "src", grouping_workloads(), driver=GROUPS_DRIVER)
    yield runs
    for run in runs.values():
        run.close()


@pytest.fixture(scope="module", params=VLLM_RELEASES)
def vllm_results(request, driver_runs):
    if not VLLM_PYTHON.exists():
        missing("vllm", "no .venv-vllm: run `make vllm` to install vLLM for the differential test")
    if request.param != "installed":
        release_source(request.param, ci=under_ci())  # skips (fails under CI) without that release's files
    results = driver_runs[request.param].result()
    # The snapshots must be that release's, not .venv-vllm's own vLLM found instead.
    assert request.param == "installed" or results["vllm_version"] == request.param, results["vllm_version"]
    return results


def test_the_workloads_cover_what_they_should():
    assert {(w["block_size"], w["sliding_window"]) for w in WORKLOADS} == set(CONFIGS)
    assert any(not w["enable_caching"] for w in WORKLOADS)
    ops = [op for w in WORKLOADS for op in w["ops"]]
    assert {op["op"] for op in ops} == {"add", "admit", "alloc", "append", "free", "preempt", "reset"}
    assert any(op["op"] == "alloc" and op["num_lookahead_tokens"] for op in ops)
    window_of = {w["seed"]: w["sliding_window"] for w in WORKLOADS}
    assert any(op["op"] == "add" and len(op["tokens"]) > 2 * window_of[w["seed"]] for w in WORKLOADS for op in w["ops"])
    junction_hits = 0
    evictions = 0
    covered: dict[str, bool] = {}
    for workload in RANDOM:  # the random 1:1 ones on their own (the scripted ones and the layouts: below)
        side = HybridMiniSide(workload)
        outcomes = [side.apply(op) for op in workload["ops"]]
        evictions += side.manager.num_evictions
        admits = [o for o in outcomes if o["op"] == "admit"]
        junctions = {o["shared_prefix_boundary"] for o in admits if o["shared_prefix_boundary"]}
        # A later lookup hits exactly at a junction an earlier one pinned (the third sibling).
        junction_hits += sum(1 for o in admits if o["hit_tokens"] and o["hit_tokens"] in junctions)
        seen = {
            "failed_admit": any(o["new_ids"] is None for o in admits),
            "failed_alloc": any(o["op"] == "alloc" and o["new_ids"] is None for o in outcomes),
            "hit": any(o["hit_tokens"] > 0 for o in admits),
            "null_in_hit": any(NULL in o["hit_ids"][1] for o in admits),
            "junction": bool(junctions),
            "null_in_table": any(NULL in tables[1] for o in outcomes for tables in o["tables"].values()),
            "reset": any(o["op"] == "reset" and o["reset"] for o in outcomes),
            "refused_reset": any(o["op"] == "reset" and not o["reset"] for o in outcomes),
            "sliding_cached": any(entry[1] == 1 for o in outcomes for entry in o["cached"]),
        }
        covered = {key: covered.get(key, False) or value for key, value in seen.items()}
    assert all(covered.values()), covered
    assert junction_hits > 0
    assert evictions > 0


def test_the_layout_workloads_cover_what_they_should():
    """Every layout hits, in every group; sliding-window blocks are cached under each retention setting."""
    hits: dict[str, int] = {}
    ratios: dict[str, list[float]] = {}  # per retention: blocks cached per sliding-window group / per full one
    for workload in LAYOUT_WORKLOADS:
        side = HybridMiniSide(workload)
        outcomes = [side.apply(op) for op in workload["ops"]]
        layout = workload["seed"].split("-")[0]
        full_hits = [o for o in outcomes if o["op"] == "admit" and o["hit_tokens"]]
        hits[layout] = hits.get(layout, 0) + len(full_hits)
        for o in full_hits:  # every group serves the hit: a list as long as it, real blocks at its end
            assert all(len(ids) * workload["block_size"] == o["hit_tokens"] and ids[-1] != NULL for ids in o["hit_ids"])
        sliding = {i for i, window in enumerate(workload["groups"]) if window is not None}
        full = set(range(len(workload["groups"]))) - sliding
        stored = [e[2] for o in outcomes for e in o["events"] if e[0] == "BlockStored"]
        if full and stored:
            per_full = sum(g in full for g in stored) / len(full)
            per_sliding = sum(g in sliding for g in stored) / len(sliding)
            ratios.setdefault(str(workload["retention_interval"]), []).append(per_sliding / per_full)
    assert all(hits.values()), hits
    # With every block cached (None) a sliding-window group stores as many blocks as a full one;
    # with retention 0 far fewer, with 4 blocks in between.
    assert min(ratios["None"]) > 0.9 and max(ratios["0"]) < min(ratios["None"]), ratios
    # The KV events name the group: stored and removed blocks of sliding-window groups past group 1.
    events = [e for w in LAYOUT_WORKLOADS for o in map(HybridMiniSide(w).apply, w["ops"]) for e in o["events"]]
    assert {e[0] for e in events} == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert any(e[0] == "BlockRemoved" and e[2] >= 2 for e in events) and any(e[2] >= 5 for e in events if len(e) > 1)


@pytest.mark.parametrize("workload", SCRIPTED, ids=lambda workload: workload["seed"])
def test_the_scripted_workloads_tell_the_junction_story(workload):
    """What ``scripted_workload`` says happens does happen (on mini-vLLM; the comparison checks vLLM agrees)."""
    block_size = workload["block_size"]
    need = -(-(workload["sliding_window"] - 1) // block_size)  # cached blocks in a row a hit needs
    side = HybridMiniSide(workload)
    admits, sliding_tables = {}, {}
    for op in workload["ops"]:
        outcome = side.apply(op)
        if op["op"] == "admit":
            admits[op["rid"]] = outcome
        for rid, tables in outcome["tables"].items():
            sliding_tables.setdefault(rid, []).append(tables[1])
    assert admits["b"]["hit_tokens"] == 0 and admits["b"]["shared_prefix_boundary"] == 4 * block_size
    assert any(NULL in table for table in sliding_tables["b"])  # decoding moved b's window on
    for rid, num_blocks in (("c", 4), ("d", 6), ("e", 6)):
        assert admits[rid]["hit_tokens"] == num_blocks * block_size, rid
        full, sliding = admits[rid]["hit_ids"]
        assert NULL not in full and len(full) == num_blocks, rid
        assert sliding[: num_blocks - need] == [NULL] * (num_blocks - need), rid
        assert NULL not in sliding[num_blocks - need :] and len(sliding) == num_blocks, rid


@pytest.mark.parametrize("index", range(NUM_WORKLOADS))
def test_mini_vllm_matches_vllms_hybrid_kv_cache_manager(vllm_results, index):
    workload = WORKLOADS[index]
    difference = first_difference(workload, vllm_results["results"][index])
    assert difference is None, (
        f"vLLM {vllm_results['vllm_version']}, workload seed {workload['seed']} "
        f"(block_size {workload['block_size']}, sliding_window {workload['sliding_window']}, "
        f"{workload['num_blocks']} blocks): op #{difference[0]} {difference[1]} differs (mini-vLLM, vLLM): "
        f"{difference[2]}"
    )


# -- known-wrong variants the comparison must catch --------------------------------------
def _lookup_from_the_left(workload: dict) -> KVCacheManager:
    """A sliding-window lookup that walks from block 0 and stops at the first miss, as full attention does."""
    return make_manager(workload, find_sliding_window_cache_hit=sliding_window_hit_from_the_left)


def _cache_every_sliding_block(workload: dict) -> KVCacheManager:
    """A sliding-window group that caches every full block, not just those under a boundary's window."""
    manager = make_manager(workload)
    for sliding in manager.sliding_window_managers:
        sliding.cacheable_block_mask = cache_every_full_block.__get__(sliding)
    return manager


class _NoJunctionManager(KVCacheManager):
    """A known-wrong manager: forgets the junction its lookup found, so only the replay boundary is cached."""

    def get_computed_blocks(self, request):
        blocks, num_tokens = super().get_computed_blocks(request)
        self.shared_prefix_boundary.pop(request.request_id, None)
        return blocks, num_tokens


def _forget_the_junction(workload: dict) -> KVCacheManager:
    return make_manager(workload, _NoJunctionManager)


def _one_group_at_a_time(workload: dict) -> KVCacheManager:
    """Groups that share a spec looked up one by one (each bounded by the last), not together."""
    manager = make_manager(workload)
    manager.spec_groups = tuple((group,) for group in manager.managers)
    manager.one_lookup_round = False
    return manager


@pytest.mark.parametrize(
    "wrong", [_lookup_from_the_left, _cache_every_sliding_block, _forget_the_junction, _one_group_at_a_time]
)
def test_the_comparison_catches_a_wrong_manager(vllm_results, wrong):
    caught = [
        first_difference(workload, snapshots, wrong) for workload, snapshots in zip(WORKLOADS, vllm_results["results"])
    ]
    assert any(difference is not None for difference in caught)


# -- the grouping: make_kv_cache_config against vLLM 0.33's kv_cache_planning.py ------------------
GROUPING_LAYOUTS = [
    "sf" * 15,  # gpt-oss, Gemma 2: two groups
    "ssf" * 10,  # three groups
    "sssssf" * 5,  # Gemma 3: six groups
    "s" * 30,  # Mistral-7B-v0.1: one sliding-window group
    "f" * 30,
    "s" * 12 + "f" * 13,  # under 1.5x: two groups of 13, the sliding one padded
    "sssff" * 6,  # groups of 12, the second sliding group padded
    "ffs" * 10,  # two full-attention groups
    "fSs" * 4,  # two windows
    "sssSf" * 3,
]


def grouping_workloads() -> list[dict]:
    windows = {"f": None, "s": 64, "S": 128}
    return [
        {"windows": [windows[kind] for kind in layout], "block_size": 16, "disable_hybrid_kv_cache_manager": off}
        for layout in GROUPING_LAYOUTS
        for off in (False, True)
    ]


def test_layers_are_grouped_as_vllm_0_33_groups_them(driver_runs):
    if not VLLM_PYTHON.exists():
        missing("vllm", "no .venv-vllm: run `make vllm` to install vLLM for the differential test")
    workloads = grouping_workloads()
    release_source("0.33.0", ci=under_ci())  # the grouping lives in kv_cache_planning.py from 0.33 on
    results = driver_runs["grouping"].result()  # started with the other drivers
    assert results["vllm_version"] == "0.33.0", results["vllm_version"]
    for workload, theirs in zip(workloads, results["results"]):
        make = functools.partial(
            make_kv_cache_config,
            workload["windows"],
            16,
            1,
            disable_hybrid_kv_cache_manager=workload["disable_hybrid_kv_cache_manager"],
        )
        if "error" in theirs:  # two windows with the hybrid manager off: one group cannot hold both
            with pytest.raises(ValueError, match="same window"):
                make()
            continue
        config = make()
        ours = [
            {"window": getattr(group.kv_cache_spec, "sliding_window", None), "layers": list(group.layer_ids)}
            for group in config.kv_cache_groups
        ]
        # mini-vLLM numbers the full-attention groups first; otherwise vLLM's order.
        assert ours == sorted(theirs, key=lambda group: group["window"] is not None), workload
