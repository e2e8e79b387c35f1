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
