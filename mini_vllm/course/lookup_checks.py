"""Checks for chapter 05: ``find_longest_cache_hit(block_pool, block_hashes, max_num_blocks)``.

The learner's function looks a request's block hashes up in a ``BlockPool``
and returns the cached blocks of the longest prefix, at most
``max_num_blocks`` of them. The check builds small pools by hand (which block
holds which hash, which blocks are in use), runs the learner's function and
the reference on them, and names the mistake when they disagree. It also
checks that the request's ``block_hashes`` list is left as it was, that each
call returns a new list (a mutable default returns the same one), that it
holds no None (a miss walked past, not stopped at), and that a
lookup in a pool of 20,000 blocks reads only the blocks it returns (O(hit
length), not O(pool size)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..block_pool import BlockPool, KVCacheBlock
from ..hashing import BlockHash, hash_request_tokens
from ..kv_cache_manager import KVCacheManager, longest_cache_hit
from ._harness import Checker, Mistake, first_mistake, guarded_check
from .fixtures import CountingBlock, cache_block, counting_pool, expect_hash_map_lookups, pool_state

BLOCK_SIZE = 4


def reference_find_longest_cache_hit(
    block_pool: BlockPool, block_hashes: Sequence[BlockHash], max_num_blocks: int
) -> list[KVCacheBlock]:
    """The reference with the exercise's signature: what ``KVCacheManager.find_longest_cache_hit`` does."""
    return longest_cache_hit(block_hashes[:max_num_blocks], block_pool.get_cached_block)


def _hashes(tokens: Sequence[int]) -> list[BlockHash]:
    return hash_request_tokens(list(tokens), BLOCK_SIZE)


def _make_manager(num_blocks: int, cached: Sequence[BlockHash], in_use: Sequence[int] = ()) -> KVCacheManager:
    """A manager whose pool's blocks 0, 1, ... hold ``cached[0]``, ``cached[1]``, ...

    Blocks listed in ``in_use`` get ref_cnt 1 (taken out of the free queue);
    the others are cached but free (ref_cnt 0), as after their request finished.
    The learner's function gets ``manager.block_pool``; the manager's own
    ``find_longest_cache_hit`` is the reference.
    """
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    pool = manager.block_pool
    for block_id, block_hash in enumerate(cached):
        cache_block(pool, pool.blocks[block_id], block_hash)
    pool.touch([pool.blocks[i] for i in in_use])
    return manager


def _make_pool(num_blocks: int, cached: Sequence[BlockHash], in_use: Sequence[int] = ()) -> BlockPool:
    """The pool of :func:`_make_manager` (for the fixed cases, whose answers are written out)."""
    return _make_manager(num_blocks, cached, in_use).block_pool


def _describe(result) -> str:
    """Block ids for a list of blocks; the raw value otherwise."""
    if isinstance(result, list) and all(isinstance(b, KVCacheBlock) for b in result):
        return f"blocks {[b.block_id for b in result]}"
    return repr(result)


def _run(
    check: Checker,
    fn: Callable,
    pool: BlockPool,
    hashes: list,
    max_num_blocks: int,
    case: str,
    random_case: bool = False,
):
    """Call the learner's function and check what any correct answer must satisfy."""
    before = pool_state(pool)
    given = list(hashes)
    reads_before = CountingBlock.reads
    result = check.call(
        fn,
        pool,
        given,
        max_num_blocks,
        what=f"{case}: find_longest_cache_hit(pool, {len(hashes)} hashes, {max_num_blocks})",
        expected="the list of cached blocks of the longest prefix",
    )
    check.reads_in_call = CountingBlock.reads - reads_before  # block attributes read (counting blocks only)
    result = check.expect_list(result, case, random_case=random_case)
    check.expect_unchanged(
        [h.hex()[:8] for h in hashes],
        [h.hex()[:8] if isinstance(h, bytes) else h for h in given],
        case,
        "block_hashes list",
        "block_hashes is the request's own list (request.block_hashes): loop over it or slice it, never pop "
        "from it, reverse it or cut it in place",
    )
    if any(item is None for item in result):
        _fail_on_a_kept_miss(check, pool, hashes, result, case, random_case)
    wrong = [item for item in result if not isinstance(item, KVCacheBlock)]
    check.expect(
        not wrong,
        f"{case}: returned {result!r}, which holds {type(wrong[0]).__name__ if wrong else ''} items",
        "return the KVCacheBlock objects themselves (block_pool.get_cached_block(block_hash)), "
        "not block ids or hashes: allocate_slots must touch them and put them in the block table",
        random_case=random_case,
    )
    check.expect(
        pool_state(pool) == before,
        f"{case}: the pool changed during the lookup (a ref_cnt, the free queue or the map)",
        "a lookup only looks: get_computed_blocks takes no references; allocate_slots touches the "
        "blocks later, once the scheduler has decided to admit the request",
        random_case=random_case,
    )
    return result


PREFIX_RULE = (
    "block i+1 can only be reused if block i is: its hash chains over block i's, and its K/V were computed "
    "attending to block i's tokens, so from the first missing block on the model computes every token anyway"
)


def _fail_on_a_kept_miss(
    check: Checker, pool: BlockPool, hashes: list, result: list, case: str, random_case: bool
) -> None:
    """The result holds None: get_cached_block's answer for a miss, kept instead of stopping there."""
    first = result.index(None)
    shown = [None if item is None else getattr(item, "block_id", item) for item in result]
    misses = [i for i, block_hash in enumerate(hashes) if pool.get_cached_block(block_hash) is None]
    first_miss = misses[0] if misses else first
    after = len(result) > first + 1
    check.expect(
        False,
        f"{case}: returned {shown} (block ids; None where get_cached_block found nothing): position {first} "
        f"holds None, so block {first_miss}'s hash is a miss (not cached)"
        + (f", and your list goes on past it ({len(result) - first - 1} more item(s))" if after else ""),
        "get_cached_block(block_hash) returns None for a hash that is not cached. A hit stops at the first "
        "miss: test `if block is None: break` before appending, and return only the blocks before it; " + PREFIX_RULE,
        random_case=random_case,
    )


# -- the fixed cases ------------------------------------------------------------------
PROMPT_HASHES = _hashes(list(range(100, 116)))  # 16 tokens = 4 blocks of 4
FULL_HASHES = _hashes(list(range(200, 212)))  # 12 tokens = 3 full blocks of 4


@dataclass
class _Looked:
    """What one call of the learner's lookup left: the blocks it returned, and the pool it was given."""

    result: list
    pool: BlockPool


class _RecordingPool(BlockPool):
    """A :class:`BlockPool` that records the ``kv_cache_group_id`` of every ``get_cached_block`` call."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.groups_asked: list[int] = []

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_id: int = 0) -> KVCacheBlock | None:
        self.groups_asked.append(kv_cache_group_id)
        return super().get_cached_block(block_hash, kv_cache_group_id)


def _all_cached() -> _RecordingPool:
    """Every hash of the prompt cached, in a pool that records the groups it is asked for."""
    pool = _RecordingPool(8)
    for block_id, block_hash in enumerate(PROMPT_HASHES):
        cache_block(pool, pool.blocks[block_id], block_hash)
    return pool


ALL_CACHED = "all four hashes are in the map: return their blocks, in order"
ALL_CACHED_HINTS = (  # 4 cached blocks, max_num_blocks=4: why the blocks returned are not all four
    Mistake(
        lambda seen: any(seen.pool.groups_asked),
        hint=lambda seen: (
            f"{ALL_CACHED}; you asked get_cached_block for KV-cache group "
            f"{next(group for group in seen.pool.groups_asked if group)}: a model with full attention only has "
            "group 0, the default: block_pool.get_cached_block(block_hash)"
        ),
    ),
    Mistake(
        lambda seen: len(seen.result) == 3,
        hint=f"{ALL_CACHED}; you stopped one block early: range(max_num_blocks - 1), or a cap of your own such as "
        "len(block_hashes) - 1? max_num_blocks IS the cap (the caller applied the last-token rule): stop "
        "after max_num_blocks blocks, no earlier",
    ),
    Mistake(
        lambda seen: not seen.result and len(seen.pool.groups_asked) < len(PROMPT_HASHES),
        hint=lambda seen: (
            f"{ALL_CACHED}; you looked up {len(seen.pool.groups_asked)} of the 4 hashes in this "
            "pool. Does your function remember answers from the earlier call (a dict of lookups kept between "
            "calls)? What is cached changes between calls: look every hash up in the pool you are given, every time"
        ),
    ),
)


def _cap_mistakes(cap: int) -> tuple[Mistake, ...]:
    """Four blocks cached, at most ``cap`` allowed: the hint for a hit of another length."""
    return (
        Mistake(
            lambda seen: len(seen.result) > cap,
            hint=lambda seen: (
                "return at most max_num_blocks blocks: the caller passes (num_tokens - 1) // "
                f"block_size so the last prompt token is always computed; you returned {len(seen.result)}"
                + (" (off by one: stop when len(hits) == max_num_blocks)" if len(seen.result) == cap + 1 else "")
            ),
        ),
        Mistake(
            lambda seen: len(seen.result) < cap,
            hint=lambda seen: f"off by one? {cap} blocks are allowed and cached, you returned {len(seen.result)}",
        ),
    )


def _cached_twice() -> BlockPool:
    """The same contents computed twice: blocks 0 and 5 hold block 0's hash (0 inserted first)."""
    pool = _make_pool(8, PROMPT_HASHES[:2])
    cache_block(pool, pool.blocks[5], PROMPT_HASHES[0])
    return pool


@dataclass(frozen=True)
class _Lookup:
    """Look ``hashes`` up in ``build()``'s pool, at most ``max_num_blocks``; ``case`` names the call.

    ``mistakes``: rows read from what the call left (:class:`_Looked`), each counted; then, when
    ``expected`` is set, the blocks returned must be it (the message names ``shown``, else ``case``):
    the first of ``hints`` that shows explains a difference, else ``hint``; then the rows of ``then``.
    """

    build: Callable[[], BlockPool]
    hashes: list[BlockHash]
    max_num_blocks: int
    case: str
    expected: str = ""
    hint: str = ""
    mistakes: tuple[Mistake, ...] = ()
    hints: tuple[Mistake, ...] = ()
    then: tuple[Mistake, ...] = ()
    shown: str = ""


LOOKUPS = (
    # 1. Nothing cached: no hit.
    _Lookup(
        lambda: _make_pool(8, []),
        PROMPT_HASHES,
        3,
        "an empty cache",
        "blocks []",
        "no block is cached, so the hit is empty",
    ),
    # 2. Everything cached, no cap: every block, the pool's own objects.
    _Lookup(
        _all_cached,
        PROMPT_HASHES,
        4,
        "4 cached blocks, max_num_blocks=4",
        "blocks [0, 1, 2, 3]",
        ALL_CACHED,
        hints=ALL_CACHED_HINTS,
        then=(
            Mistake(
                lambda seen: not all(got is seen.pool.blocks[i] for i, got in enumerate(seen.result)),
                "4 cached blocks: the returned blocks are not the pool's block objects",
                "return what block_pool.get_cached_block(hash) gives you, not a new KVCacheBlock",
            ),
        ),
    ),
    # 3. A miss in the middle: block 2 was evicted, block 3 is still cached.
    _Lookup(
        lambda: _make_pool(8, [PROMPT_HASHES[0], PROMPT_HASHES[1], _hashes([7] * 12)[2], PROMPT_HASHES[3]]),
        PROMPT_HASHES,
        4,
        "a miss at block 2",
        "blocks [0, 1]",
        "blocks 0 and 1 are cached and come before the miss",
        mistakes=(
            Mistake(
                lambda seen: len(seen.result) > 2,
                lambda seen: (
                    f"a miss at block 2: block 2 is not cached, but your function returned {_describe(seen.result)}"
                ),
                "stop at the first miss (break, not continue): a hit must be a prefix of the request. Block 3 is "
                "cached, but " + PREFIX_RULE,
            ),
        ),
    ),
    # 4. A miss at block 0: nothing after it counts, however much is cached.
    _Lookup(
        lambda: _make_pool(8, [_hashes([9] * 4)[0]] + PROMPT_HASHES[1:]),
        PROMPT_HASHES,
        4,
        "a miss at block 0",
        mistakes=(
            Mistake(
                lambda seen: seen.result != [],
                lambda seen: (
                    f"a miss at block 0: block 0 is not cached, but your function returned {_describe(seen.result)}"
                ),
                "stop at the first miss, even when it is the very first block",
            ),
        ),
    ),
    # 5. The cap: the last-block rule gives max_num_blocks < len(block_hashes).
    *(
        _Lookup(
            lambda: _make_pool(8, PROMPT_HASHES),
            PROMPT_HASHES,
            cap,
            f"4 cached blocks, max_num_blocks={cap}",
            f"blocks {list(range(cap))}",
            hints=_cap_mistakes(cap),
        )
        for cap in (0, 1, 2, 3)
    ),
    # 6. A 12-token prompt (3 full blocks of 4), fully cached: the rule (12 - 1) // 4 = 2.
    _Lookup(
        lambda: _make_pool(6, FULL_HASHES),
        FULL_HASHES,
        (12 - 1) // BLOCK_SIZE,
        "a fully cached 12-token prompt",
        "blocks [0, 1]",
        "block 2 is cached too, but the cap leaves it to be recomputed: the last token's logits are needed",
        shown="a fully cached 12-token prompt (max_num_blocks = (12 - 1) // 4 = 2)",
    ),
    # 7. Blocks in use (ref_cnt > 0) are hits too; the lookup takes no reference.
    _Lookup(
        lambda: _make_pool(8, PROMPT_HASHES, in_use=[0, 1]),
        PROMPT_HASHES,
        4,
        "blocks 0 and 1 in use by another request",
        "blocks [0, 1, 2, 3]",
        "a cached block is a hit whether another request holds it (ref_cnt > 0) or it sits in the free queue",
    ),
    # 8. The same contents computed twice: lookup returns the block inserted first.
    _Lookup(
        _cached_twice,
        PROMPT_HASHES,
        4,
        "two blocks hold block 0's contents",
        "blocks [0, 1]",
        "use block_pool.get_cached_block(hash): with duplicates it returns the first block inserted",
        shown="two blocks (0 and 5) hold block 0's contents",
    ),
)


@guarded_check(part="find_longest_cache_hit")
def check_find_longest_cache_hit(find_longest_cache_hit: Callable) -> None:
    """The learner's ``find_longest_cache_hit(block_pool, block_hashes, max_num_blocks)``."""
    check = Checker("find_longest_cache_hit")
    fn = find_longest_cache_hit
    hashes = PROMPT_HASHES

    def look_up(row: _Lookup) -> None:
        pool = row.build()
        seen = _Looked(_run(check, fn, pool, row.hashes, row.max_num_blocks, row.case), pool)
        check.expect_no_mistakes(row.mistakes, seen)
        if row.expected:
            explained = first_mistake(row.hints, seen)
            hint = explained.hint_for(seen) if explained else row.hint
            check.expect_equal(_describe(seen.result), row.expected, row.shown or row.case, hint)
        check.expect_no_mistakes(row.then, seen)

    for row in LOOKUPS:
        look_up(row)

    # 9. State kept between calls: the same lookup twice must give the same answer.
    pool = _make_pool(8, hashes[:2])
    first = _describe(_run(check, fn, pool, hashes, 4, "the same lookup, a first time"))
    second = _describe(_run(check, fn, pool, hashes, 4, "the same lookup, a second time"))
    check.expect(
        first == second == "blocks [0, 1]",
        f"the same lookup twice returned {first}, then {second}",
        "start from an empty list in every call (hits = [] inside the function): a mutable default argument "
        "(def find_longest_cache_hit(..., hits=[])) or a global list keeps the previous call's blocks",
    )

    # 10. O(hit length), not O(pool size): a pool of 20,000 blocks, 3 of them cached.
    pool = counting_pool(20_000)
    for block_id, block_hash in enumerate(hashes[:3]):
        cache_block(pool, pool.blocks[block_id], block_hash)
    result = _run(check, fn, pool, hashes, 4, "a pool of 20,000 blocks, the first 3 hashes cached")
    expect_hash_map_lookups(check, check.reads_in_call, len(hashes), "block_pool.get_cached_block(block_hash)")
    check.expect_equal(_describe(result), "blocks [0, 1, 2]", "a pool of 20,000 blocks, the first 3 hashes cached")

    # 11. Random pools: prompts sharing prefixes, some blocks evicted.
    for _ in range(120):
        rng = check.rng
        shared = [rng.randrange(50) for _ in range(rng.choice([0, 4, 8, 12]))]
        prompts = [shared + [rng.randrange(50) for _ in range(rng.randint(0, 12))] for _ in range(3)]
        cached = []
        for tokens in prompts[:2]:
            for block_hash in _hashes(tokens):
                if block_hash not in cached and rng.random() < 0.85:
                    cached.append(block_hash)
        manager = _make_manager(len(cached) + 2, cached)
        query = _hashes(prompts[2])
        max_blocks = rng.randint(0, len(query))
        case = f"random pool ({len(cached)} cached blocks), {len(query)} hashes, max_num_blocks={max_blocks}"
        result = _run(check, fn, manager.block_pool, query, max_blocks, case, random_case=True)
        expected = manager.find_longest_cache_hit(query, max_blocks)
        check.expect_equal(_describe(result), _describe(expected), case, random_case=True)
    check.passed()
