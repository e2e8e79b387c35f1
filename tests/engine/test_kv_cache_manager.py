"""KVCacheManager: lookup, allocation, caching at schedule time, free order
(mini_vllm/kv_cache_manager.py; chapters 05, 06, 08)."""

from __future__ import annotations

import itertools

import pytest

from mini_vllm.kv_cache_manager import KVCacheBlocks, KVCacheManager, longest_cache_hit
from mini_vllm.request import Request

SHARED = list(range(1000, 1048))  # 48 tokens: three full 16-token blocks


def ids(blocks):
    return [block.block_id for block in blocks]


def free_queue(manager):
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def admit(manager, request):
    """What the scheduler does for a waiting request: lookup, then allocate the rest.

    Returns the hit and the new blocks of the one KV-cache group (``KVCacheBlocks.blocks[0]``) as lists.
    """
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    if new is None:
        return list(hits.blocks[0]), None
    request.num_computed_tokens = request.num_tokens
    return list(hits.blocks[0]), list(new.blocks[0])


def refs(manager, block_ids):
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0}, {"num_blocks": -3}, {"num_blocks": 4, "block_size": 0}])
def test_non_positive_sizes_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        KVCacheManager(**kwargs)


def test_chapter_example_two_requests_share_three_blocks_and_free_order():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    a = Request("A", SHARED + list(range(7)))
    b = Request("B", SHARED + list(range(100, 105)))
    assert admit(manager, a) == ([], manager.req_to_blocks["A"])
    assert manager.get_block_ids("A") == [0, 1, 2, 3]
    hits, new = admit(manager, b)
    assert ids(hits) == [0, 1, 2] and ids(new) == [4]
    assert manager.get_block_ids("B") == [0, 1, 2, 4]
    assert refs(manager, [0, 1, 2, 3, 4]) == [2, 2, 2, 1, 1]
    manager.check_invariants()
    manager.free(a)
    manager.free(b)
    assert free_queue(manager) == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]
    manager.check_invariants()


def test_lookup_is_capped_so_the_last_token_is_recomputed():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    first = Request("A", SHARED)
    admit(manager, first)
    manager.free(first)
    again = Request("B", SHARED)
    hits, num_tokens = manager.get_computed_blocks(again)
    assert len(hits.blocks[0]) == 2 and num_tokens == 32  # not 3 blocks / 48 tokens


def test_lookup_stops_at_the_first_miss():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    first = Request("A", SHARED + list(range(16)))
    admit(manager, first)
    # Evict block 1 of A's chain by hand: block 2 is still cached but must not be returned.
    pool = manager.block_pool
    manager.free(first)
    pool._maybe_evict_cached_block(pool.blocks[1])
    hits, num_tokens = manager.get_computed_blocks(Request("B", SHARED + list(range(16))))
    assert ids(hits.blocks[0]) == [0] and num_tokens == 16


def test_get_computed_blocks_takes_no_references_and_counts_stats():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    a = Request("A", SHARED + [1])
    admit(manager, a)
    manager.free(a)
    before = free_queue(manager)
    b = Request("B", SHARED + [2, 3])
    hits, num_tokens = manager.get_computed_blocks(b)
    assert num_tokens == 48 and all(block.ref_cnt == 0 for block in hits.blocks[0])
    assert free_queue(manager) == before
    stats = manager.prefix_cache_stats
    # A lookup counts when its request is admitted (vLLM 0.33), not when it is made.
    assert (stats.requests, stats.queries, stats.hits) == (1, 49, 0)
    assert manager.allocate_slots(b, b.num_tokens - num_tokens, num_tokens, hits) is not None
    assert (stats.requests, stats.queries, stats.hits) == (2, 49 + 50, 48)
    assert stats.hit_rate == pytest.approx(48 / 99)


def test_a_failed_admission_retried_later_counts_once():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    a = Request("A", SHARED + [1])  # 4 blocks: the whole pool
    admit(manager, a)
    b = Request("B", list(range(20)))
    for _ in range(3):  # the scheduler looks B up every step while A runs
        hits, num_tokens = manager.get_computed_blocks(b)
        assert manager.allocate_slots(b, b.num_tokens - num_tokens, num_tokens, hits) is None
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 49, 0)
    manager.free(a)
    admit(manager, b)
    assert (stats.requests, stats.queries, stats.hits) == (2, 49 + 20, 0)


def test_a_readmission_after_preemption_is_counted_apart():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    a = Request("A", SHARED + [1])
    admit(manager, a)
    manager.free(a)  # preempted: what Scheduler.preempt does
    a.num_computed_tokens = 0
    a.num_preemptions += 1
    admit(manager, a)  # recomputes its own cached blocks
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 49, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 49, 48)
    assert stats.hit_rate == 0.0  # the re-admission's own hits do not count as prefix reuse


def test_decode_and_chunks_of_a_running_request_count_nothing():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    a = Request("A", SHARED + [1])
    assert manager.allocate_slots(a, 16) is not None  # first chunk: the admission
    a.num_computed_tokens = 16
    assert manager.allocate_slots(a, 33) is not None  # the rest of the prompt
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 49, 0)


def test_lookahead_slots_are_allocated_but_never_cached():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    a = Request("A", list(range(31)))
    (new,) = manager.allocate_slots(a, 31, num_lookahead_tokens=2).blocks  # 33 slots: 3 blocks
    assert len(new) == 3
    assert [block.block_hash is not None for block in new] == [True, False, False]
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        manager.allocate_slots(a, 1, num_lookahead_tokens=-1)


def test_allocate_slots_counts_evictable_hits_toward_what_is_needed():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    a = Request("A", SHARED + [1])  # 4 blocks: the whole pool
    admit(manager, a)
    manager.free(a)
    b = Request("B", SHARED + [2])
    hits, num_tokens = manager.get_computed_blocks(b)
    assert len(hits.blocks[0]) == 3
    # 3 free hits + 1 new block = all 4 free blocks: fits exactly.
    new = manager.allocate_slots(b, 1, num_tokens, hits)
    assert new is not None and len(new.blocks[0]) == 1
    manager.check_invariants()


def test_allocate_slots_failure_changes_nothing():
    manager = KVCacheManager(num_blocks=5, block_size=16)
    a = Request("A", SHARED + [1])
    admit(manager, a)
    manager.free(a)
    hog = Request("hog", list(range(16)))
    admit(manager, hog)  # takes block 3's place (head: the unhashed block)
    b = Request("B", SHARED + list(range(50, 50 + 33)))  # needs 3 hits + 3 new = 6 > 5
    hits, num_tokens = manager.get_computed_blocks(b)
    before = (free_queue(manager), [blk.ref_cnt for blk in manager.block_pool.blocks])
    assert manager.allocate_slots(b, b.num_tokens - num_tokens, num_tokens, hits) is None
    assert (free_queue(manager), [blk.ref_cnt for blk in manager.block_pool.blocks]) == before
    assert manager.get_block_ids("B") == [] and "B" not in manager.req_to_blocks
    manager.check_invariants()


def test_allocate_slots_rejects_non_positive_token_counts():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(Request("A", [1, 2]), 0)


def test_allocate_slots_returns_no_blocks_when_none_is_needed():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    a = Request("A", list(range(10)))
    assert manager.allocate_slots(a, 5).get_block_ids() == ([0],)
    a.num_computed_tokens = 5
    assert manager.allocate_slots(a, 5).get_block_ids() == ([],)


def test_a_single_group_manager_answers_in_kv_cache_blocks_as_a_hybrid_one_does():
    """One shape for every model (issue 40): one group is a KVCacheBlocks of one list, never a bare list."""
    manager = KVCacheManager(num_blocks=10, block_size=16)
    a = Request("A", SHARED + [1])
    hits, num_tokens = manager.get_computed_blocks(a)
    assert isinstance(hits, KVCacheBlocks) and hits.blocks == ((),) and num_tokens == 0
    new = manager.allocate_slots(a, a.num_tokens, num_tokens, hits)
    assert isinstance(new, KVCacheBlocks) and new.get_block_ids() == ([0, 1, 2, 3],)
    manager.free(a)
    b = Request("B", SHARED + [2])
    hits, num_tokens = manager.get_computed_blocks(b)
    assert isinstance(hits, KVCacheBlocks) and hits.get_block_ids() == ([0, 1, 2],) and num_tokens == 48
    new = manager.allocate_slots(b, 1, num_tokens, hits)
    assert (hits + new).get_block_ids() == ([0, 1, 2, 3],) and manager.block_ids_of(hits + new) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="KVCacheBlocks that get_computed_blocks returned"):
        manager.allocate_slots(Request("C", SHARED + [3]), 1, 48, list(hits.blocks[0]))


def test_blocks_are_cached_at_schedule_time_so_a_same_step_request_hits_them():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    a = Request("A", SHARED + [1])
    b = Request("B", SHARED + [2])
    # Both admitted in one step: A's K/V are not computed yet when B looks up.
    hits_a, _ = manager.get_computed_blocks(a)
    manager.allocate_slots(a, a.num_tokens, 0, hits_a)
    hits_b, num_tokens_b = manager.get_computed_blocks(b)
    assert hits_b.get_block_ids() == ([0, 1, 2],) and num_tokens_b == 48


def test_chunked_prefill_caches_each_chunk_full_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    a = Request("A", list(range(40)))
    manager.allocate_slots(a, 20)  # tokens 0..19: block 0 becomes full
    assert manager.block_pool.blocks[0].block_hash == a.block_hashes[0]
    assert manager.block_pool.blocks[1].block_hash is None
    a.num_computed_tokens = 20
    manager.allocate_slots(a, 20)  # tokens 20..39: block 1 full, block 2 partial
    assert manager.block_pool.blocks[1].block_hash == a.block_hashes[1]
    assert manager.block_pool.blocks[2].block_hash is None
    manager.check_invariants()


def test_decode_caches_a_block_in_the_step_that_fills_it():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    a = Request("A", list(range(14)))
    admit(manager, a)
    # Decode: a sampled token is appended, then the next step allocates a slot for it.
    a.append_output_token_ids(500)  # token 14
    manager.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert manager.block_pool.blocks[0].block_hash is None
    a.append_output_token_ids(501)  # token 15 fills block 0
    assert len(a.block_hashes) == 1
    manager.allocate_slots(a, 1)
    assert manager.block_pool.blocks[0].block_hash == a.block_hashes[0]
    manager.check_invariants()


def test_free_is_reverse_order_and_unknown_request_is_a_no_op():
    manager = KVCacheManager(num_blocks=6, block_size=4)
    a = Request("A", list(range(12)) + [1], block_size=4)  # 3 full blocks + 1 partial
    admit(manager, a)
    manager.free(Request("nobody", [1], block_size=4))
    manager.free(a)
    assert free_queue(manager) == [3, 4, 5, 2, 1, 0]
    manager.free(a)  # second free: a no-op
    manager.check_invariants()


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=6, block_size=16)
    a = Request("A", SHARED + [1])
    admit(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(Request("B", SHARED + [2])) == (manager.empty_kv_cache_blocks, 0)
    manager.check_invariants()


def test_caching_disabled_hashes_nothing_and_never_hits():
    manager = KVCacheManager(num_blocks=10, block_size=16, enable_caching=False)
    a = Request("A", SHARED + [1])
    admit(manager, a)
    assert all(block.block_hash is None for block in manager.block_pool.blocks)
    manager.free(a)
    assert manager.get_computed_blocks(Request("B", SHARED + [1])) == (manager.empty_kv_cache_blocks, 0)
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)  # vLLM records nothing with caching off
    manager.check_invariants()


def test_n_samples_share_prompt_blocks_with_ref_cnt_n():
    manager = KVCacheManager(num_blocks=20, block_size=16)
    children = [Request(f"A-{i}", SHARED + [7]) for i in range(4)]
    for child in children:
        admit(manager, child)
    assert refs(manager, [0, 1, 2]) == [4, 4, 4]
    manager.check_invariants()


def test_check_invariants_catches_a_wrong_ref_cnt_and_a_lost_map_entry():
    manager = KVCacheManager(num_blocks=6, block_size=16)
    admit(manager, Request("A", SHARED + [1]))
    manager.block_pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        manager.check_invariants()
    manager.block_pool.blocks[0].ref_cnt -= 1
    manager.block_pool.cached_block_hash_to_block.clear()
    with pytest.raises(AssertionError, match="not in the map"):
        manager.check_invariants()


def test_a_request_hashed_with_another_block_size_is_a_value_error():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        manager.get_computed_blocks(Request("A", list(range(8)), block_size=16))


def _walks(walk):
    # Value 0 is a hit: the profiler maps hashes to prompt indices, the router to block counts.
    cached = {b"a": 0, b"b": 1, b"d": 3}
    return walk([b"a", b"b", b"c", b"d"], cached.get), walk([b"c", b"a"], cached.get), walk([], cached.get)


def test_longest_cache_hit_stops_at_the_first_miss_and_keeps_falsy_values():
    expected = ([0, 1], [], [])
    assert _walks(longest_cache_hit) == expected

    def skips_a_miss(hashes, lookup):
        return [value for value in map(lookup, hashes) if value is not None]

    def stops_at_a_falsy_value(hashes, lookup):
        return list(itertools.takewhile(bool, map(lookup, hashes)))

    for wrong in (skips_a_miss, stops_at_a_falsy_value):
        assert _walks(wrong) != expected
