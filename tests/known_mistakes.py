"""Known-wrong variants of engine code, shared by the tests that prove they can fail.

A test that must be able to fail runs its check on the real code and on one of
these, and expects the check to pass on the first and fail on the second.
"""

from __future__ import annotations


def free_one_at_a_time(pool, ordered_blocks) -> None:
    """A known-wrong ``BlockPool.free_blocks``: unhashed blocks go to the head one by one, which reverses them.

    vLLM 0.33 collects the unhashed blocks and ``prepend_n``s them, so the
    first block given becomes the new head.
    """
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                pool.free_block_queue.appendleft(block)
            else:
                pool.free_block_queue.append(block)


def sliding_window_hit_from_the_left(
    block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id
):
    """A known-wrong ``find_sliding_window_cache_hit``: full attention's walk, from block 0 up to the first miss.

    vLLM 0.33's ``SlidingWindowManager.find_longest_cache_hit`` searches right
    to left for ``num_contiguous_blocks`` cached blocks in a row (null before
    them): with boundary-only caching a sliding-window group rarely caches
    block 0, so this finds almost nothing that vLLM finds.
    """
    found = []
    for block_hash in block_hashes[:max_num_blocks]:
        block = block_pool.get_cached_block(block_hash, kv_cache_group_id)
        if block is None:
            break
        found.append(block)
    return found


def cache_every_full_block(manager, start_block, end_block, boundaries):
    """A known-wrong ``SlidingWindowManager.cacheable_block_mask``: cache every full block (None: no mask).

    vLLM 0.33 (``prefix_cache_retention_interval=0``) caches only the blocks
    under the window at the replay boundary and at a shared-prefix junction.
    """
    return None
