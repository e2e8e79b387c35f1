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

import copy
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .block_pool import BlockPool, BlockPoolSnapshot, KVCacheBlock, KVCacheEvent
from .config import DEFAULT_BLOCK_SIZE, check_block_size
from .validation import check_positive_int
from .hashing import BlockHash
from .kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from .request import Request

# The per-group rules and the reference parts live with the per-group managers; the
# router, the profiler, the widgets and the course import them from here too.
from .single_type_kv_cache_manager import (  # noqa: F401 (re-exported)
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    cdiv,
    find_longest_cache_hit,
    find_sliding_window_cache_hit,
    free_request_blocks,
    longest_cache_hit,
    max_cache_hit_blocks,
)


def check_retention_interval(retention_interval: int | None, kv_cache_config: KVCacheConfig) -> None:
    """ValueError unless ``prefix_cache_retention_interval`` is one vLLM 0.33 accepts for this KV cache.

    None (every block) or 0 (only boundaries, the default) always; a positive
    value only with a sliding-window group, and a multiple of the block size
    (vLLM: ``_validate_prefix_cache_retention_interval``).
    """
    if retention_interval is None:
        return
    if isinstance(retention_interval, bool) or not isinstance(retention_interval, int):
        raise ValueError(f"prefix_cache_retention_interval must be None or an int, got {retention_interval!r}")
    sliding = any(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in kv_cache_config.kv_cache_groups)
    if not sliding:
        if retention_interval == 0:
            return
        raise ValueError(
            "prefix_cache_retention_interval is set but this model has no sliding-window KV-cache group, "
            "so retention has no effect; set it to 0"
        )
    if retention_interval < 0 or retention_interval % kv_cache_config.block_size:
        raise ValueError(
            f"prefix_cache_retention_interval ({retention_interval}) must be non-negative and a multiple "
            f"of block_size ({kv_cache_config.block_size})"
        )


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


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks in every KV-cache group: what ``get_computed_blocks`` and ``allocate_slots`` hand the scheduler.

    ``blocks[g]`` are group ``g``'s blocks, in block-table order (a
    sliding-window group's hit may start with the null block). A model with
    one group (every chapter before 08b) has one sequence, ``blocks[0]``; the
    scheduler never needs to know how many there are. vLLM:
    ``KVCacheBlocks`` in ``vllm/v1/core/kv_cache_manager.py``.
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The blocks' ids, one list per group (the null block is ``NULL_BLOCK_ID``, -1)."""
        return tuple([block.block_id for block in group] for group in self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Group by group, ``self``'s blocks then ``other``'s (a hit followed by the blocks allocated after it)."""
        return KVCacheBlocks(tuple([*mine, *theirs] for mine, theirs in zip(self.blocks, other.blocks)))


@dataclass(frozen=True)
class KVCacheManagerSnapshot:
    """The KV cache as plain data at one moment, built by ``KVCacheManager.snapshot``.

    A copy: changing it changes nothing in the manager or its pool (tuples,
    read-only mappings, frozen dataclasses, and a copy of the counters). The
    one place that reads the pool's and the block tables' internals for
    widgets, the course's checks and the tests; O(num_blocks), never on the
    engine's own path.

    Attributes:
        block_pool: the pool's snapshot (blocks, free queue, hash map, evictions).
        req_to_block_ids: per KV-cache group, in group order: request id ->
            its block table as block ids (the null block is ``NULL_BLOCK_ID``,
            -1), in the order the requests got their tables.
        num_cached_block: per group: request id -> how many of its blocks are
            in the prefix cache.
        prefix_cache_stats: a copy of the manager's counters.
    """

    block_pool: BlockPoolSnapshot
    req_to_block_ids: tuple[Mapping[str, tuple[int, ...]], ...]
    num_cached_block: tuple[Mapping[str, int], ...]
    prefix_cache_stats: PrefixCacheStats

    @property
    def num_evictions(self) -> int:
        return self.block_pool.num_evictions

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.req_to_block_ids)

    def get_block_ids(self, request_id: str, kv_cache_group_id: int = 0) -> tuple[int, ...]:
        """The request's block table in group ``kv_cache_group_id`` (``()`` when it holds none)."""
        return self.req_to_block_ids[kv_cache_group_id].get(request_id, ())

    def get_block_ids_by_group(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's block table in every group, in group order (``KVCacheManager.get_block_ids_by_group``)."""
        return tuple(tables.get(request_id, ()) for tables in self.req_to_block_ids)


class KVCacheManager:
    """Owns the ``BlockPool`` and, through one manager per KV-cache group, every request's block tables.

    With one group (every model before chapter 08b) there is one block table
    per request, ``req_to_blocks``. A hybrid model's ``kv_cache_config`` has
    several groups (gpt-oss: one full-attention and one sliding-window group;
    Gemma 3: one and five): each group's manager
    (``managers``, ``single_type_kv_cache_manager.py``) keeps its own table
    per request, all take blocks from the one pool, and a hit is the prefix
    that every group can serve (vLLM: ``KVCacheManager`` over a
    ``HybridKVCacheCoordinator``). ``prefix_cache_retention_interval``:
    which blocks a sliding-window group caches (vLLM's setting; 0, the
    default, only those at boundaries; see ``SlidingWindowManager``).

    Invariants (``check_invariants`` asserts them):

    * each block's ``ref_cnt`` equals the number of block tables holding it;
    * the free queue holds exactly the blocks with ``ref_cnt == 0``, once each;
    * every block with a hash is found through the map under that hash, and the
      map holds no block whose hash differs from its key.

    Requests are never mutated here except for their hashes being read;
    ``num_computed_tokens`` belongs to the scheduler. ``snapshot()`` hands out
    the pool, every group's tables and the counters as plain data
    (``KVCacheManagerSnapshot``), for views, checks and tests.

    Extension points (``mini_vllm/engine_parts.py``), handed to the group
    managers: ``find_longest_cache_hit(block_pool, block_hashes,
    max_num_blocks)`` (full attention's lookup), ``free_request_blocks(block_pool,
    req_blocks)`` (every group's) and ``find_sliding_window_cache_hit`` (a
    sliding-window group's lookup); the functions of those names in
    ``single_type_kv_cache_manager.py`` are the reference. ``block_pool``: the
    pool to manage (the engine builds it with its parts); by default a plain
    ``BlockPool(num_blocks, ...)``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        *,
        kv_cache_config: KVCacheConfig | None = None,
        block_pool: BlockPool | None = None,
        find_longest_cache_hit: Callable[[BlockPool, Sequence[BlockHash], int], list[KVCacheBlock]] = (
            find_longest_cache_hit
        ),
        free_request_blocks: Callable[[BlockPool, list[KVCacheBlock]], None] = free_request_blocks,
        find_sliding_window_cache_hit: Callable[..., list[KVCacheBlock]] = find_sliding_window_cache_hit,
        prefix_cache_retention_interval: int | None = 0,
    ) -> None:
        check_block_size(block_size)
        check_positive_int("num_blocks", num_blocks)
        if kv_cache_config is None:  # one full-attention group (its layers: all of them)
            kv_cache_config = KVCacheConfig(num_blocks, (KVCacheGroupSpec((), FullAttentionSpec(block_size)),))
        elif kv_cache_config.num_blocks != num_blocks or kv_cache_config.block_size != block_size:
            raise ValueError("kv_cache_config must have num_blocks blocks of block_size tokens")
        check_retention_interval(prefix_cache_retention_interval, kv_cache_config)
        kinds = [isinstance(group.kv_cache_spec, FullAttentionSpec) for group in kv_cache_config.kv_cache_groups]
        if kinds != sorted(kinds, reverse=True):
            raise ValueError("the full-attention KV-cache groups must come first (group 0 onwards)")
        self.kv_cache_config = kv_cache_config
        self.prefix_cache_retention_interval = prefix_cache_retention_interval
        self.block_size = block_size
        self.enable_caching = enable_caching
        if block_pool is None:
            block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        elif block_pool.num_blocks != num_blocks or block_pool.enable_caching != enable_caching:
            raise ValueError("block_pool must have num_blocks blocks and the same enable_caching")
        self.block_pool = block_pool
        managers: list[SingleTypeKVCacheManager] = []
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if isinstance(spec, FullAttentionSpec):
                manager: SingleTypeKVCacheManager = FullAttentionManager(
                    spec,
                    block_pool,
                    group_id,
                    free_request_blocks=free_request_blocks,
                    find_longest_cache_hit=find_longest_cache_hit,
                )
            elif isinstance(spec, SlidingWindowSpec):
                manager = SlidingWindowManager(
                    spec,
                    block_pool,
                    group_id,
                    free_request_blocks=free_request_blocks,
                    find_sliding_window_cache_hit=find_sliding_window_cache_hit,
                    retention_interval=prefix_cache_retention_interval,
                )
            else:
                raise TypeError(f"unsupported KV-cache spec {spec!r}")
            managers.append(manager)
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(managers)  # one per group, in group order
        # Only a sliding-window group gives blocks back while a request runs.
        self.sliding_window_managers = tuple(m for m in managers if isinstance(m, SlidingWindowManager))
        # Groups with one spec, looked up together; full attention first (vLLM: ``attention_groups``).
        spec_groups: dict = {}
        for manager in managers:
            spec_groups.setdefault(manager.kv_cache_spec, []).append(manager)
        self.spec_groups: tuple[tuple[SingleTypeKVCacheManager, ...], ...] = tuple(
            tuple(group)
            for group in sorted(spec_groups.values(), key=lambda group: not isinstance(group[0], FullAttentionManager))
        )
        # One spec, or full attention and one other: one round of the lookup settles the hit.
        self.one_lookup_round = len(self.spec_groups) == 1 or (
            len(self.spec_groups) == 2 and isinstance(self.spec_groups[0][0], FullAttentionManager)
        )
        # The hit and the allocation of a request that gets no block (one empty sequence per group, shared).
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in managers))
        # The lookup, chosen once, as vLLM picks its coordinator (``get_kv_cache_coordinator``): one group
        # looks itself up; several find the prefix every group can serve.
        self.find_cache_hit = self.find_unitary_cache_hit if len(managers) == 1 else self.find_hybrid_cache_hit
        # A hybrid lookup's shared-prefix junction per request (see get_computed_blocks).
        self.shared_prefix_boundary: dict[str, int] = {}
        # Blocks entered into the cache since the last take_newly_cached_blocks(), by id
        # (a dict, so it never outgrows the pool when nobody takes it): the scheduler
        # takes them once per step, so that a failed step can uncache them.
        self.newly_cached_blocks: dict[int, KVCacheBlock] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Group 0's block tables: request id -> its blocks (in a single-group engine, *the* block table)."""
        return self.managers[0].req_to_blocks

    @property
    def num_cached_block(self) -> dict[str, int]:
        """Group 0's count of each request's blocks already in the prefix cache."""
        return self.managers[0].num_cached_block

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
        """Group 0's hit for ``block_hashes`` (at most ``max_num_blocks`` blocks).

        In a single-group engine: the longest cached prefix, by the
        ``find_longest_cache_hit`` part over this manager's pool (the
        reference stops at the first miss).
        """
        return self.managers[0].find_longest_cache_hit(block_hashes, max_num_blocks)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's cached prefix: (its blocks in every group, the number of tokens they hold).

        Takes no references: the scheduler may still decide not to admit the
        request; ``allocate_slots`` takes them. The hit is capped at
        ``(num_tokens - 1) // block_size`` blocks: the last prompt token must be
        computed even when everything is cached, because its logits give the
        first output token. A fully cached 48-token prompt therefore hits 2
        blocks (32 tokens) with 16-token blocks, and recomputes the third.

        The blocks come as ``KVCacheBlocks``: one list per KV-cache group, all
        as long as the hit (one list with one group; chapter 08b's hybrid
        models have several, and a sliding-window group's list holds the null
        block before its window). The hit is the prefix *every* group can
        serve (``find_cache_hit``: ``find_unitary_cache_hit`` with one group,
        ``find_hybrid_cache_hit`` with several). When the full-attention group
        could serve more, that longer prefix is a *junction* shared with an
        earlier request: the sliding-window groups will cache their blocks
        there (``shared_prefix_boundary``).

        Counts nothing: a lookup is counted when the request is admitted
        (``allocate_slots``), so a request looked up in several steps before
        it fits counts once.
        """
        self._check_block_size(request)
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        max_num_blocks = max_cache_hit_blocks(request.num_tokens, self.block_size)
        hits, num_hit_blocks = self.find_cache_hit(request, max_num_blocks)
        return self.create_kv_cache_blocks(hits), num_hit_blocks * self.block_size

    def find_unitary_cache_hit(
        self, request: Request, max_num_blocks: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """One group's hit: (its blocks, as the one group's, their number) (vLLM: ``UnitaryKVCacheCoordinator``)."""
        blocks = self.managers[0].find_longest_cache_hit(request.block_hashes, max_num_blocks)
        return (blocks,), len(blocks)

    def find_hybrid_cache_hit(
        self, request: Request, max_num_blocks: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The prefix every group can serve: (each group's blocks of it, its length in blocks).

        As vLLM 0.33's ``HybridKVCacheCoordinator.find_longest_cache_hit``.
        Groups that share a spec (Gemma 3's five sliding-window groups) are
        looked up once, together: a block counts only when every one of them
        has it cached (``spec_groups``). Each spec then accepts the candidate
        length or cuts it; when one cuts it, every spec is asked again, until
        none does (a fixed point: the length only shrinks). Full attention
        goes first and is looked up once (its hit is a prefix: cutting it is
        enough); with one spec, or full attention and one other, one round
        suffices (``one_lookup_round``). The full-attention blocks are then
        cut to the final length.
        """
        hits: list[list[KVCacheBlock] | None] = [None] * len(self.managers)
        num_hit_blocks = max_num_blocks
        longest = 0
        while True:
            candidate = num_hit_blocks
            for managers in self.spec_groups:
                first = managers[0]
                if isinstance(first, FullAttentionManager) and hits[first.kv_cache_group_id] is not None:
                    candidate = min(candidate, len(hits[first.kv_cache_group_id]))
                    continue
                for manager, blocks in zip(
                    managers, first.find_spec_cache_hit(request.block_hashes, candidate, managers)
                ):
                    hits[manager.kv_cache_group_id] = blocks
                candidate = len(hits[first.kv_cache_group_id])
                longest = max(longest, candidate)
            if candidate >= num_hit_blocks or self.one_lookup_round:
                num_hit_blocks = min(num_hit_blocks, candidate)
                break
            num_hit_blocks = candidate
        self.shared_prefix_boundary[request.request_id] = longest * self.block_size if longest > num_hit_blocks else 0
        return tuple([blocks[:num_hit_blocks] for blocks in hits]), num_hit_blocks

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        """``blocks`` (one sequence per group) as ``KVCacheBlocks``; the shared empty one when all are empty."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def _computed_blocks_by_group(
        self, new_computed_blocks: KVCacheBlocks | None
    ) -> tuple[Sequence[KVCacheBlock], ...]:
        """The hit handed to ``allocate_slots``: one sequence per group (none given: empty ones)."""
        if new_computed_blocks is None:
            return self.empty_kv_cache_blocks.blocks
        if not isinstance(new_computed_blocks, KVCacheBlocks) or len(new_computed_blocks.blocks) != len(self.managers):
            raise ValueError(
                f"new_computed_blocks must be the KVCacheBlocks that get_computed_blocks returned (one sequence "
                f"for each of the {len(self.managers)} KV-cache groups), got {type(new_computed_blocks).__name__}"
            )
        return new_computed_blocks.blocks

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
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Args:
            num_new_tokens: tokens to compute in this step (prompt tokens, or 1 for a decode).
            num_new_computed_tokens: tokens of the cache hit (first admission only).
            new_computed_blocks: the hit blocks from ``get_computed_blocks``.
            num_lookahead_tokens: extra slots for speculative (draft) tokens:
                allocated, but never cached, since they may be rejected.

        Returns the newly allocated blocks, per group (``KVCacheBlocks``; its
        lists are empty when none were needed), or None — changing no
        reference count — when the pool cannot serve the request.
        Hit blocks that sit in the free queue (ref_cnt 0) count toward what is
        needed: touching them takes them out of the queue.

        First, a sliding-window group gives back the blocks that left the
        window (even when the allocation then fails, as vLLM does: they are
        not needed either way). Every block that becomes full with this
        step's tokens is hashed into the cache *now*, at schedule time, so a
        request admitted later in the same step can already hit it.

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
        hits = self._computed_blocks_by_group(new_computed_blocks)
        request_id = request.request_id
        is_admission = request_id not in self.managers[0].req_to_blocks  # every group's table starts together

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        for manager in self.sliding_window_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)
        num_blocks_to_allocate = 0
        for manager, blocks in zip(self.managers, hits):
            num_blocks_to_allocate += manager.get_num_blocks_to_allocate(
                request_id, num_tokens_need_slot, blocks, num_computed_tokens
            )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None

        if any(hits):
            if not self.enable_caching:
                raise ValueError("new_computed_blocks given but prefix caching is disabled")
            # Every group takes its hit before any group pops new blocks, which could evict them.
            for manager, blocks in zip(self.managers, hits):
                manager.add_computed_blocks(request_id, blocks, num_computed_tokens)
        new_blocks = tuple([manager.allocate_new_blocks(request_id, num_tokens_need_slot) for manager in self.managers])

        if self.enable_caching:
            # Only tokens that are final are cached: never the lookahead slots.
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            # Where a later request can resume: a resent prompt, and a junction the lookup found.
            boundaries = (request.num_prompt_tokens - 1, self.shared_prefix_boundary.get(request_id, 0))
            for manager in self.managers:
                for block in manager.cache_blocks(request, num_tokens_to_cache, boundaries):
                    self.newly_cached_blocks[block.block_id] = block
        if is_admission:
            self.record_prefix_cache_stats(request, num_new_computed_tokens)
        return self.create_kv_cache_blocks(new_blocks)

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
        """Release the request's blocks, group by group, each table last block first (a no-op for unknown requests).

        Each group forgets its table and hands it to the ``free_request_blocks``
        part (the reference frees it in reverse: a prefix's *last* block is
        evicted first and its first block, shared by the most requests, last).
        """
        for manager in self.managers:
            manager.free(request.request_id)
        self.shared_prefix_boundary.pop(request.request_id, None)

    # -- inspection -------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (group 0's in a hybrid engine) as physical block ids."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_block_ids_by_group(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in every group, as ids (the null block is ``NULL_BLOCK_ID``, -1)."""
        return tuple(
            [block.block_id for block in manager.req_to_blocks.get(request_id, [])] for manager in self.managers
        )

    def block_ids_of(self, blocks: KVCacheBlocks) -> tuple[int, ...]:
        """The ids of a hit or of new blocks, every group's in group order, the null block left out (for events)."""
        null = self.block_pool.null_block
        return tuple(block.block_id for group in blocks.blocks for block in group if block is not null)

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def snapshot(self) -> KVCacheManagerSnapshot:
        """The pool, every group's block tables and the counters, as plain data (a copy; for views and tests)."""
        return KVCacheManagerSnapshot(
            block_pool=self.block_pool.snapshot(),
            req_to_block_ids=tuple(
                types.MappingProxyType(
                    {
                        request_id: tuple(block.block_id for block in blocks)
                        for request_id, blocks in manager.req_to_blocks.items()
                    }
                )
                for manager in self.managers
            ),
            num_cached_block=tuple(types.MappingProxyType(dict(manager.num_cached_block)) for manager in self.managers),
            prefix_cache_stats=copy.copy(self.prefix_cache_stats),
        )

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
        null = pool.null_block
        holders = Counter(
            block.block_id
            for manager in self.managers
            for table in manager.req_to_blocks.values()
            for block in table
            if block is not null
        )
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {holders[block.block_id]} block tables"
            )
        assert null.ref_cnt == 0 and null.block_hash is None, "the null block was touched or cached"
        free_ids = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
        assert len(free_ids) == len(set(free_ids)), f"a block is twice in the free queue: {free_ids}"
        assert len(free_ids) == pool.free_block_queue.num_free_blocks, (
            f"the free queue's num_free_blocks is {pool.free_block_queue.num_free_blocks}, but walking its links "
            f"(get_all_free_blocks) finds {len(free_ids)} blocks, {free_ids}: the count or the links are wrong"
        )
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
        for manager in self.managers:
            for request_id, num_cached in manager.num_cached_block.items():
                table = manager.req_to_blocks.get(request_id, [])
                assert num_cached <= len(table), (
                    f"{request_id}: {num_cached} cached blocks but a table of {len(table)} (group {manager.kv_cache_group_id})"
                )
            for request_id, table in manager.req_to_blocks.items():
                # A sliding-window table holds nulls only before its window: a run at its start.
                first_real = next((i for i, block in enumerate(table) if block is not null), len(table))
                assert all(block is not null for block in table[first_real:]), (
                    f"{request_id}: a null block after a real one in group {manager.kv_cache_group_id}"
                )
