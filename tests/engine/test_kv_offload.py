"""The CPU offloading tier's bookkeeping (``mini_vllm/kv_offload``), by hand-worked cases; no vLLM needed.

``tests/vs_vllm/test_vs_vllm_offloading_manager.py`` compares the same tier
with vLLM 0.33's on random workloads; these cases say what each rule is, one
at a time, and run in a second. The checks for eviction order are functions
of the manager, so that the last tests can show each one fails on a tier
with that rule broken.
"""

from __future__ import annotations

import pytest

from mini_vllm.kv_offload import (
    ARCCachePolicy,
    CPUOffloadingManager,
    LookupResult,
    LRUCachePolicy,
    Medium,
    OffloadingEvent,
    ReqContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def keys(*names: str, group: int = 0) -> list[bytes]:
    return [make_offload_key(name.encode(), group) for name in names]


def request(rid: str, chain: list[bytes], block_size: int = 16) -> ReqContext:
    """A request whose keys ``chain`` are a prefix, head first (positions as the scheduler records them)."""
    context = ReqContext(rid)
    for index, key in enumerate(chain):
        context.set_offload_key_position(key, (index + 1) * block_size)
    return context


def stored(manager: CPUOffloadingManager, chain: list[bytes], rid: str = "writer") -> ReqContext:
    """``chain`` stored (prepare, complete) and the storing request finished."""
    context = request(rid, chain)
    manager.on_new_request(context)
    output = manager.prepare_store(chain, context)
    manager.complete_store(output.keys_to_store, context)
    manager.on_request_finished(context)
    return context


def test_a_key_is_the_block_hash_and_its_group():
    key = make_offload_key(b"\x01\x02", 3)
    assert key == b"\x01\x02\x00\x00\x00\x03"
    assert (get_offload_block_hash(key), get_offload_group_idx(key)) == (b"\x01\x02", 3)
    assert make_offload_key(b"\x01\x02", 0) != key


def test_a_chunk_is_pending_while_stored_then_readable_then_pinned_while_loaded():
    manager = CPUOffloadingManager(4, enable_events=True)
    a, b = keys("a", "b")
    context = request("r", [a, b])
    output = manager.prepare_store([a, b], context)
    assert (output.keys_to_store, output.store_spec.chunk_ids, output.evicted_keys) == ([a, b], [0, 1], [])
    assert [manager.lookup(k, context) for k in (a, b)] == [PENDING, PENDING]
    assert manager.resident() == {a: (0, -1), b: (1, -1)}
    with pytest.raises(ValueError, match="not stored"):
        manager.prepare_load([a], context)

    manager.complete_store([a, b], context)
    assert [manager.lookup(k, context) for k in (a, b, *keys("c"))] == [HIT, HIT, MISS]
    assert manager.take_events() == [OffloadingEvent([a, b], Medium.CPU, removed=False)]
    assert manager.take_events() == []

    assert manager.prepare_load([a], context).chunk_ids == [0]
    assert manager.prepare_load([a], request("other", [a])).chunk_ids == [0]
    assert manager.resident()[a] == (0, 2)
    assert manager.num_evictable_chunks == 1  # only b
    manager.complete_load([a], context)
    manager.complete_load([a], context)
    assert manager.resident()[a] == (0, 0) and manager.num_evictable_chunks == 2
    with pytest.raises(ValueError, match="not being loaded"):
        manager.complete_load([a], context)


def test_a_store_that_cannot_evict_enough_is_refused_and_changes_nothing():
    manager = CPUOffloadingManager(2, enable_events=True)
    a, b, c, d = keys("a", "b", "c", "d")
    stored(manager, [a, b])
    manager.take_events()
    manager.prepare_load([a], request("reader", [a]))  # a is pinned: only b can go
    before = manager.resident()
    assert manager.prepare_store([c, d], request("r", [c, d])) is None
    assert manager.resident() == before and manager.take_events() == []
    # One block fits, by evicting b.
    output = manager.prepare_store([c], request("r2", [c]))
    assert (output.keys_to_store, output.store_spec.chunk_ids, output.evicted_keys) == ([c], [1], [b])
    assert manager.take_events() == [OffloadingEvent([b], Medium.CPU, removed=True)]


def test_keys_already_there_are_not_stored_again_nor_evicted_to_make_room():
    manager = CPUOffloadingManager(2)
    a, b, c = keys("a", "b", "c")
    stored(manager, [a, b])
    # a and b are idle and the oldest, but offered again with c: only c is new, and neither may leave for it.
    assert manager.prepare_store([a, b, c], request("r", [a, b, c])) is None
    output = manager.prepare_store([b], request("r2", [b]))
    assert output.keys_to_store == [] and output.evicted_keys == []


def test_a_failed_store_frees_its_chunk_and_says_so_unless_stored_again_since():
    manager = CPUOffloadingManager(2, enable_events=True)
    a, b = keys("a", "b")
    context = request("r", [a, b])
    manager.prepare_store([a, b], context)
    manager.complete_store([a, b], context, success=False)
    assert manager.resident() == {} and manager.free_chunk_ids == [0, 1]
    # Stored again before the events are taken: b is held again, so only a's removal is news.
    retry = request("retry", [b])
    assert manager.prepare_store([b], retry).store_spec.chunk_ids == [1]  # no fresh chunk left: the last one freed
    assert manager.take_events() == [OffloadingEvent([a], Medium.CPU, removed=True, metadata_only=True)]


def test_the_chunk_pool_hands_out_fresh_chunks_first_then_the_last_freed():
    manager = CPUOffloadingManager(3)
    a, b, c, d = keys("a", "b", "c", "d")
    context = request("r", [a, b, c])
    assert manager.prepare_store([a, b], context).store_spec.chunk_ids == [0, 1]
    manager.complete_store([a, b], context, success=False)  # frees 0, then 1
    assert manager.prepare_store([c, d], request("r2", [c, d])).store_spec.chunk_ids == [2, 1]


def test_reset_forgets_every_chunk_pinned_or_not():
    manager = CPUOffloadingManager(2)
    a, b = keys("a", "b")
    stored(manager, [a, b])
    manager.prepare_load([a], request("reader", [a]))
    manager.reset_cache()
    assert manager.resident() == {} and manager.num_free_chunks() == 2
    assert manager.lookup(a, request("r", [a])) is MISS
    assert manager.prepare_store([a, b], request("r2", [a, b])).store_spec.chunk_ids == [0, 1]


def test_bad_settings_and_a_request_that_comes_back_after_finishing_are_refused():
    with pytest.raises(ValueError, match="cache_policy must be 'lru' or 'arc', got 'fifo'"):
        CPUOffloadingManager(4, "fifo")
    with pytest.raises(ValueError, match="num_chunks must be a positive integer"):
        CPUOffloadingManager(0)
    manager = CPUOffloadingManager(4)
    context = stored(manager, keys("a"))
    with pytest.raises(RuntimeError, match="'writer' used the tier after it finished"):
        manager.prepare_store(keys("b"), context)


# -- eviction order: checks that take the manager, so that a broken policy can be shown to fail them --


def check_lru_evicts_the_least_recent_and_a_prefix_tail_first(manager: CPUOffloadingManager) -> None:
    a1, a2, b1, b2, c = keys("a1", "a2", "b1", "b2", "c")
    stored(manager, [a1, a2], "A")
    stored(manager, [b1, b2], "B")
    # Nothing used since: A is older than B, and within A the tail (a2) goes before the head.
    assert manager.prepare_store([c], request("C", [c])).evicted_keys == [a2]
    # A request reads a1 back: now B's are the least recent.
    reader = request("reader", [a1])
    manager.prepare_load([a1], reader)
    manager.complete_load([a1], reader)
    manager.on_request_finished(reader)
    assert manager.prepare_store(keys("d", "e"), request("D", keys("d", "e"))).evicted_keys == [b2, b1]


def check_arc_promotes_reuse_and_learns_from_ghosts(manager: CPUOffloadingManager) -> None:
    policy = manager.policy  # two chunks
    a, b, c = keys("a", "b", "c")
    stored(manager, [a], "A")
    stored(manager, [b], "B")
    assert (list(policy.t1), list(policy.t2)) == ([a, b], [])  # stored once: recent, not frequent
    reader = request("reader", [a])
    manager.prepare_load([a], reader)
    manager.complete_load([a], reader)
    manager.on_request_finished(reader)
    assert (list(policy.t1), list(policy.t2)) == ([b], [a])  # reused: frequent
    # |t1| = 1 >= target 0: the eviction takes t1's oldest idle chunk, b, and keeps its ghost.
    assert manager.prepare_store([c], request("C", [c])).evicted_keys == [b]
    manager.complete_store([c], request("C", [c]))
    assert list(policy.b1) == [b]
    # b is offered again: a t1 ghost, so recency mattered: the target grows by max(1, |b2| / |b1|) = 1.
    # |t1| = 1 >= 1: c, the oldest of t1, goes.
    assert manager.prepare_store([b], request("B again", [b])).evicted_keys == [c]
    assert policy.target_t1_size == 1
    assert (list(policy.t1), list(policy.t2), list(policy.b1)) == ([b], [a], [c])
    manager.complete_store([b], request("B again", [b]))
    # c comes back: another t1 ghost, the target grows to 2 (the capacity), and now |t1| = 1 < 2:
    # the frequent a leaves, not b.
    assert manager.prepare_store([c], request("C again", [c])).evicted_keys == [a]
    assert policy.target_t1_size == 2 and list(policy.b2) == [a]


def test_a_request_that_reads_back_what_it_stored_has_not_reused_it():
    manager = CPUOffloadingManager(4, "arc")
    a, b = keys("a", "b")
    stored(manager, [b], "B")
    context = request("r", [a, b])
    manager.prepare_store([a], context)
    manager.complete_store([a], context)
    manager.prepare_store([a, b], context)  # a again (its own), and b, which B stored
    manager.prepare_load([a], context)
    manager.complete_load([a], context)
    manager.on_request_finished(context)
    assert (list(manager.policy.t1), list(manager.policy.t2)) == ([a], [b])


def test_lru_evicts_the_least_recent_and_a_prefix_tail_first():
    check_lru_evicts_the_least_recent_and_a_prefix_tail_first(CPUOffloadingManager(4, "lru"))


def test_arc_promotes_reuse_and_learns_from_ghosts():
    check_arc_promotes_reuse_and_learns_from_ghosts(CPUOffloadingManager(2, "arc"))


class LRUHeadFirst(LRUCachePolicy):
    """Broken: a finished request's keys are used head first, so its tail ends up the most recent."""

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        for group in key_groups:
            self._use(group)


class ARCWithoutGhosts(ARCCachePolicy):
    """Broken: a store of a ghost teaches it nothing."""

    def on_store_miss(self, keys, req_context):
        pass


class ARCStoreIsReuse(CPUOffloadingManager):
    """Broken: a block stored and then offered again by the same request counts as reused."""

    def prepare_store(self, keys, req_context):
        output = super().prepare_store(keys, req_context)
        self._access(req_context).reused_keys.update(keys)
        return output


def with_policy(policy_class, num_chunks: int) -> CPUOffloadingManager:
    manager = CPUOffloadingManager(num_chunks, "arc" if issubclass(policy_class, ARCCachePolicy) else "lru")
    manager.policy = policy_class(num_chunks)
    return manager


@pytest.mark.parametrize(
    "check, broken",
    [
        (check_lru_evicts_the_least_recent_and_a_prefix_tail_first, lambda: with_policy(LRUHeadFirst, 4)),
        (check_arc_promotes_reuse_and_learns_from_ghosts, lambda: with_policy(ARCWithoutGhosts, 2)),
        (check_arc_promotes_reuse_and_learns_from_ghosts, lambda: ARCStoreIsReuse(2, "arc")),
    ],
    ids=["lru-head-first", "arc-without-ghosts", "arc-store-is-reuse"],
)
def test_each_eviction_check_fails_on_a_tier_that_breaks_its_rule(check, broken):
    with pytest.raises(AssertionError):
        check(broken())
