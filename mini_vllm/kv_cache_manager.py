"""The KV-cache manager: block tables, prefix lookup and allocation (chapters 05, 06, 08).

The scheduler talks to this class only. For a waiting request it asks
``get_computed_blocks`` (which prefix is already cached?) and then
``allocate_slots`` (give me room for N more tokens); when a request finishes
or is preempted it calls ``free``. The manager turns those calls into
operations on the ``BlockPool``.

vLLM equivalent: ``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager``) and
``vllm/v1/core/single_type_kv_cache_manager.py`` (``FullAttentionManager``,
whose ``find_longest_cache_hit`` this mirrors).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .block_pool import BlockPool, KVCacheBlock, KVCacheEvent
from .config import DEFAULT_BLOCK_SIZE, check_block_size
from .hashing import BlockHash
from .request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, as vLLM 0.33's ``PrefixCacheStats`` (``vllm/v1/metrics/stats.py``).

    A lookup is counted once, when its request is *admitted* (its first
    ``allocate_slots`` succeeds): a request whose allocation failed and that
    is looked up again next step counts once, and nothing is counted with
    caching off. Re-admissions of preempted requests are counted apart, in
    the ``preempted_*`` counters, so that recomputing a preempted request's own
    blocks does not inflate the hit rate.

    ``requests``: admitted requests; ``queries``: their tokens at admission;
    ``hits``: of those, tokens found in the cache (vLLM's metrics
    ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` are
    ``queries`` / ``hits``). ``reset`` is True once ``reset_prefix_cache``
    succeeded. vLLM hands these out per scheduler step
    (``make_prefix_cache_stats`` returns and clears them) and its logger keeps
    a hit rate over the last 1000 requests; mini-vLLM keeps them cumulative.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Count one admitted request's lookup (vLLM: ``PrefixCacheStats.record``)."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` over new requests (0.0 before any)."""
        return self.hits / self.queries if self.queries else 0.0


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` tokens hold ``a`` tokens."""
    return -(-a // b)


def max_cache_hit_blocks(num_tokens: int, block_size: int) -> int:
    """The most blocks a prompt of ``num_tokens`` tokens may take from the cache: the last-block rule.

    ``(num_tokens - 1) // block_size``: the prompt's last token is always
    computed, because its logits give the first output token, so a fully cached
    48-token prompt with 16-token blocks reuses 2 blocks and recomputes the
    third (vLLM: ``max_cache_hit_length = request.num_tokens - 1`` in
    ``KVCacheManager.get_computed_blocks``). Everything that caps a hit calls this.
    """
    return max(0, num_tokens - 1) // block_size


T = TypeVar("T")


def longest_cache_hit(block_hashes: Iterable[BlockHash], lookup: Callable[[BlockHash], T | None]) -> list[T]:
    """What ``lookup`` finds for the leading ``block_hashes``, up to the first miss: the longest cached prefix.

    Stops at the first hash ``lookup`` returns None for: block ``i``'s hash
    chains over every block before it, so a later block can only be reused if
    all earlier ones are. The engine passes ``BlockPool.get_cached_block``;
    the router, the profiler and the hash-chain widget pass their own
    hash -> value map's ``get``. Everything that walks a chain calls this.
    """
    found: list[T] = []
    for block_hash in block_hashes:
        value = lookup(block_hash)
        if value is None:
            break
        found.append(value)
    return found


def find_longest_cache_hit(
    block_pool: BlockPool, block_hashes: Sequence[BlockHash], max_num_blocks: int
) -> list[KVCacheBlock]:
    """The cached blocks for the longest prefix of ``block_hashes`` (at most ``max_num_blocks``), from ``block_pool``.

    The reference of the ``find_longest_cache_hit`` extension point (chapter
    05): stops at the first miss (``longest_cache_hit``), since block ``i``'s
    hash chains over every block before it, so a later block can only be valid
    if all earlier ones are. One dict lookup per block hit; takes no reference.
    """
    return longest_cache_hit(block_hashes[:max_num_blocks], block_pool.get_cached_block)


def free_request_blocks(block_pool: BlockPool, req_blocks: list[KVCacheBlock]) -> None:
    """Free a request's block table, last block first: the reference of the ``free_request_blocks`` point (chapter 06).

    Reverse order matters for eviction: freed cached blocks join the free
    queue's tail in this order, so a prefix's *last* block is evicted first
    and its first block, shared by the most requests, last.
    """
    block_pool.free_blocks(reversed(req_blocks))


class KVCacheManager:
    """Owns every request's block table (``req_to_blocks``) and the ``BlockPool``.

    Invariants (``check_invariants`` asserts them):

    * each block's ``ref_cnt`` equals the number of block tables holding it;
    * the free queue holds exactly the blocks with ``ref_cnt == 0``, once each;
    * every block with a hash is found through the map under that hash, and the
      map holds no block whose hash differs from its key.

    Requests are never mutated here except for their hashes being read;
    ``num_computed_tokens`` belongs to the scheduler.

    Two extension points are the manager's (``mini_vllm/engine_parts.py``):
    ``find_longest_cache_hit(block_pool, block_hashes, max_num_blocks)``, which
    the method of that name calls, and ``free_request_blocks(block_pool,
    req_blocks)``, which ``free`` calls; the module's functions of those names
    are the reference. ``block_pool``: the pool to manage (the engine builds
    it with its parts); by default a plain ``BlockPool(num_blocks, ...)``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        *,
        block_pool: BlockPool | None = None,
        find_longest_cache_hit: Callable[[BlockPool, Sequence[BlockHash], int], list[KVCacheBlock]] = (
            find_longest_cache_hit
        ),
        free_request_blocks: Callable[[BlockPool, list[KVCacheBlock]], None] = free_request_blocks,
    ) -> None:
        check_block_size(block_size)
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        if block_pool is None:
            block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        elif block_pool.num_blocks != num_blocks or block_pool.enable_caching != enable_caching:
            raise ValueError("block_pool must have num_blocks blocks and the same enable_caching")
        self.block_pool = block_pool
        self.find_longest_cache_hit_fn = find_longest_cache_hit
        self.free_request_blocks_fn = free_request_blocks
        # request_id -> its block table: logical block i lives in physical block req_to_blocks[id][i].
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many of its blocks are already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Blocks entered into the cache since the last take_newly_cached_blocks(), by id
        # (a dict, so it never outgrows the pool when nobody takes it): the scheduler
        # takes them once per step, so that a failed step can uncache them.
        self.newly_cached_blocks: dict[int, KVCacheBlock] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far (the pool counts them as it reuses them)."""
        return self.block_pool.num_evictions

    @property
    def usage(self) -> float:
        """Fraction of the pool held by running requests."""
        return self.block_pool.get_usage()

    # -- lookup -----------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks for the longest prefix of ``block_hashes`` (at most ``max_num_blocks``).

        The ``find_longest_cache_hit`` part over this manager's pool (the
        reference: the module's ``find_longest_cache_hit``, one dict lookup per
        block hit, stopping at the first miss).
        """
        return self.find_longest_cache_hit_fn(self.block_pool, block_hashes, max_num_blocks)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The request's cached prefix: (blocks, number of tokens they hold).

        Takes no references: the scheduler may still decide not to admit the
        request; ``allocate_slots`` takes them. The hit is capped at
        ``(num_tokens - 1) // block_size`` blocks: the last prompt token must be
        computed even when everything is cached, because its logits give the
        first output token. A fully cached 48-token prompt therefore hits 2
        blocks (32 tokens) with 16-token blocks, and recomputes the third.

        Counts nothing: a lookup is counted when the request is admitted
        (``allocate_slots``), so a request looked up in several steps before
        it fits counts once.
        """
        self._check_block_size(request)
        if not self.enable_caching:
            return [], 0
        max_num_blocks = max_cache_hit_blocks(request.num_tokens, self.block_size)
        computed_blocks = self.find_longest_cache_hit(request.block_hashes, max_num_blocks)
        num_computed_tokens = len(computed_blocks) * self.block_size
        return computed_blocks, num_computed_tokens

    def _check_block_size(self, request: Request) -> None:
        # The request's hashes are per block of *its* size: they must match the pool's.
        if request.block_size != self.block_size:
            raise ValueError(
                f"request {request.request_id!r} was hashed with block_size={request.block_size}, "
                f"but the KV cache uses block_size={self.block_size}"
            )

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count an admitted request's lookup: ``num_hits`` of its tokens were cached.

        A request that was preempted before counts in the ``preempted_*``
        counters; with caching off nothing is counted (vLLM 0.33's
        ``KVCacheManager.record_prefix_cache_stats``). ``allocate_slots`` calls
        it when it admits a request.
        """
        if not self.enable_caching:
            return
        self.prefix_cache_stats.record(request.num_tokens, num_hits, preempted=request.num_preemptions > 0)

    # -- allocation -------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Args:
            num_new_tokens: tokens to compute in this step (prompt tokens, or 1 for a decode).
            num_new_computed_tokens: tokens of the cache hit (first admission only).
            new_computed_blocks: the hit blocks from ``get_computed_blocks``.
            num_lookahead_tokens: extra slots for speculative (draft) tokens:
                allocated, but never cached, since they may be rejected.

        Returns the newly allocated blocks (``[]`` when none were needed), or
        None — changing nothing at all — when the pool cannot serve the request.
        Hit blocks that sit in the free queue (ref_cnt 0) count toward what is
        needed: touching them takes them out of the queue.

        Every block that becomes full with this step's tokens is hashed into the
        cache *now*, at schedule time, so a request admitted later in the same
        step can already hit it.

        A request that held no blocks is being *admitted*: when its allocation
        succeeds, its lookup is counted in ``prefix_cache_stats`` (once, even
        if earlier attempts failed). vLLM 0.33's scheduler makes that call
        (``record_prefix_cache_stats``) right after a successful
        ``allocate_slots``; here ``allocate_slots`` makes it, so every caller
        counts the same way.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        self._check_block_size(request)
        new_computed_blocks = list(new_computed_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        is_admission = not req_blocks

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_required_blocks = cdiv(num_tokens_need_slot, self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(req_blocks) - len(new_computed_blocks))
        # A hit block with ref_cnt 0 is in the free queue: taking it uses up a free block.
        num_evictable_computed_blocks = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_evictable_computed_blocks > self.block_pool.get_num_free_blocks():
            if not req_blocks:
                del self.req_to_blocks[request.request_id]  # leave no trace of a failed admission
            return None

        if new_computed_blocks:
            if not self.enable_caching:
                raise ValueError("new_computed_blocks given but prefix caching is disabled")
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        if request.request_id not in self.num_cached_block:
            # The hit blocks are cached already: caching starts after them.
            self.num_cached_block[request.request_id] = len(new_computed_blocks)

        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Only tokens that are final are cached: never the lookahead slots.
            self.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        if is_admission:
            self.record_prefix_cache_stats(request, num_new_computed_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full after ``num_computed_tokens`` tokens into the cache."""
        num_full_blocks = num_computed_tokens // self.block_size
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        if num_full_blocks <= num_cached_blocks:
            return
        req_blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(request, req_blocks, num_cached_blocks, num_full_blocks)
        for block in req_blocks[num_cached_blocks:num_full_blocks]:
            self.newly_cached_blocks[block.block_id] = block
        self.num_cached_block[request.request_id] = num_full_blocks

    def take_newly_cached_blocks(self) -> list[KVCacheBlock]:
        """The blocks cached since the last call (at schedule time: their K/V are not written yet)."""
        blocks = list(self.newly_cached_blocks.values())
        self.newly_cached_blocks = {}
        return blocks

    def uncache_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take blocks whose K/V were never computed back out of the prefix cache.

        The engine calls this when a step fails, with the blocks that step
        cached (``SchedulerOutput.newly_cached_blocks``). Each loses its hash
        and leaves the map; the requests holding them are then finished or
        rolled back by the scheduler, which frees them.
        """
        self.block_pool.uncache_blocks(blocks)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (a no-op for unknown requests).

        Forgets its block table, then hands the table to the
        ``free_request_blocks`` part (the reference, the module's
        ``free_request_blocks``, frees it in reverse: a prefix's *last* block
        is evicted first and its first block, shared by the most requests, last).
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.free_request_blocks_fn(self.block_pool, blocks)

    # -- inspection -------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as physical block ids."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing changes) while blocks are in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def set_kv_cache_events(self, enabled: bool) -> None:
        """Record the pool's KV events or stop; stopping drops the events nobody took."""
        self.block_pool.enable_kv_cache_events = enabled
        if not enabled:
            self.block_pool.take_events()

    def check_invariants(self) -> None:
        """Assert the class invariants (for tests; O(num_blocks))."""
        pool = self.block_pool
        holders = Counter(block.block_id for table in self.req_to_blocks.values() for block in table)
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {holders[block.block_id]} block tables"
            )
        free_ids = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
        assert len(free_ids) == len(set(free_ids)), f"a block is twice in the free queue: {free_ids}"
        assert len(free_ids) == pool.free_block_queue.num_free_blocks, "num_free_blocks is out of date"
        expected_free = {block.block_id for block in pool.blocks if block.ref_cnt == 0}
        assert set(free_ids) == expected_free, (
            f"free queue {sorted(free_ids)} != blocks with ref_cnt 0 {sorted(expected_free)}"
        )
        mapped = {}
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"block {block.block_id} is in the map under another hash"
            mapped[block.block_id] = block_hash
        for block in pool.blocks:
            if block.block_hash is not None:
                assert mapped.get(block.block_id) == block.block_hash, (
                    f"hashed block {block.block_id} is not in the map"
                )
            if not self.enable_caching:
                assert block.block_hash is None, "caching is off but a block has a hash"
        for request_id, num_cached in self.num_cached_block.items():
            table = self.req_to_blocks.get(request_id, [])
            assert num_cached <= len(table), f"{request_id}: {num_cached} cached blocks but a table of {len(table)}"
