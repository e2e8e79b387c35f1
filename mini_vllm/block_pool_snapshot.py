"""The block pool as plain data at one moment: ``BlockPoolSnapshot`` (chapters 02, 05, 06).

``BlockPool.snapshot`` (:mod:`mini_vllm.block_pool`) builds one; widgets, the course's
checks and the tests read the pool through it instead of walking the free queue and the
hash map themselves. It is a frozen copy, for views and checks only, never on the
engine's path. vLLM has no counterpart: its tests read ``BlockPool``'s fields directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .hashing import BlockHash


@dataclass(frozen=True)
class KVCacheBlockSnapshot:
    """One block's metadata at one moment (``KVCacheBlock`` without its free-queue links)."""

    block_id: int
    ref_cnt: int
    block_hash: BlockHash | None
    kv_cache_group_id: int  # the group it is cached for; meaningful while block_hash is set


@dataclass(frozen=True)
class BlockPoolSnapshot:
    """The pool as plain data at one moment, built by ``BlockPool.snapshot``.

    A copy: changing it changes nothing in the pool (every field is a tuple,
    a read-only mapping or a frozen dataclass). Widgets, the course's checks
    and the tests read the pool through this instead of walking its free
    queue and hash map themselves. Building one is O(num_blocks): it is for
    views and checks, never for the engine's own path.

    Attributes:
        blocks: every block, by block id.
        free_block_queue: the free queue's block ids, head (reused first) to tail.
        num_free_blocks: the queue's own count (its length, in a sound pool).
        cached_block_hash_to_block: the hash map, hash -> the ids of every
            block cached under it, first inserted first (one id but when the
            same contents were computed twice); a hybrid model's groups share
            it (each block says its group).
        num_evictions: cached blocks evicted so far.
    """

    blocks: tuple[KVCacheBlockSnapshot, ...]
    free_block_queue: tuple[int, ...]
    num_free_blocks: int
    cached_block_hash_to_block: Mapping[BlockHash, tuple[int, ...]]
    num_evictions: int

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def get_cached_block_id(self, block_hash: BlockHash, kv_cache_group_id: int = 0) -> int | None:
        """The block a lookup of ``block_hash`` in group ``kv_cache_group_id`` returns (``BlockPool.get_cached_block``)."""
        for block_id in self.cached_block_hash_to_block.get(block_hash, ()):
            if self.blocks[block_id].kv_cache_group_id == kv_cache_group_id:
                return block_id
        return None

    def cached_block_ids(self, kv_cache_group_id: int = 0) -> dict[BlockHash, int]:
        """hash -> the block a lookup in group ``kv_cache_group_id`` returns, for every hash that group has cached."""
        found = {}
        for block_hash in self.cached_block_hash_to_block:
            block_id = self.get_cached_block_id(block_hash, kv_cache_group_id)
            if block_id is not None:
                found[block_hash] = block_id
        return found

    @property
    def next_to_reuse(self) -> int | None:
        """The free queue's head: the next block ``get_new_blocks`` pops (None when none is free)."""
        return self.free_block_queue[0] if self.free_block_queue else None

    @property
    def next_to_evict(self) -> int | None:
        """The first *cached* block from the head: popping it is the next eviction (None when none is cached)."""
        for block_id in self.free_block_queue:
            if self.blocks[block_id].block_hash is not None:
                return block_id
        return None
