"""Pools, snapshots and counting blocks that several checks build their cases from.

Each check owns its scenarios; what they share lives here, once:

* :func:`cache_block` puts a block into the prefix cache by hand (its hash
  set and entered in the hash map), the state a finished request leaves;
* :func:`pool_state` is everything a pool holds (free queue, ref counts,
  hashes, the map), read from ``BlockPool.snapshot``, to compare two pools
  or one pool before and after a call;
* :class:`CountingBlock` counts the reads of its links and hash, and
  :func:`counting_pool` builds a large pool of them: an operation that walks
  the pool instead of using the free queue's links or the hash map shows up
  as a large count (the O(1) / O(hit length) cases of chapters 02, 05, 06).
"""

from __future__ import annotations

from typing import Any

from ..block_pool import BlockPool, KVCacheBlock
from ..hashing import BlockHash


def block_ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def cache_block(pool: BlockPool, block: KVCacheBlock, block_hash: BlockHash, kv_cache_group_id: int = 0) -> None:
    """Give ``block`` the hash ``block_hash`` (for KV-cache group ``kv_cache_group_id``) and enter it in
    ``pool``'s hash map (as ``cache_full_blocks`` does)."""
    block.block_hash = block_hash
    block.kv_cache_group_id = kv_cache_group_id
    pool.cached_block_hash_to_block.insert(block_hash, block)


def pool_state(pool: BlockPool) -> dict[str, Any]:
    """Everything a pool holds, by block id and short hash: equal states are equal pools.

    Read from ``pool.snapshot()``; the keys are what a check's message names.
    """
    snapshot = pool.snapshot()
    return {
        "free queue (head -> tail)": list(snapshot.free_block_queue),
        "num_free_blocks": snapshot.num_free_blocks,
        "ref_cnt": [b.ref_cnt for b in snapshot.blocks],
        "hashed blocks": [b.block_id for b in snapshot.blocks if b.block_hash is not None],
        "map": sorted(
            (h.hex()[:8], block_id)
            for h, block_ids_of_hash in snapshot.cached_block_hash_to_block.items()
            for block_id in block_ids_of_hash
        ),
        "block hashes": [b.block_hash.hex()[:8] if b.block_hash is not None else None for b in snapshot.blocks],
        "kv_cache_group_id of each block": [b.kv_cache_group_id for b in snapshot.blocks],
    }


class TooManySteps(BaseException):
    """Raised by a counting block past its budget: an O(n) loop stops at once instead of running on.

    A BaseException, so that the learner's ``except Exception`` cannot swallow it.
    """


class CountingBlock(KVCacheBlock):
    """A block that counts how often its links and hash are read and how often it is compared."""

    __slots__ = ()
    reads = 0  # shared by all counting blocks: reset before each measured operation
    budget = None  # when set, more reads than this raise TooManySteps

    def __getattribute__(self, name):
        if name in ("prev_free_block", "next_free_block", "block_hash"):
            CountingBlock._count()
        return object.__getattribute__(self, name)

    def __eq__(self, other):  # list.remove / list.index / `in` compare every element before the target
        CountingBlock._count()
        return self is other

    @staticmethod
    def _count() -> None:
        CountingBlock.reads += 1
        if CountingBlock.budget is not None and CountingBlock.reads > CountingBlock.budget:
            CountingBlock.budget = None
            raise TooManySteps

    __hash__ = KVCacheBlock.__hash__


def counting_pool(num_blocks: int = 20_000, **pool_kwargs: Any) -> BlockPool:
    """A ``BlockPool`` of :class:`CountingBlock` s (same ids, same free queue), its read count at 0.

    ``pool_kwargs`` go to ``BlockPool`` (e.g. a ``free_queue`` class that counts its scans).
    """
    pool = BlockPool(num_blocks, **pool_kwargs)
    for block in pool.blocks:
        block.__class__ = CountingBlock
    CountingBlock.reads = 0
    return pool


def expect_hash_map_lookups(check: Any, reads: int, num_hashes: int, lookup: str) -> None:
    """A lookup of ``num_hashes`` hashes in a :func:`counting_pool` of 20,000 blocks read ``reads`` block
    attributes: a handful per hash (``lookup``, the pool's O(1) call, names how), not a scan of the pool."""
    check.expect(
        reads <= 12 * num_hashes,
        f"a lookup of {num_hashes} hashes in a pool of 20,000 blocks read {reads:,} block attributes: its cost "
        "grows with the size of the pool",
        f"look each hash up in the hash map ({lookup}), which is O(1); do not search block_pool.blocks or the "
        "free queue for a block with that hash",
    )
