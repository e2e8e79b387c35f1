"""The paged KV-cache pool: blocks, the free-block queue and the hash map (chapters 02, 05, 06).

The GPU memory for K/V is cut into ``num_blocks`` fixed-size blocks of
``block_size`` tokens. This module only does the *bookkeeping* for them: which
block is used by how many requests (``ref_cnt``), which blocks are free and in
what order they will be reused (``FreeKVCacheBlockQueue``), and which blocks
hold a cached prefix (the hash map). It never touches a tensor.

Two ideas carry prefix caching:

* A freed block keeps its hash and its K/V. It sits in the free queue, and
  until it is reused a new request with the same prefix can take it back
  (``touch``). Eviction is lazy: it happens only when the block is popped
  for reuse.
* The free queue is ordered for LRU: blocks popped from the head are reused
  first; a freed block that holds a cached prefix goes to the tail, so it is
  evicted last.

vLLM equivalents: ``vllm/v1/core/block_pool.py`` (``BlockPool``,
``BlockHashToBlockMap``) and ``vllm/v1/core/kv_cache_utils.py``
(``KVCacheBlock``, ``FreeKVCacheBlockQueue``). One difference: vLLM reserves
block 0 of the pool as its *null block*, the placeholder a sliding-window
group puts in a table where a block left the window (chapter 08b); here the
null block is a block of its own with id -1, outside the pool, so block ids
still run from 0 to ``num_blocks - 1`` and a pool of N blocks serves N.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .block_pool_snapshot import BlockPoolSnapshot, KVCacheBlockSnapshot

# The KV-cache events live with the engine's other events; the pool records them.
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from .hashing import BlockHash, event_extra_keys
from .validation import check_positive_int

NULL_BLOCK_ID = -1  # the null block's id: a placeholder in sliding-window tables, never in the pool

if TYPE_CHECKING:
    from .request import Request


class KVCacheBlock:
    """The metadata of one physical KV-cache block.

    Attributes:
        block_id: index of the block in the cache tensors (never changes).
        ref_cnt: how many running requests have this block in their block table.
        block_hash: the hash of the (full) block's contents while it is in the
            prefix cache, else None.
        kv_cache_group_id: the KV-cache group it is cached for (0 but in a
            hybrid model, chapter 08b); meaningful while ``block_hash`` is set.
        prev_free_block / next_free_block: links of the free-block queue; only
            meaningful while the block is in the queue (ref_cnt == 0).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "kv_cache_group_id", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int, ref_cnt: int = 0, block_hash: BlockHash | None = None):
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.block_hash = block_hash
        self.kv_cache_group_id = 0
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        # Print neighbours by id: printing them whole would recurse along the list.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        short_hash = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={short_hash}, prev_free_block={prev_id}, next_free_block={next_id})"
        )


class FreeKVCacheBlockQueue:
    """The free blocks, as a doubly linked list in reuse order (head first).

    Owns the ``prev_free_block``/``next_free_block`` links of every block in it.
    Invariants: every block in the list has ``ref_cnt == 0``; a block is in the
    list at most once; ``num_free_blocks`` is the list's length.

    Why not a Python ``deque``? A cache hit must take a block out of the
    *middle* of the queue (``remove``); with links stored in the blocks that is
    O(1). Two sentinel nodes (``fake_head``, ``fake_tail``) remove every
    "is the list empty / is this the end" special case.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(block_id=-1)
        self.fake_tail = KVCacheBlock(block_id=-1)
        previous = self.fake_head
        for block in blocks:
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = previous

    def popleft(self) -> KVCacheBlock:
        """Take the block at the head (the next one to be reused)."""
        block = self.fake_head.next_free_block
        if block is self.fake_tail or block is None:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head (ValueError if there are fewer)."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the list, in O(1)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"remove() called on block {block.block_id}, which is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: it will be reused (evicted) last."""
        self._insert_run_after(self.fake_tail.prev_free_block, (block,))

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head: it will be reused first."""
        self._insert_run_after(self.fake_head, (block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append several blocks to the tail, in the order given."""
        self._insert_run_after(self.fake_tail.prev_free_block, blocks)

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put several blocks at the head, in the order given: ``blocks[0]`` becomes the head.

        (``appendleft`` one at a time would reverse them.) O(1) per block.
        """
        self._insert_run_after(self.fake_head, blocks)

    def _insert_run_after(self, previous: KVCacheBlock | None, blocks: Iterable[KVCacheBlock]) -> None:
        """Link ``blocks``, in order, between ``previous`` and the block after it: O(1) per block.

        One pass for the whole run (as vLLM's ``append_n``): each block is
        linked to the one before it, and the run's last block to ``previous``'s
        old successor once, at the end -- also when a block turns out to be in
        the queue already (ValueError), so the queue stays a valid list holding
        the blocks linked before it.
        """
        assert previous is not None and previous.next_free_block is not None
        following = previous.next_free_block
        num_linked = 0
        try:
            for block in blocks:
                if block.prev_free_block is not None or block.next_free_block is not None:
                    raise ValueError(f"block {block.block_id} is already in the free queue")
                previous.next_free_block = block
                block.prev_free_block = previous
                previous = block
                num_linked += 1
        finally:
            previous.next_free_block = following
            following.prev_free_block = previous
            self.num_free_blocks += num_linked

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head to tail (for tests and widgets; O(n))."""
        blocks = []
        block = self.fake_head.next_free_block
        while block is not None and block is not self.fake_tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def __len__(self) -> int:
        return self.num_free_blocks


class FreeQueueBatchOperations:
    """The batch operations ``BlockPool`` calls, built on a queue's single ones (``popleft``, ``append``, ``appendleft``).

    A free-queue class given to the pool (``EngineParts.free_queue``) that
    lacks ``popleft_n``, ``append_n``, ``prepend_n`` or ``__len__`` gets them
    from here (:func:`with_batch_operations`): same order, one single
    operation per block. ``FreeKVCacheBlockQueue`` has its own (``popleft_n``
    and ``__len__`` are its very methods, which use only ``popleft`` and
    ``num_free_blocks``).
    """

    num_free_blocks: int
    popleft_n = FreeKVCacheBlockQueue.popleft_n
    __len__ = FreeKVCacheBlockQueue.__len__

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:  # blocks[0] becomes the head
        for block in reversed(list(blocks)):
            self.appendleft(block)


BATCH_OPERATIONS = ("popleft_n", "append_n", "prepend_n", "__len__")


def with_batch_operations(queue_class: Callable[[list[KVCacheBlock]], Any]) -> Callable[[list[KVCacheBlock]], Any]:
    """``queue_class`` itself when it has every batch operation, else a subclass that adds the missing ones.

    Decided once, when the pool is built: the pool's calls go straight to the
    queue's methods (no wrapper object in between), and the queue is an
    instance of ``queue_class``.
    """
    if all(hasattr(queue_class, name) for name in BATCH_OPERATIONS):
        return queue_class
    if not isinstance(queue_class, type):
        raise TypeError(
            f"free_queue must be a class, or a callable whose queues have {', '.join(BATCH_OPERATIONS)}; "
            f"got {queue_class!r}"
        )
    return type(queue_class.__name__, (queue_class, FreeQueueBatchOperations), {"__module__": queue_class.__module__})


class BlockHashToBlockMap:
    """hash → cached block(s): the prefix cache's index.

    The same contents may be computed twice (two identical prompts admitted in
    one step both compute their blocks), so one hash may own several blocks.
    Nothing de-duplicates them; lookup returns the first one inserted. To keep
    the common case cheap a single block is stored as itself, and several as a
    ``{block_id: block}`` dict (insertion-ordered).

    In a hybrid model (chapter 08b) every KV-cache group hashes the same
    tokens to the same hash but caches its own blocks: a lookup names the
    group and gets only a block cached for it (``block.kv_cache_group_id``).
    vLLM appends the group id to the key instead
    (``make_block_hash_with_group_id``); a key here is always the bare hash.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHash, kv_cache_group_id: int = 0) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            return entry if entry.kv_cache_group_id == kv_cache_group_id else None
        return next((block for block in entry.values() if block.kv_cache_group_id == kv_cache_group_id), None)

    def insert(self, key: BlockHash, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif isinstance(entry, KVCacheBlock):
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: BlockHash, block_id: int) -> KVCacheBlock | None:
        """Remove the block ``block_id`` under ``key`` (only that one) and return it."""
        entry = self._cache.get(key)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id != block_id:
                return None
            del self._cache[key]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            self._cache[key] = next(iter(entry.values()))
        elif not entry:
            del self._cache[key]
        return block

    def items(self) -> Iterable[tuple[BlockHash, KVCacheBlock]]:
        """Every (hash, block) pair, in insertion order (for checks and widgets)."""
        for key, entry in self._cache.items():
            if isinstance(entry, KVCacheBlock):
                yield key, entry
            else:
                for block in entry.values():
                    yield key, block

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()


class BlockPool:
    """Owns every ``KVCacheBlock``, the free-block queue and the prefix-cache map.

    Invariants (checked by ``KVCacheManager.check_invariants``):

    * ``blocks[i].block_id == i``;
    * a block is in ``free_block_queue`` exactly when its ``ref_cnt`` is 0;
    * a block has a ``block_hash`` exactly when the map holds it under that hash.

    Callers (the ``KVCacheManager``) own the block *tables*: which request holds
    which blocks. The pool only counts references. What it holds is handed out
    as plain data by ``snapshot()`` (``BlockPoolSnapshot``): views, checks and
    tests read that, never the queue's links or the map.

    Three of its pieces are extension points (``mini_vllm/engine_parts.py``
    says what each may change and must keep): the free queue's class
    (``free_queue``, called with the blocks, head first), ``get_new_blocks`` and
    ``free_blocks`` (functions ``(pool, ...)`` with the methods' signatures).
    A function given in place of a method becomes this pool's bound method
    (an instance attribute, so a call costs what a method call costs); the
    class's own method is the reference and is used when none is given.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        *,
        free_queue: Callable[[list[KVCacheBlock]], Any] = FreeKVCacheBlockQueue,
        get_new_blocks: Callable[[BlockPool, int], list[KVCacheBlock]] | None = None,
        free_blocks: Callable[[BlockPool, Iterable[KVCacheBlock]], None] | None = None,
        cached_block_hash_to_block: BlockHashToBlockMap | None = None,
    ):
        check_positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = with_batch_operations(free_queue)(self.blocks)
        # A part other than this class's own method becomes this pool's bound method.
        if get_new_blocks is not None and get_new_blocks is not type(self).get_new_blocks:
            self.get_new_blocks = types.MethodType(get_new_blocks, self)
        if free_blocks is not None and free_blocks is not type(self).free_blocks:
            self.free_blocks = types.MethodType(free_blocks, self)
        # (An empty map of one's own, e.g. one that counts its scans, may be given: the course's checks do.)
        if cached_block_hash_to_block is None:
            cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hash_to_block = cached_block_hash_to_block
        # What a sliding-window group's table holds where a block left the window (chapter
        # 08b): outside the pool, never allocated, freed, touched or cached.
        self.null_block = KVCacheBlock(NULL_BLOCK_ID)
        self.num_evictions = 0
        # Events are recorded only when someone listens (the engine turns this on).
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_id: int = 0) -> KVCacheBlock | None:
        """The block of group ``kv_cache_group_id`` that holds ``block_hash``'s contents, if it is still cached."""
        return self.cached_block_hash_to_block.get_one_block(block_hash, kv_cache_group_id)

    def cache_full_blocks(
        self,
        request: "Request",
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int = 0,
        block_mask: list[bool] | None = None,
    ) -> list[KVCacheBlock]:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` into the prefix cache; returns the blocks it cached.

        Their hashes come from ``request.block_hashes`` (computed when the
        request's tokens filled them). Called at *schedule* time, before the
        K/V are computed: the model computes them in the same step, before any
        later step can read them. A sliding-window group (chapter 08b) passes
        its group id and a ``block_mask`` (one entry per block of the range:
        False skips it), and its null blocks are skipped.
        """
        cached: list[KVCacheBlock] = []
        runs: list[list[int]] = []  # consecutive indices cached, for the events
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block is self.null_block or (block_mask is not None and not block_mask[index - num_cached_blocks]):
                continue
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block_hash = request.block_hashes[index]
            block.block_hash = block_hash
            block.kv_cache_group_id = kv_cache_group_id
            self.cached_block_hash_to_block.insert(block_hash, block)
            cached.append(block)
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        if self.enable_kv_cache_events:
            # One event per run of consecutive blocks: for full attention, one per call, as
            # vLLM's cache_full_blocks sends (for a sliding-window group vLLM sends one event
            # whose hashes skip the blocks it did not cache).
            block_size = request.block_size
            for run in runs:
                first, end = run[0], run[-1] + 1
                self.kv_event_queue.append(
                    BlockStored(
                        block_hashes=tuple(request.block_hashes[first:end]),
                        parent_block_hash=request.block_hashes[first - 1] if first else None,
                        token_ids=tuple(request.all_token_ids[first * block_size : end * block_size]),
                        block_size=block_size,
                        block_ids=tuple(block.block_id for block in blocks[first:end]),
                        group_idx=kv_cache_group_id,
                        extra_keys=tuple(event_extra_keys(i, request.cache_salt) for i in range(first, end)),
                    )
                )
        return cached

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue, each with ref_cnt 1.

        A popped block that still holds a cached prefix is evicted now
        (lazy eviction): its hash is cleared and it leaves the map.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool ({self.get_num_free_blocks()} free)")
        new_blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in new_blocks:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
        return new_blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop ``block`` from the prefix cache if it is in it; True if it was."""
        if block.block_hash is None:
            return False
        self._remove_from_cache(block)
        self.num_evictions += 1
        return True

    def _remove_from_cache(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the map and clear its hash (recording ``BlockRemoved``)."""
        block_hash, group_id = block.block_hash, block.kv_cache_group_id
        self.cached_block_hash_to_block.pop(block_hash, block.block_id)
        block.block_hash = None
        block.kv_cache_group_id = 0
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(block_hashes=(block_hash,), block_ids=(block.block_id,), group_idx=group_id)
            )

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take blocks back out of the prefix cache: their K/V were never written.

        Blocks are cached at schedule time, before the model computes them
        (see ``cache_full_blocks``). When that step fails, the engine calls
        this for the blocks cached in it, before anything else can look them
        up: each loses its hash and leaves the map (a ``BlockRemoved`` event
        is recorded), so no later request can hit memory that holds garbage
        or another tenant's K/V. The blocks stay with the requests holding
        them; this is not an eviction and is not counted as one.
        """
        for block in blocks:
            if block.block_hash is not None:
                self._remove_from_cache(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks (a free one leaves the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; a block reaching 0 becomes free.

        ``ordered_blocks`` come in eviction order: the first is to be reused
        first. Where a freed block goes decides how long it survives:

        * without a hash (a partial block, or caching off), to the **head**: it
          can never be hit, so it is the cheapest to reuse;
        * with a hash, to the **tail**: the last to be evicted.

        Both groups keep the order given, as vLLM 0.33's ``free_blocks``: the
        unhashed ones are put at the head together (``prepend_n``), so the
        first of them is the new head; the hashed ones are appended together
        (``append_n``). The caller passes a request's blocks in reverse, so a
        prefix's last block is evicted before its first, which more requests
        share.
        """
        blocks_to_evict_first: list[KVCacheBlock] = []
        blocks_to_evict_last: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    blocks_to_evict_first.append(block)
                else:
                    blocks_to_evict_last.append(block)
        if blocks_to_evict_first:
            self.free_block_queue.prepend_n(blocks_to_evict_first)
        if blocks_to_evict_last:
            self.free_block_queue.append_n(blocks_to_evict_last)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Refused (False) while any block is in use."""
        num_used_blocks = self.num_blocks - self.get_num_free_blocks()
        if num_used_blocks != 0:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
            block.kv_cache_group_id = 0
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the events recorded since the last call."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def snapshot(self) -> BlockPoolSnapshot:
        """The pool as plain data (a copy; O(num_blocks), for views, checks and tests only)."""
        cached: dict[BlockHash, list[int]] = {}
        for block_hash, block in self.cached_block_hash_to_block.items():
            cached.setdefault(block_hash, []).append(block.block_id)
        return BlockPoolSnapshot(
            blocks=tuple(
                KVCacheBlockSnapshot(block.block_id, block.ref_cnt, block.block_hash, block.kv_cache_group_id)
                for block in self.blocks
            ),
            free_block_queue=tuple(block.block_id for block in self.free_block_queue.get_all_free_blocks()),
            num_free_blocks=self.free_block_queue.num_free_blocks,
            cached_block_hash_to_block=types.MappingProxyType(
                {block_hash: tuple(block_ids) for block_hash, block_ids in cached.items()}
            ),
            num_evictions=self.num_evictions,
        )
