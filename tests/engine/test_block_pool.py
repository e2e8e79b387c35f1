"""FreeKVCacheBlockQueue and BlockPool (mini_vllm/block_pool.py; chapters 02, 06)."""

from __future__ import annotations

import re

import pytest

from known_mistakes import free_one_at_a_time

from mini_vllm.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)
from mini_vllm.request import Request


def ids(blocks):
    return [block.block_id for block in blocks]


def make_queue(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_free_queue_starts_ordered_by_id():
    _, queue = make_queue(5)
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert queue.num_free_blocks == 5


def test_free_queue_popleft_takes_the_head():
    _, queue = make_queue(3)
    assert queue.popleft().block_id == 0
    assert ids(queue.get_all_free_blocks()) == [1, 2]
    assert queue.num_free_blocks == 2


def test_free_queue_popleft_on_empty_raises_value_error():
    _, queue = make_queue(1)
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()


def test_free_queue_remove_from_the_middle_head_and_tail():
    blocks, queue = make_queue(5)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    assert queue.num_free_blocks == 2
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None


def test_free_queue_append_goes_to_tail_and_appendleft_to_head():
    blocks, queue = make_queue(4)
    for b in blocks[:2]:
        queue.remove(b)
    queue.append(blocks[0])
    queue.appendleft(blocks[1])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 3, 0]
    assert queue.popleft().block_id == 1


def test_free_queue_rejects_double_insert_and_removing_a_block_not_in_it():
    blocks, queue = make_queue(2)
    with pytest.raises(ValueError):
        queue.append(blocks[0])
    queue.remove(blocks[0])
    with pytest.raises(ValueError):
        queue.remove(blocks[0])


def test_free_queue_operations_touch_only_neighbours():
    """O(1): a remove in a long queue changes no block but the two neighbours."""
    blocks, queue = make_queue(1000)
    before = {b.block_id: (b.prev_free_block, b.next_free_block) for b in blocks}
    queue.remove(blocks[500])
    changed = [b.block_id for b in blocks if (b.prev_free_block, b.next_free_block) != before[b.block_id]]
    assert changed == [499, 500, 501]


def test_pool_block_ids_run_from_zero_without_a_null_block():
    pool = BlockPool(8)
    assert ids(pool.blocks) == list(range(8))
    assert pool.get_num_free_blocks() == 8
    assert ids(pool.get_new_blocks(2)) == [0, 1]


def test_get_new_blocks_sets_ref_cnt_and_raises_when_short():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in blocks] == [1, 1]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1  # the failed call changed nothing


def _cache(pool, blocks, tokens):
    request = Request("r", tokens, block_size=4)
    pool.cache_full_blocks(request, blocks, 0, len(tokens) // 4)
    return request


def test_popping_a_cached_block_evicts_it():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    request = _cache(pool, blocks, list(range(8)))
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 0]
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    reused = pool.get_new_blocks(1)[0]
    assert reused.block_id == 1 and reused.block_hash is None
    assert pool.get_cached_block(request.block_hashes[1]) is None  # evicted
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]  # still cached
    assert pool.num_evictions == 1


def test_identical_blocks_coexist_and_lookup_returns_the_first_inserted():
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    r1 = _cache(pool, first, list(range(4)))
    _cache(pool, second, list(range(4)))
    block_hash = r1.block_hashes[0]
    assert first[0].block_hash == second[0].block_hash == block_hash
    assert pool.get_cached_block(block_hash) is first[0]
    # Evicting the first one (by block id) leaves the second findable.
    pool.free_blocks(first)
    pool.free_blocks(second)
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 0, 1]
    pool.get_new_blocks(3)  # pops 2, 3, then 0 -> evicts block 0 only
    assert pool.get_cached_block(block_hash) is second[0]


def test_touch_takes_a_free_block_out_of_the_queue():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(1)
    _cache(pool, blocks, list(range(4)))
    pool.free_blocks(blocks)
    assert blocks[0].ref_cnt == 0 and pool.get_num_free_blocks() == 3
    pool.touch(blocks)
    assert blocks[0].ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.touch(blocks)
    assert blocks[0].ref_cnt == 2 and pool.get_num_free_blocks() == 2


def test_free_sends_unhashed_blocks_to_head_and_hashed_to_tail_in_order_given():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)  # 0, 1, 2
    _cache(pool, blocks[:2], list(range(8)))  # blocks 0 and 1 get hashes, 2 does not
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 4, 1, 0]


@pytest.mark.parametrize("free", ["pool", "one_at_a_time"])
def test_unhashed_blocks_freed_together_go_to_the_head_in_the_order_given(free):
    # vLLM 0.33: free_blocks collects the unhashed blocks and prepend_n()s them,
    # so the first block given is the new head.
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)  # 0, 1, 2, 3: none hashed
    ordered = list(reversed(blocks))  # 3, 2, 1, 0, as KVCacheManager.free passes them
    if free == "pool":
        pool.free_blocks(ordered)
        assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 0, 4, 5]
    else:
        free_one_at_a_time(pool, ordered)
        assert ids(pool.free_block_queue.get_all_free_blocks()) != [3, 2, 1, 0, 4, 5]


def test_prepend_n_keeps_the_order_and_the_links():
    blocks, queue = make_queue(5)
    for block in blocks[:3]:
        queue.remove(block)
    queue.prepend_n([blocks[2], blocks[0], blocks[1]])
    assert ids(queue.get_all_free_blocks()) == [2, 0, 1, 3, 4]
    assert queue.num_free_blocks == 5
    assert queue.popleft() is blocks[2]
    queue.prepend_n([])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.prepend_n([blocks[3]])


@pytest.mark.parametrize("method", ["append_n", "prepend_n"])
def test_a_run_refused_midway_leaves_a_valid_queue(method):
    """A block already in the queue stops the run: the blocks linked before it stay, the list stays whole."""
    blocks, queue = make_queue(5)
    for block in blocks[:2]:
        queue.remove(block)
    with pytest.raises(ValueError, match="block 4 is already in the free queue"):
        getattr(queue, method)([blocks[0], blocks[4], blocks[1]])
    expected = [2, 3, 4, 0] if method == "append_n" else [0, 2, 3, 4]
    assert ids(queue.get_all_free_blocks()) == expected and queue.num_free_blocks == 4
    backwards, block = [], queue.fake_tail.prev_free_block
    while block is not queue.fake_head:
        backwards.append(block.block_id)
        block = block.prev_free_block
    assert backwards == expected[::-1]
    assert blocks[1].prev_free_block is None and blocks[1].next_free_block is None


def test_shared_block_is_freed_only_at_ref_cnt_zero():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    pool.touch(blocks)
    pool.free_blocks(blocks)
    assert blocks[0].ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks(blocks)
    assert blocks[0].ref_cnt == 0 and pool.get_num_free_blocks() == 2
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks(blocks)


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    request = _cache(pool, blocks, list(range(4)))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(request.block_hashes[0]) is None
    assert all(b.block_hash is None for b in pool.blocks)


def test_events_are_recorded_only_when_enabled():
    quiet = BlockPool(2)
    _cache(quiet, quiet.get_new_blocks(1), list(range(4)))
    assert quiet.take_events() == []
    pool = BlockPool(1, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(1)
    request = _cache(pool, blocks, list(range(4)))
    pool.free_blocks(blocks)
    pool.get_new_blocks(1)
    assert pool.take_events() == [
        BlockStored(
            block_hashes=(request.block_hashes[0],),
            parent_block_hash=None,
            token_ids=(0, 1, 2, 3),
            block_size=4,
            block_ids=(0,),
            extra_keys=(None,),  # no salt
        ),
        BlockRemoved(block_hashes=(request.block_hashes[0],), block_ids=(0,)),
    ]
    assert pool.take_events() == []


def test_block_stored_is_one_event_per_call_with_the_parent_hash():
    pool = BlockPool(4, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(3)
    request = Request("r", list(range(12)), block_size=4)
    pool.cache_full_blocks(request, blocks, 0, 1)
    pool.cache_full_blocks(request, blocks, 1, 3)
    first, rest = pool.take_events()
    assert first.block_hashes == (request.block_hashes[0],) and first.parent_block_hash is None
    assert rest.block_hashes == tuple(request.block_hashes[1:3])
    assert rest.parent_block_hash == request.block_hashes[0]
    assert rest.token_ids == tuple(range(4, 12)) and rest.block_ids == (1, 2)


def test_reset_records_all_blocks_cleared():
    pool = BlockPool(2, enable_kv_cache_events=True)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]


@pytest.mark.parametrize(
    "num_blocks, error, message",
    [
        (0, ValueError, "num_blocks must be a positive integer, got 0"),
        (-3, ValueError, "num_blocks must be a positive integer, got -3"),
        (2.5, TypeError, "num_blocks must be a positive integer, got float 2.5"),
        (True, TypeError, "num_blocks must be a positive integer, got bool True"),
    ],
)
def test_a_pool_and_a_manager_refuse_a_num_blocks_that_is_not_a_positive_integer(num_blocks, error, message):
    """One check for both (mini_vllm/validation.py), the same words as the engine's settings."""
    from mini_vllm.kv_cache_manager import KVCacheManager

    with pytest.raises(error, match=re.escape(message)):
        BlockPool(num_blocks)
    with pytest.raises(error, match=re.escape(message)):
        KVCacheManager(num_blocks=num_blocks, block_size=4)
