"""The checks of chapters 05 and 06 accept the reference and reject the typical mistakes.

(Chapter 04's hashing checks are proved in test_course_checks_ch04_hashing.py.) Each wrong
implementation below is a mistake a learner makes; the check must raise
AssertionError on it, with a message that names the mistake."""

from __future__ import annotations

import dataclasses

import inspect
import re

import pytest

from mini_vllm.events import BlockRemoved
from course_fixtures import rejects

from mini_vllm.block_pool import BlockPool, KVCacheBlock
from mini_vllm.course import (
    check_find_longest_cache_hit,
    check_free_blocks,
    check_free_request_blocks,
    check_get_new_blocks,
)

# -- chapter 05: find_longest_cache_hit -------------------------------------------------


def reference_lookup(block_pool, block_hashes, max_num_blocks):
    hits = []
    for block_hash in block_hashes[:max_num_blocks]:
        block = block_pool.get_cached_block(block_hash)
        if block is None:
            break
        hits.append(block)
    return hits


def test_ch05_find_longest_cache_hit_accepts_the_reference(capsys):
    check_find_longest_cache_hit(reference_lookup)
    assert "✓ find_longest_cache_hit" in capsys.readouterr().out


def _skips_a_miss(block_pool, block_hashes, max_num_blocks):
    hits = []
    for block_hash in block_hashes[:max_num_blocks]:
        block = block_pool.get_cached_block(block_hash)
        if block is None:
            continue
        hits.append(block)
    return hits


def _keeps_every_lookup(block_pool, block_hashes, max_num_blocks):
    """Walks past the misses: one get_cached_block per hash, the misses' None kept in the list."""
    return [block_pool.get_cached_block(block_hash) for block_hash in block_hashes[:max_num_blocks]]


def _drops_only_the_trailing_misses(block_pool, block_hashes, max_num_blocks):
    """Walks past a miss in the middle: only the misses at the end are cut off."""
    hits = [block_pool.get_cached_block(block_hash) for block_hash in block_hashes[:max_num_blocks]]
    while hits and hits[-1] is None:
        hits.pop()
    return hits


def _appends_the_miss_then_stops(block_pool, block_hashes, max_num_blocks):
    hits = []
    for block_hash in block_hashes[:max_num_blocks]:
        block = block_pool.get_cached_block(block_hash)
        hits.append(block)  # before the test: the miss's None goes in too
        if block is None:
            break
    return hits


def _ignores_max_num_blocks(block_pool, block_hashes, max_num_blocks):
    return reference_lookup(block_pool, block_hashes, len(block_hashes))


def _returns_block_ids(block_pool, block_hashes, max_num_blocks):
    return [block.block_id for block in reference_lookup(block_pool, block_hashes, max_num_blocks)]


def _returns_hashes(block_pool, block_hashes, max_num_blocks):
    return list(block_hashes[: len(reference_lookup(block_pool, block_hashes, max_num_blocks))])


def _one_too_many(block_pool, block_hashes, max_num_blocks):
    return reference_lookup(block_pool, block_hashes, max_num_blocks + 1)


def _one_too_few(block_pool, block_hashes, max_num_blocks):
    return reference_lookup(block_pool, block_hashes, max(0, max_num_blocks - 1))


def _recomputes_the_cap(block_pool, block_hashes, max_num_blocks):
    return reference_lookup(block_pool, block_hashes, len(block_hashes) - 1)  # the last-token rule, again


def _touches_the_hits(block_pool, block_hashes, max_num_blocks):
    hits = reference_lookup(block_pool, block_hashes, max_num_blocks)
    block_pool.touch(hits)
    return hits


def _returns_a_generator(block_pool, block_hashes, max_num_blocks):
    return (block for block in reference_lookup(block_pool, block_hashes, max_num_blocks))


def _newest_duplicate(block_pool, block_hashes, max_num_blocks):
    hits = []
    for block_hash in block_hashes[:max_num_blocks]:
        matches = [b for h, b in block_pool.cached_block_hash_to_block.items() if h == block_hash]
        if not matches:
            break
        hits.append(matches[-1])
    return hits


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (_skips_a_miss, "stop at the first miss"),
        (_ignores_max_num_blocks, "at most max_num_blocks"),
        (_returns_block_ids, "not block ids or hashes"),
        (_returns_hashes, "not block ids or hashes"),
        (_one_too_many, "off by one"),
        (_one_too_few, "stopped one block early"),
        (_recomputes_the_cap, "a cap of your own such as len\\(block_hashes\\) - 1"),
        (_touches_the_hits, "takes no references"),
        (_returns_a_generator, "not a list"),
        (_newest_duplicate, "first block inserted"),
    ],
)
def test_ch05_find_longest_cache_hit_rejects_typical_mistakes(wrong, expected_message):
    rejects(check_find_longest_cache_hit, wrong, expected_message, regex=True)


def test_ch05_find_longest_cache_hit_reports_the_blocks_returned():
    with pytest.raises(AssertionError, match=r"returned blocks \[0, 1, 3\]"):
        check_find_longest_cache_hit(_skips_a_miss)


@pytest.mark.parametrize(
    "wrong, named",
    [
        (_keeps_every_lookup, "an empty cache: returned [None, None, None]"),
        (_drops_only_the_trailing_misses, "a miss at block 2: returned [0, 1, None, 3]"),
        (_appends_the_miss_then_stops, "an empty cache: returned [None]"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_ch05_find_longest_cache_hit_a_kept_miss_is_told_to_stop_at_the_first_miss(wrong, named):
    """A None in the hit is a miss walked past, not a wrong item type (the old message said 'NoneType items')."""
    message = rejects(check_find_longest_cache_hit, wrong, "A hit stops at the first miss")
    assert named in message  # the case, and what came back, by block id
    assert "block i+1 can only be reused if block i is" in message
    assert "NoneType" not in message and "not block ids or hashes" not in message


def test_ch05_find_longest_cache_hit_skipping_a_miss_says_why_the_prefix_rule_holds():
    message = rejects(check_find_longest_cache_hit, _skips_a_miss, "break, not continue")
    assert "a miss at block 2" in message and "block i+1 can only be reused if block i is" in message


def test_ch05_find_longest_cache_hit_none_for_no_hit_is_told_an_empty_list():
    """A learner pass (04, 05, 08b): `return hit or None` was asked whether it forgot its `return`."""
    rejects(
        check_find_longest_cache_hit,
        lambda pool, hashes, max_num_blocks: reference_lookup(pool, hashes, max_num_blocks) or None,
        "return result or None.*An empty answer is an empty list",
        regex=True,
    )


_LOOKUPS: dict = {}


def _memoizes_lookups(block_pool, block_hashes, max_num_blocks):
    hit = []
    for block_hash in block_hashes[:max_num_blocks]:
        if block_hash not in _LOOKUPS:
            _LOOKUPS[block_hash] = block_pool.get_cached_block(block_hash)
        if _LOOKUPS[block_hash] is None:
            break
        hit.append(_LOOKUPS[block_hash])
    return hit


def _asks_for_group_1(block_pool, block_hashes, max_num_blocks):
    hit = []
    for block_hash in block_hashes[:max_num_blocks]:
        block = block_pool.get_cached_block(block_hash, 1)
        if block is None:
            break
        hit.append(block)
    return hit


def _tests_membership_in_the_map(block_pool, block_hashes, max_num_blocks):
    hit = []
    for block_hash in block_hashes[:max_num_blocks]:
        if block_hash not in block_pool.cached_block_hash_to_block:
            break
        hit.append(block_pool.get_cached_block(block_hash))
    return hit


@pytest.mark.parametrize(
    "wrong, expected_message",
    [
        (_memoizes_lookups, "remember answers from the earlier call"),
        (_asks_for_group_1, "you asked get_cached_block for KV-cache group 1"),
        (_tests_membership_in_the_map, "the pool's hash map is not a dict"),
    ],
    ids=["memo", "group 1", "in the map"],
)
def test_ch05_find_longest_cache_hit_names_mistakes_a_learner_pass_got_general_hints_for(wrong, expected_message):
    _LOOKUPS.clear()
    rejects(check_find_longest_cache_hit, wrong, expected_message)


def test_ch05_find_longest_cache_hit_lets_the_stub_error_through():
    def stub(block_pool, block_hashes, max_num_blocks):
        raise NotImplementedError("your code here")

    with pytest.raises(NotImplementedError):
        check_find_longest_cache_hit(stub)


# -- chapter 06: free_blocks, free_request_blocks, get_new_blocks ----------------------------


def reference_free_blocks(pool, ordered_blocks):
    to_the_head = []  # vLLM 0.33: unhashed blocks go to the head together, in the order given
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                to_the_head.append(block)
            else:
                pool.free_block_queue.append(block)
    for block in reversed(to_the_head):
        pool.free_block_queue.appendleft(block)


def reference_free_request_blocks(pool, req_blocks):
    reference_free_blocks(pool, reversed(req_blocks))


def count_eviction(pool, block):
    """What an eviction reports: the counter, and a BlockRemoved event when the pool records events."""
    pool.num_evictions += 1
    if pool.enable_kv_cache_events:
        pool.kv_event_queue.append(
            BlockRemoved((block.block_hash,), (block.block_id,), group_idx=block.kv_cache_group_id)
        )


def reference_get_new_blocks(pool, num_blocks):
    if num_blocks > pool.get_num_free_blocks():
        raise ValueError(f"only {pool.get_num_free_blocks()} free blocks")
    blocks = []
    for _ in range(num_blocks):
        block = pool.free_block_queue.popleft()
        if block.block_hash is not None:
            pool.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
            count_eviction(pool, block)
            block.block_hash, block.kv_cache_group_id = None, 0
        block.ref_cnt = 1
        blocks.append(block)
    return blocks


def test_ch06_eviction_checks_accept_the_reference(capsys):
    check_free_blocks(reference_free_blocks)
    check_free_request_blocks(reference_free_request_blocks)
    check_get_new_blocks(reference_get_new_blocks)
    out = capsys.readouterr().out
    assert "✓ free_blocks" in out and "✓ free_request_blocks" in out and "✓ get_new_blocks" in out


def test_ch06_eviction_checks_accept_the_packages_block_pool_methods():
    check_free_blocks(BlockPool.free_blocks)
    check_get_new_blocks(BlockPool.get_new_blocks)


def _unhashed_to_the_tail(pool, ordered_blocks):
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            pool.free_block_queue.append(block)


def _never_returned(pool, ordered_blocks):
    for block in ordered_blocks:
        block.ref_cnt -= 1


def _reverses_again(pool, ordered_blocks):
    reference_free_blocks(pool, list(ordered_blocks)[::-1])


def _returns_shared_blocks_too(pool, ordered_blocks):
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt <= 1 and block.prev_free_block is None:
            if block.block_hash is None:
                pool.free_block_queue.appendleft(block)
            else:
                pool.free_block_queue.append(block)


def _evicts_on_free(pool, ordered_blocks):
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is not None:
                pool.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
                block.block_hash = None
            pool.free_block_queue.appendleft(block)


def _indexes_its_argument(pool, ordered_blocks):
    reference_free_blocks(pool, [ordered_blocks[i] for i in range(len(ordered_blocks))])


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (_unhashed_to_the_tail, "HEAD"),
        (_never_returned, "not returned to the free queue"),
        (_reverses_again, "in the order given"),
        (_returns_shared_blocks_too, "only a block whose ref_cnt reaches 0"),
        (_evicts_on_free, "lazy eviction"),
        (_indexes_its_argument, "any iterable"),
    ],
)
def test_ch06_free_blocks_rejects_typical_mistakes(wrong, expected_message):
    rejects(check_free_blocks, wrong, expected_message, regex=True)


def _table_order(pool, req_blocks):
    reference_free_blocks(pool, req_blocks)


def _only_the_last_block(pool, req_blocks):
    reference_free_blocks(pool, req_blocks[-1:])


def _sorted_by_id(pool, req_blocks):
    reference_free_blocks(pool, sorted(req_blocks, key=lambda block: block.block_id))


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (_table_order, "you freed the table in table order"),
        (_only_the_last_block, "free every block of the table"),
        (_sorted_by_id, "LAST block first"),
    ],
)
def test_ch06_free_request_blocks_rejects_typical_mistakes(wrong, expected_message):
    rejects(check_free_request_blocks, wrong, expected_message, regex=True)


def _keeps_the_stale_map_entry(pool, num_blocks):
    blocks = pool.free_block_queue.popleft_n(num_blocks)
    for block in blocks:
        block.ref_cnt = 1
    return blocks


def _clears_the_hash_but_leaves_the_map(pool, num_blocks):
    blocks = pool.free_block_queue.popleft_n(num_blocks)
    for block in blocks:
        block.block_hash = None
        block.ref_cnt = 1
    return blocks


def _leaves_the_hash_on_the_block(pool, num_blocks):
    blocks = pool.free_block_queue.popleft_n(num_blocks)
    for block in blocks:
        if block.block_hash is not None:
            pool.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
        block.ref_cnt = 1
    return blocks


def _forgets_ref_cnt(pool, num_blocks):
    blocks = reference_get_new_blocks(pool, num_blocks)
    for block in blocks:
        block.ref_cnt = 0
    return blocks


def _pops_from_the_tail(pool, num_blocks):
    blocks = []
    for _ in range(num_blocks):
        block = pool.free_block_queue.fake_tail.prev_free_block
        pool.free_block_queue.remove(block)
        if block.block_hash is not None:
            pool.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
            count_eviction(pool, block)
            block.block_hash, block.kv_cache_group_id = None, 0
        block.ref_cnt = 1
        blocks.append(block)
    return blocks


def _raises_too_late(pool, num_blocks):
    blocks = []
    for _ in range(num_blocks):
        blocks += reference_get_new_blocks(pool, 1)
    return blocks


def _no_error_when_short(pool, num_blocks):
    return reference_get_new_blocks(pool, min(num_blocks, pool.get_num_free_blocks()))


def _evicts_every_twin(pool, num_blocks):
    blocks = pool.free_block_queue.popleft_n(num_blocks)
    for block in blocks:
        if block.block_hash is not None:
            block_hash = block.block_hash
            for _, other in list(pool.cached_block_hash_to_block.items()):
                if other.block_hash == block_hash:
                    pool.cached_block_hash_to_block.pop(block_hash, other.block_id)
            count_eviction(pool, block)
            block.block_hash, block.kv_cache_group_id = None, 0
        block.ref_cnt = 1
    return blocks


def _event_without_its_group(pool, num_blocks):
    """The exercise's text before a learner pass found it: BlockRemoved without group_idx."""
    blocks = reference_get_new_blocks(pool, num_blocks)
    for index, event in enumerate(pool.kv_event_queue):
        pool.kv_event_queue[index] = dataclasses.replace(event, group_idx=0)
    return blocks


def _keeps_the_group(pool, num_blocks):
    groups = [block.kv_cache_group_id for block in pool.free_block_queue.get_all_free_blocks()[:num_blocks]]
    blocks = reference_get_new_blocks(pool, num_blocks)
    for block, group in zip(blocks, groups):
        block.kv_cache_group_id = group
    return blocks


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (_event_without_its_group, "carry group_idx \\[0\\] \\(expected \\[1\\]\\)"),
        (_keeps_the_group, "still says kv_cache_group_id 1"),
        (_keeps_the_stale_map_entry, "stale map entry"),
        (_clears_the_hash_but_leaves_the_map, "stale map entry"),
        (_leaves_the_hash_on_the_block, "still carries its old block_hash"),
        (_forgets_ref_cnt, "ref_cnt = 1"),
        (_pops_from_the_tail, "HEAD"),
        (_raises_too_late, "BEFORE popping"),
        (_no_error_when_short, "ValueError"),
        (_evicts_every_twin, "remove only the popped block"),
    ],
)
def test_ch06_get_new_blocks_rejects_typical_mistakes(wrong, expected_message):
    rejects(check_get_new_blocks, wrong, expected_message, regex=True)


def test_ch06_free_request_blocks_freeing_one_block_at_a_time_is_named():
    """A learner pass: told to free in reverse table order, which it did, one free_blocks call per block."""

    def one_at_a_time(pool, req_blocks):
        for block in reversed(req_blocks):
            reference_free_blocks(pool, [block])

    rejects(check_free_request_blocks, one_at_a_time, "you called free_blocks once per block")


def _event_lists(pool, num_blocks):
    blocks = reference_get_new_blocks(pool, num_blocks)
    for index, event in enumerate(pool.kv_event_queue):
        pool.kv_event_queue[index] = dataclasses.replace(
            event, block_hashes=list(event.block_hashes), block_ids=list(event.block_ids)
        )
    return blocks


def test_ch06_get_new_blocks_names_events_that_are_not_tuples_and_shows_no_object_address():
    rejects(check_get_new_blocks, _event_lists, "block_hashes and block_ids are tuples of one entry each")

    def off_by_one(pool, num_blocks):
        if num_blocks >= pool.get_num_free_blocks():
            raise ValueError("not enough free blocks")
        return reference_get_new_blocks(pool, num_blocks)

    message = rejects(check_get_new_blocks, off_by_one, "get_new_blocks(<BlockPool>, ")
    assert "object at 0x" not in message


def test_ch06_eviction_checks_let_the_stub_error_through():
    def stub(*args):
        raise NotImplementedError("your code here")

    for check in (check_free_blocks, check_free_request_blocks, check_get_new_blocks):
        with pytest.raises(NotImplementedError):
            check(stub)


def test_ch06_get_new_blocks_reference_returns_kv_cache_blocks():
    pool = BlockPool(4)
    assert all(isinstance(block, KVCacheBlock) for block in reference_get_new_blocks(pool, 2))


WRONG_FREE_BLOCKS = """
def free_blocks(pool, ordered_blocks):
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            pool.free_block_queue.append(block)  # every block to the tail: the hashless ones belong at the head
"""
RIGHT_FREE_BLOCKS = inspect.getsource(reference_free_blocks).replace("def reference_free_blocks", "def free_blocks")


def _learners_freeing(free_blocks_source: str, order: str) -> dict:
    """A learner's notebook (module ``__main__``) with both functions, free_request_blocks calling free_blocks."""
    namespace = {"__name__": "__main__"}
    exec(
        free_blocks_source + f"\ndef free_request_blocks(pool, req_blocks):\n    free_blocks(pool, {order})\n",
        namespace,
    )
    return namespace


def test_ch06_free_request_blocks_blames_the_learners_failing_free_blocks():
    from mini_vllm.course import check_free_blocks, check_free_request_blocks
    from mini_vllm.course._harness import CheckFailure

    learner = _learners_freeing(WRONG_FREE_BLOCKS, "reversed(req_blocks)")  # free_request_blocks itself is right
    with pytest.raises(CheckFailure, match="calls your free_blocks, which fails its own check") as failure:
        check_free_request_blocks(learner["free_request_blocks"])
    # Its own hint ("pass reversed(req_blocks) to your free_blocks") would point at the right code.
    assert "hint" not in str(failure.value) and "reversed" not in str(failure.value)
    # A right free_blocks with free_request_blocks in table order: the mistake is free_request_blocks' own.
    learner = _learners_freeing(RIGHT_FREE_BLOCKS, "req_blocks")
    check_free_blocks.__wrapped__(learner["free_blocks"])  # passes its own check
    with pytest.raises(CheckFailure) as failure:
        check_free_request_blocks(learner["free_request_blocks"])
    assert "fails its own check" not in str(failure.value) and "LAST block first" in str(failure.value)


def test_ch06_free_blocks_that_loops_twice_over_an_iterator_is_told_so():
    """Found by a learner pass: a second loop over reversed(table) finds it empty (the check said only 'differs')."""
    learner = {}
    exec(
        """
def free_blocks(pool, ordered_blocks):
    for block in ordered_blocks:
        block.ref_cnt -= 1
    unhashed = [b for b in ordered_blocks if b.ref_cnt == 0 and b.block_hash is None]
    for block in reversed(unhashed):
        pool.free_block_queue.appendleft(block)
    for block in ordered_blocks:
        if block.ref_cnt == 0 and block.block_hash is not None:
            pool.free_block_queue.append(block)
""",
        learner,
    )
    rejects(check_free_blocks, learner["free_blocks"], "an iterator can be looped over only once")


def _records_no_event(pool, num_blocks):
    if num_blocks > pool.get_num_free_blocks():
        raise ValueError(f"only {pool.get_num_free_blocks()} free blocks")
    blocks = pool.free_block_queue.popleft_n(num_blocks)
    for block in blocks:
        if block.block_hash is not None:
            pool.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
            pool.num_evictions += 1
            block.block_hash, block.kv_cache_group_id = None, 0
        block.ref_cnt = 1
    return blocks


def test_ch06_get_new_blocks_the_no_event_hints_example_passes_the_next_case():
    """Issue 41: the hint for a get_new_blocks that records no event gave BlockRemoved(...) without group_idx;
    copied as written, it failed the very next case (a hybrid model's block, cached for group 1)."""
    message = rejects(check_get_new_blocks, _records_no_event, "record each eviction when the pool records events")
    example = re.search(r"pool\.kv_event_queue\.append\((BlockRemoved\(.*?\))\) ", message).group(1)
    assert "group_idx=block.kv_cache_group_id" in example, example

    def as_the_hint_says(pool, num_blocks):
        if num_blocks > pool.get_num_free_blocks():
            raise ValueError(f"only {pool.get_num_free_blocks()} free blocks")
        blocks = pool.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                pool.cached_block_hash_to_block.pop(block_hash, block.block_id)
                pool.num_evictions += 1
                if pool.enable_kv_cache_events:
                    pool.kv_event_queue.append(eval(example, {"BlockRemoved": BlockRemoved}, locals()))
                block.block_hash, block.kv_cache_group_id = None, 0
            block.ref_cnt = 1
        return blocks

    check_get_new_blocks(as_the_hint_says)
