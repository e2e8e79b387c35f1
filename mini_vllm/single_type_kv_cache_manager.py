"""One KV-cache group's block tables: full attention and sliding window (chapters 05, 06, 08b).

``KVCacheManager`` runs one of these per KV-cache group over the one shared
``BlockPool``. A group's manager owns, for its layers, every request's block
table and how many of its blocks are cached; what differs between kinds of
layers is only this:

* which cached blocks a hit needs (``find_longest_cache_hit``): a
  full-attention layer needs the whole prefix, a sliding-window layer only
  the blocks under the window of the first token it computes;
* which blocks a running request may give back early
  (``get_num_skipped_tokens``): none for full attention; for a sliding window
  every block that lies entirely before the next token's window;
* which full blocks are worth caching (``cacheable_block_mask``): all for
  full attention; for a sliding window only the few that a later hit can use.

vLLM equivalent: ``vllm/v1/core/single_type_kv_cache_manager.py``
(``SingleTypeKVCacheManager``, ``FullAttentionManager``,
``SlidingWindowManager``), without what mini-vLLM does not serve
(speculative decoding's EAGLE drop, KV connectors, partial-block hits,
block sizes that differ between groups).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from .block_pool import BlockPool, KVCacheBlock
from .hashing import BlockHash
from .kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from .request import Request


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


def sliding_window_contiguous_blocks(sliding_window: int, block_size: int) -> int:
    """How many consecutive cached blocks a sliding-window hit needs: ``cdiv(sliding_window - 1, block_size)``.

    A hit of ``n`` tokens means the next token computed is token ``n``; its
    window is tokens ``n - sliding_window + 1 .. n``, of which the
    ``sliding_window - 1`` before it must already be in the cache. They end
    at a block boundary, so they fill ``cdiv(sliding_window - 1, block_size)``
    blocks (vLLM: ``SlidingWindowManager._contiguous_blocks_for_hit``).
    """
    return cdiv(sliding_window - 1, block_size)


def find_sliding_window_cache_hit(
    block_pool: BlockPool,
    block_hashes: Sequence[BlockHash],
    max_num_blocks: int,
    num_contiguous_blocks: int,
    kv_cache_group_id: int,
) -> list[KVCacheBlock]:
    """The longest hit a sliding-window group can serve: the reference of the ``find_sliding_window_cache_hit`` point.

    Returns a list of at most ``max_num_blocks`` entries: the hit's last
    ``num_contiguous_blocks`` blocks are cached blocks of group
    ``kv_cache_group_id``; every position before them holds
    ``block_pool.null_block`` (outside the window: nothing needed there).
    The search runs right to left, so the longest hit is found first, and
    stops at the first run of ``num_contiguous_blocks`` cached blocks. With no
    such run, the cached blocks from block 0 up to the first miss are still a
    hit, however few (the window of the next token reaches back to the start;
    all ``max_num_blocks`` of them when none is missing); a shorter run
    anywhere else is not, and with block 0 missing the hit is ``[]``.

    Unlike full attention, a miss at block ``i`` says nothing about block
    ``i + 1``: a later run can be cached although an earlier block was
    evicted. vLLM: ``SlidingWindowManager.find_longest_cache_hit``.
    """
    computed: list[KVCacheBlock] = [block_pool.null_block] * max_num_blocks
    num_found = 0  # cached blocks in the current run, counted from its right end
    for i in range(max_num_blocks - 1, -1, -1):
        block = block_pool.get_cached_block(block_hashes[i], kv_cache_group_id)
        if block is None:
            num_found = 0
            continue
        computed[i] = block
        num_found += 1
        if num_found >= num_contiguous_blocks:
            return computed[: i + num_found]  # blocks i .. i + num_found - 1, nulls before
    # No full run: only a run from block 0 (of length num_found) is usable.
    return computed[:num_found]


class SpecGroupPoolView:
    """The pool as the lookup of several groups with one spec sees it: a hash is cached when *every* group has it.

    Gemma 3's five sliding-window groups are looked up once, together (vLLM:
    ``BlockPool.get_cached_block(hash, kv_cache_group_ids)``). The lookup
    parts (``find_longest_cache_hit``, ``find_sliding_window_cache_hit``)
    take this view in place of the pool; it hands them the first group's
    block, and ``SingleTypeKVCacheManager.find_spec_cache_hit`` reads the
    other groups' blocks at the same positions.
    """

    def __init__(self, block_pool: BlockPool, group_ids: Sequence[int]) -> None:
        self.block_pool = block_pool
        self.group_ids = tuple(group_ids)
        self.null_block = block_pool.null_block

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_id: int = 0) -> KVCacheBlock | None:
        blocks = [self.block_pool.get_cached_block(block_hash, group_id) for group_id in self.group_ids]
        return None if None in blocks else blocks[0]


class SingleTypeKVCacheManager:
    """One KV-cache group's block tables, over the shared pool: full attention's rules.

    Owns ``req_to_blocks`` (request id -> the group's block table: logical
    block ``i`` lives in physical block ``req_to_blocks[id][i]``) and
    ``num_cached_block`` (request id -> how many of those blocks are already
    in the prefix cache). The ``BlockPool`` counts references; the
    ``KVCacheManager`` decides when each method runs.

    ``free_request_blocks`` is the part that gives a finished table back
    (chapter 06's ``free_request_blocks(pool, blocks)``); the subclass for
    sliding windows overrides the three rules listed in this module's
    docstring.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        *,
        free_request_blocks: Callable[[BlockPool, list[KVCacheBlock]], None],
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.free_request_blocks_fn = free_request_blocks
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    # -- the rules that differ by kind of layer -----------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        raise NotImplementedError

    def lookup(self, pool, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """``find_longest_cache_hit`` over ``pool``: a ``SpecGroupPoolView`` of several groups with this spec."""
        raise NotImplementedError

    def find_spec_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_num_blocks: int, managers: Sequence[SingleTypeKVCacheManager]
    ) -> list[list[KVCacheBlock]]:
        """One hit list per group of ``managers`` (this one first, all with this spec), from one lookup.

        A block position is a hit only when every group has that hash cached
        (``SpecGroupPoolView``); each group's list holds its own block there.
        """
        if len(managers) == 1:
            return [self.find_longest_cache_hit(block_hashes, max_num_blocks)]
        view = SpecGroupPoolView(self.block_pool, [manager.kv_cache_group_id for manager in managers])
        first = self.lookup(view, block_hashes, max_num_blocks)
        hits = [first]
        for manager in managers[1:]:
            group_id = manager.kv_cache_group_id
            hits.append(
                [
                    block if block is self.null_block else self.block_pool.get_cached_block(block_hashes[i], group_id)
                    for i, block in enumerate(first)
                ]
            )
        return hits

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of token ``num_computed_tokens``, whose blocks attention never reads again (0 here)."""
        return 0

    def cacheable_block_mask(self, start_block: int, end_block: int, boundaries: Sequence[int]) -> list[bool] | None:
        """Which of the full blocks ``start_block .. end_block - 1`` to cache (None: all of them)."""
        return None

    # -- allocation ---------------------------------------------------------------------
    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock], num_computed_tokens: int
    ) -> int:
        """Free blocks this group needs so that ``request_id`` has slots for ``num_tokens`` tokens.

        ``new_computed_blocks``: the hit blocks it is about to take (admission
        only); those with ``ref_cnt == 0`` sit in the free queue, so taking
        them uses up free blocks too. Positions before the window of token
        ``num_computed_tokens`` need no block (their entries are null).
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if not new_computed_blocks:  # a running request (no hit to take): just the blocks it lacks
            return max(0, num_required_blocks - num_req_blocks)
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        num_new_blocks = max(
            0, num_required_blocks - max(num_skipped_blocks, num_req_blocks + len(new_computed_blocks))
        )
        # Hit blocks before the window are not taken (the table gets null there).
        num_skipped_hit_blocks = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = sum(
            1
            for block in new_computed_blocks[num_skipped_hit_blocks:]
            if block.ref_cnt == 0 and block is not self.null_block
        )
        return num_new_blocks + num_evictable

    def add_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_computed_tokens: int
    ) -> None:
        """Admission with a hit: the hit's blocks become the start of the table (vLLM: ``add_local_computed_blocks``).

        Each block inside the window is touched (a reference taken, out of the
        free queue if it was free); positions before the window get the null
        block. They are cached already, so caching starts after them.
        """
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        kept = list(new_computed_blocks[num_skipped_blocks:])
        self.block_pool.touch(kept)
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, f"request {request_id!r} already holds blocks"
        req_blocks.extend([self.null_block] * num_skipped_blocks)
        req_blocks.extend(kept)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Pop blocks from the pool until the table has slots for ``num_tokens`` tokens; returns the new ones."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int, boundaries: Sequence[int] = ()) -> list[KVCacheBlock]:
        """Enter the blocks that are full after ``num_tokens`` tokens into the cache; returns those it cached.

        ``boundaries``: token positions a later request may resume from (the
        sliding-window group keeps the blocks under the window there).
        """
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_full_blocks <= num_cached_blocks:
            return []
        mask = self.cacheable_block_mask(num_cached_blocks, num_full_blocks, boundaries)
        cached = self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request.request_id],
            num_cached_blocks,
            num_full_blocks,
            self.kv_cache_group_id,
            mask,
        )
        self.num_cached_block[request.request_id] = num_full_blocks
        return cached

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks before the window of token ``num_computed_tokens``; null takes their place.

        Walks back from the last such block and stops at the first null (the
        ones before were given back earlier). The freed blocks keep their
        hashes: they stay cached for other requests until evicted.
        """
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped_tokens <= 0 or not blocks:
            return
        num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
        freed: list[KVCacheBlock] = []
        for i in range(num_skipped_blocks - 1, -1, -1):
            if blocks[i] is self.null_block:
                break
            freed.append(blocks[i])
            blocks[i] = self.null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def free(self, request_id: str) -> None:
        """Forget the request's table and give its blocks back, last block first (nulls are not blocks)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        num_nulls = 0
        while num_nulls < len(blocks) and blocks[num_nulls] is self.null_block:
            num_nulls += 1
        self.free_request_blocks_fn(self.block_pool, blocks[num_nulls:])


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: a hit is the longest cached prefix; nothing is given back before the request ends.

    ``find_longest_cache_hit`` is the chapter-05 part ``(block_pool,
    block_hashes, max_num_blocks) -> blocks`` (default: this module's
    ``find_longest_cache_hit``); the full-attention group is group 0, the
    one ``block_pool.get_cached_block(hash)`` looks up.
    """

    def __init__(
        self,
        kv_cache_spec: FullAttentionSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        *,
        free_request_blocks: Callable[[BlockPool, list[KVCacheBlock]], None],
        find_longest_cache_hit: Callable[[BlockPool, Sequence[BlockHash], int], list[KVCacheBlock]],
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, free_request_blocks=free_request_blocks)
        self.find_longest_cache_hit_fn = find_longest_cache_hit

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        return self.find_longest_cache_hit_fn(self.block_pool, block_hashes, max_num_blocks)

    def lookup(self, pool, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        return self.find_longest_cache_hit_fn(pool, block_hashes, max_num_blocks)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: a hit needs only the blocks under one window; blocks behind it go back early.

    Which full blocks it caches (``cacheable_block_mask``) follows vLLM
    0.33's ``prefix_cache_retention_interval`` (``retention_interval``). By
    default (0) only the ``num_contiguous_blocks`` blocks that end at a
    *boundary* a later request can resume from, namely the prompt's last full
    block before its last token (a resent prompt resumes there) and a
    shared-prefix junction the request's lookup found (where another request's
    prompt diverged): caching every block would keep blocks that no hit can
    use. So blocks filled while decoding are never cached: the next turn of a
    chat hits up to where the previous *prompt* ended. None caches every
    block; a positive N also the blocks before every N-th token.

    ``find_sliding_window_cache_hit`` is chapter 08b's part (default: this
    module's function of that name).
    """

    def __init__(
        self,
        kv_cache_spec: SlidingWindowSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        *,
        free_request_blocks: Callable[[BlockPool, list[KVCacheBlock]], None],
        find_sliding_window_cache_hit: Callable[..., list[KVCacheBlock]] = find_sliding_window_cache_hit,
        retention_interval: int | None = 0,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, free_request_blocks=free_request_blocks)
        self.retention_interval = retention_interval
        self.sliding_window = kv_cache_spec.sliding_window
        self.num_contiguous_blocks = sliding_window_contiguous_blocks(self.sliding_window, self.block_size)
        self.find_sliding_window_cache_hit_fn = find_sliding_window_cache_hit

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        return self.find_sliding_window_cache_hit_fn(
            self.block_pool, block_hashes, max_num_blocks, self.num_contiguous_blocks, self.kv_cache_group_id
        )

    def lookup(self, pool, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        return self.find_sliding_window_cache_hit_fn(
            pool, block_hashes, max_num_blocks, self.num_contiguous_blocks, self.kv_cache_group_id
        )

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """``num_computed_tokens - sliding_window + 1``: the tokens before the next token's window.

        With ``sliding_window=4`` and 7 tokens computed, the next token is
        token 7 and its window is tokens 4..7: tokens 0..3 are skipped.
        """
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def cacheable_block_mask(self, start_block: int, end_block: int, boundaries: Sequence[int]) -> list[bool] | None:
        """vLLM 0.33's ``SlidingWindowManager.reachable_block_mask`` (no EAGLE; hits on block boundaries).

        A hit at a boundary needs the ``num_contiguous_blocks`` blocks before
        it. ``retention_interval`` None: every boundary, so every block (None:
        no mask). A positive interval of N tokens: the blocks before every
        N-th token (all of them when a window needs as many). 0, and always
        besides: the blocks before each of ``boundaries``.
        """
        need = self.num_contiguous_blocks
        segment_tokens = self.block_size if self.retention_interval is None else self.retention_interval
        mask = [False] * (end_block - start_block)
        if segment_tokens:
            per_segment = segment_tokens // self.block_size
            if need >= per_segment:
                return None
            for i in range(start_block, end_block):
                if i % per_segment >= per_segment - need:
                    mask[i - start_block] = True
        for boundary in boundaries:
            end = boundary // self.block_size  # the blocks before the boundary's block
            for i in range(max(start_block, end - need), min(end_block, end)):
                mask[i - start_block] = True
        return mask
