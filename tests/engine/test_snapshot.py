"""The cache as plain data: ``BlockPool.snapshot`` and ``KVCacheManager.snapshot``
(mini_vllm/block_pool.py, mini_vllm/kv_cache_manager.py).

Each test drives a pool through allocations, frees and evictions, then compares the
snapshot with the pool's own objects: this file is the one place, besides the snapshot
itself, that reads them directly. Then it checks that the snapshot is a copy that
cannot be changed, and that the pool cannot change it either.
"""

from __future__ import annotations

import dataclasses

import pytest

from mini_vllm.block_pool import NULL_BLOCK_ID, BlockPool
from mini_vllm.hashing import hash_request_tokens
from mini_vllm.kv_cache_interface import make_kv_cache_config
from mini_vllm.kv_cache_manager import KVCacheManager
from mini_vllm.request import Request

BLOCK = 4


def admit(manager: KVCacheManager, request: Request) -> None:
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens


def what_the_pool_holds(pool: BlockPool) -> dict:
    """The pool's state read from its objects directly (the oracle the snapshot is compared with)."""
    return {
        "free_block_queue": tuple(block.block_id for block in pool.free_block_queue.get_all_free_blocks()),
        "num_free_blocks": pool.free_block_queue.num_free_blocks,
        "blocks": [(b.block_id, b.ref_cnt, b.block_hash, b.kv_cache_group_id) for b in pool.blocks],
        "map": [(block_hash, block.block_id) for block_hash, block in pool.cached_block_hash_to_block.items()],
        "num_evictions": pool.num_evictions,
    }


def what_the_snapshot_says(snapshot) -> dict:
    return {
        "free_block_queue": snapshot.free_block_queue,
        "num_free_blocks": snapshot.num_free_blocks,
        "blocks": [(b.block_id, b.ref_cnt, b.block_hash, b.kv_cache_group_id) for b in snapshot.blocks],
        "map": [
            (block_hash, block_id)
            for block_hash, block_ids in snapshot.cached_block_hash_to_block.items()
            for block_id in block_ids
        ],
        "num_evictions": snapshot.num_evictions,
    }


def expect_snapshot_is_the_manager(manager: KVCacheManager) -> None:
    snapshot = manager.snapshot()
    assert what_the_snapshot_says(snapshot.block_pool) == what_the_pool_holds(manager.block_pool)
    for group, group_manager in enumerate(manager.managers):
        assert dict(snapshot.req_to_block_ids[group]) == {
            request_id: tuple(block.block_id for block in blocks)
            for request_id, blocks in group_manager.req_to_blocks.items()
        }
        assert list(snapshot.req_to_block_ids[group]) == list(group_manager.req_to_blocks)  # the same order
        assert dict(snapshot.num_cached_block[group]) == group_manager.num_cached_block
        for block_hash, block_id in snapshot.block_pool.cached_block_ids(group).items():
            assert manager.block_pool.get_cached_block(block_hash, group).block_id == block_id
    assert snapshot.prefix_cache_stats == manager.prefix_cache_stats
    assert snapshot.num_evictions == manager.num_evictions


def test_a_fresh_pool_is_all_free_in_id_order():
    snapshot = BlockPool(5).snapshot()
    assert snapshot.free_block_queue == (0, 1, 2, 3, 4) and snapshot.num_free_blocks == snapshot.num_blocks == 5
    assert all(block.ref_cnt == 0 and block.block_hash is None for block in snapshot.blocks)
    assert dict(snapshot.cached_block_hash_to_block) == {} and snapshot.num_evictions == 0
    assert snapshot.next_to_reuse == 0 and snapshot.next_to_evict is None


def test_the_snapshot_follows_allocate_free_and_evict():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK)
    a = Request("A", list(range(10)), BLOCK)  # 2 full blocks + 2 tokens
    b = Request("B", list(range(10)) + [50], BLOCK)  # shares A's 2 full blocks
    admit(manager, a)
    expect_snapshot_is_the_manager(manager)
    admit(manager, b)
    snapshot = manager.snapshot()
    assert snapshot.get_block_ids("A") == (0, 1, 2) and snapshot.get_block_ids("B") == (0, 1, 3)
    assert [block.ref_cnt for block in snapshot.block_pool.blocks] == [2, 2, 1, 1, 0, 0]
    assert dict(snapshot.num_cached_block[0]) == {"A": 2, "B": 2}
    assert snapshot.block_pool.next_to_reuse == 4 and snapshot.block_pool.next_to_evict is None
    expect_snapshot_is_the_manager(manager)

    manager.free(a)
    manager.free(b)  # B's last block first: its hashed blocks go to the tail in reverse
    snapshot = manager.snapshot()
    assert snapshot.block_pool.free_block_queue == (3, 2, 4, 5, 1, 0)
    assert snapshot.get_block_ids("A") == () and snapshot.req_to_block_ids == ({},)
    assert snapshot.block_pool.next_to_reuse == 3 and snapshot.block_pool.next_to_evict == 1
    expect_snapshot_is_the_manager(manager)

    c = Request("C", list(range(200, 224)), BLOCK)  # 6 blocks: the whole pool, evicting the cached two
    admit(manager, c)
    snapshot = manager.snapshot()
    assert snapshot.num_evictions == 2 and snapshot.block_pool.num_free_blocks == 0
    assert snapshot.block_pool.next_to_evict is None
    expect_snapshot_is_the_manager(manager)


def test_a_hash_cached_twice_lists_both_blocks_and_lookups_return_the_first():
    pool = BlockPool(4)
    block_hash = hash_request_tokens([1] * BLOCK, BLOCK)[0]
    for block_id in (2, 0):
        pool.blocks[block_id].block_hash = block_hash
        pool.cached_block_hash_to_block.insert(block_hash, pool.blocks[block_id])
    snapshot = pool.snapshot()
    assert snapshot.cached_block_hash_to_block[block_hash] == (2, 0)
    assert snapshot.get_cached_block_id(block_hash) == pool.get_cached_block(block_hash).block_id == 2
    assert snapshot.cached_block_ids() == {block_hash: 2} and snapshot.cached_block_ids(1) == {}
    assert snapshot.next_to_evict == 0  # the first cached block from the head
    assert what_the_snapshot_says(snapshot) == what_the_pool_holds(pool)


def test_a_hybrid_snapshot_has_a_table_and_a_lookup_per_group():
    config = make_kv_cache_config([9, None, 9, None], BLOCK, 40)
    manager = KVCacheManager(40, BLOCK, kv_cache_config=config)
    request = Request("r", list(range(100, 116)), BLOCK)
    admit(manager, request)
    request.append_output_token_ids(7)  # its window moves past blocks 0 and 1
    manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    snapshot = manager.snapshot()
    full, sliding = snapshot.get_block_ids_by_group("r")
    assert snapshot.num_kv_cache_groups == 2
    assert sliding[:2] == (NULL_BLOCK_ID, NULL_BLOCK_ID) and NULL_BLOCK_ID not in full
    assert (full, sliding) == tuple(tuple(table) for table in manager.get_block_ids_by_group("r"))
    assert set(snapshot.block_pool.cached_block_ids(0)) == set(request.block_hashes)
    # The sliding-window group caches only the blocks a later hit can use, each block for its own group.
    sliding_cached = snapshot.block_pool.cached_block_ids(1)
    assert sliding_cached and set(sliding_cached) < set(request.block_hashes)
    assert not set(sliding_cached.values()) & set(snapshot.block_pool.cached_block_ids(0).values())
    assert all(snapshot.block_pool.blocks[block_id].kv_cache_group_id == 1 for block_id in sliding_cached.values())
    expect_snapshot_is_the_manager(manager)
    manager.free(request)
    expect_snapshot_is_the_manager(manager)


def test_the_snapshot_cannot_change_the_pool_nor_the_pool_the_snapshot():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK)
    a = Request("A", list(range(10)), BLOCK)
    admit(manager, a)
    before = what_the_pool_holds(manager.block_pool)
    snapshot = manager.snapshot()
    pool = snapshot.block_pool
    block_hash = next(iter(pool.cached_block_hash_to_block))

    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.block_pool = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        pool.num_evictions = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        pool.blocks[0].ref_cnt = 0
    with pytest.raises(TypeError):
        pool.free_block_queue[0] = 1
    with pytest.raises(TypeError):
        pool.cached_block_hash_to_block[block_hash] = (5,)
    with pytest.raises(TypeError):
        snapshot.req_to_block_ids[0]["A"] = (5,)
    with pytest.raises(TypeError):
        snapshot.num_cached_block[0]["A"] = 0
    snapshot.prefix_cache_stats.hits += 100  # a copy of the counters: the manager's stay
    assert manager.prefix_cache_stats.hits == 0
    assert what_the_pool_holds(manager.block_pool) == before

    # The pool goes on; the snapshot keeps the moment it was taken.
    manager.free(a)
    assert snapshot.get_block_ids("A") == (0, 1, 2) and pool.blocks[0].ref_cnt == 1
    assert pool.free_block_queue == (3, 4, 5) and dict(snapshot.num_cached_block[0]) == {"A": 2}
    manager.reset_prefix_cache()
    assert block_hash in pool.cached_block_hash_to_block and pool.blocks[0].block_hash is not None
    assert snapshot.prefix_cache_stats.reset is False
