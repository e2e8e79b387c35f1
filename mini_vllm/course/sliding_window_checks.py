"""Checks for chapter 08b: ``find_sliding_window_cache_hit(block_pool, block_hashes, max_num_blocks,
num_contiguous_blocks, kv_cache_group_id)``.

The learner's function is a sliding-window group's prefix lookup in a hybrid
model: among the first ``max_num_blocks`` block hashes, searching right to
left, the first run of ``num_contiguous_blocks`` blocks cached *for group
``kv_cache_group_id``*, returned as the hit's block table: the pool's null
block at every position before the run (or, with no such run, a shorter run
that starts at block 0; or nothing).

The check builds small pools by hand in which the full-attention group
(group 0) caches every block of a prompt and the sliding-window group
(group 1) only some: prompt block ``i`` is pool block ``i`` in group 0 and
pool block ``10 + i`` in group 1, so a returned id says which group it came
from. Each fixed case is built to catch one mistake; when the learner's
answer is what a known mistake gives (one that agreed with the reference on
every earlier case), the message names that mistake. Then random pools, and
a real hybrid ``KVCacheManager`` (two groups, one pool) running requests with
shared prefixes, decodes, frees and evictions, with the learner's function
called where the engine calls it and compared there with the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock
from ..hashing import BlockHash, hash_request_tokens
from ..kv_cache_interface import make_kv_cache_config
from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ..single_type_kv_cache_manager import (
    find_sliding_window_cache_hit as reference_find_sliding_window_cache_hit,
)
from ..single_type_kv_cache_manager import max_cache_hit_blocks
from ._harness import Checker, guarded_check
from .fixtures import CountingBlock, cache_block, counting_pool, expect_hash_map_lookups, pool_state

BLOCK_SIZE = 4
SLIDING = 1  # the sliding-window group's id in the fixed cases (group 0: full attention)
OFFSET = 10  # group 1 caches prompt block i in pool block OFFSET + i

NAME = "find_sliding_window_cache_hit"
_NEVER_CACHED = b"\0" * 32  # a block hash no pool holds (a real one is a SHA-256 of a pickle)


# -- what known mistakes return (the check names the mistake when the learner's answer is one of these) --------
def _get(pool: BlockPool, hashes: Sequence[BlockHash], i: int, group: int) -> KVCacheBlock | None:
    return pool.get_cached_block(hashes[i], group)


def _left_to_right(pool, hashes, max_num_blocks, n, group):
    found = []
    for i in range(max_num_blocks):
        block = _get(pool, hashes, i, group)
        if block is None:
            break
        found.append(block)
    return found


def _leftmost_run(pool, hashes, max_num_blocks, n, group):
    run = 0
    for i in range(max_num_blocks):
        block = _get(pool, hashes, i, group)
        run = run + 1 if block is not None else 0
        if block is not None and run >= n:
            start = i + 1 - n
            return [pool.null_block] * start + [_get(pool, hashes, j, group) for j in range(start, i + 1)]
    return _left_to_right(pool, hashes, max_num_blocks, n, group)[: n - 1]


def _without_nulls(pool, hashes, max_num_blocks, n, group):
    hit = reference_find_sliding_window_cache_hit(pool, hashes, max_num_blocks, n, group)
    return [block for block in hit if block is not pool.null_block]


def _one_block_more(pool, hashes, max_num_blocks, n, group):
    return reference_find_sliding_window_cache_hit(pool, hashes, max_num_blocks, n + 1, group)


def _one_block_fewer(pool, hashes, max_num_blocks, n, group):
    if n <= 1:
        return None  # no such mistake: a run of 0 blocks is what the reference never asks for
    return reference_find_sliding_window_cache_hit(pool, hashes, max_num_blocks, n - 1, group)


def _whole_run(pool, hashes, max_num_blocks, n, group):
    hit = reference_find_sliding_window_cache_hit(pool, hashes, max_num_blocks, n, group)
    hit = list(hit)
    i = len(hit) - n - 1
    while len(hit) >= n and i >= 0 and hit[i] is pool.null_block and _get(pool, hashes, i, group) is not None:
        hit[i] = _get(pool, hashes, i, group)
        i -= 1
    return hit


def _skips_block_0(pool, hashes, max_num_blocks, n, group):
    """range(max_num_blocks - 1, 0, -1): block 0 is never looked at (as if it were not cached)."""
    if not hashes:
        return None
    return reference_find_sliding_window_cache_hit(pool, [_NEVER_CACHED, *hashes[1:]], max_num_blocks, n, group)


def _one_position_fewer(pool, hashes, max_num_blocks, n, group):
    """min(max_num_blocks - 1, len(block_hashes)): the last position that may hit is never looked at."""
    if max_num_blocks < 1:
        return None
    return reference_find_sliding_window_cache_hit(pool, hashes, max_num_blocks - 1, n, group)


def _no_reset(pool, hashes, max_num_blocks, n, group):
    computed = [pool.null_block] * max_num_blocks
    num_found = 0
    for i in range(max_num_blocks - 1, -1, -1):
        block = _get(pool, hashes, i, group)
        if block is None:
            continue
        computed[i] = block
        num_found += 1
        if num_found >= n:
            return computed[: i + num_found]
    return computed[:num_found]


def _group_zero(pool, hashes, max_num_blocks, n, group):
    return reference_find_sliding_window_cache_hit(pool, hashes, max_num_blocks, n, 0)


def _no_partial_run(pool, hashes, max_num_blocks, n, group):
    hit = reference_find_sliding_window_cache_hit(pool, hashes, max_num_blocks, n, group)
    return hit if len(hit) >= n else []


def _partial_run_anywhere(pool, hashes, max_num_blocks, n, group):
    hit = reference_find_sliding_window_cache_hit(pool, hashes, max_num_blocks, n, group)
    if len(hit) >= n:
        return hit
    for end in range(max_num_blocks - 1, -1, -1):  # the rightmost run, however short
        if _get(pool, hashes, end, group) is not None:
            start = end
            while start > 0 and _get(pool, hashes, start - 1, group) is not None:
                start -= 1
            return [pool.null_block] * start + [_get(pool, hashes, j, group) for j in range(start, end + 1)]
    return []


def _ignores_max(pool, hashes, max_num_blocks, n, group):
    return reference_find_sliding_window_cache_hit(pool, hashes, len(hashes), n, group)


def _block_0_as_missing(pool, hashes, max_num_blocks, n, group):
    """``if not block_id``: pool block 0 taken for "not cached" (None where no hash maps to block 0)."""
    found = [_get(pool, hashes, i, group) for i in range(min(max_num_blocks, len(hashes)))]
    if not any(block is not None and block.block_id == 0 for block in found):
        return None
    hashes = [_NEVER_CACHED if block is not None and block.block_id == 0 else h for h, block in zip(hashes, found)]
    return reference_find_sliding_window_cache_hit(pool, hashes, max_num_blocks, n, group)


def _nothing_below_a_window(pool, hashes, max_num_blocks, n, group):
    """``if max_num_blocks < num_contiguous_blocks: return []`` (None where the cap leaves room for a window)."""
    return [] if max_num_blocks < n else None


MISTAKES: list[tuple[str, Callable, str]] = [
    (
        "left to right",
        _left_to_right,
        "you walked from block 0 and stopped at the first miss: that is full attention's rule (chapter 05). "
        "A sliding-window layer needs only the blocks under one window, so block 0 may be missing: search from "
        "the right end (i = max_num_blocks - 1 down to 0) for num_contiguous_blocks cached blocks in a row",
    ),
    (
        "leftmost run",
        _leftmost_run,
        "you returned the leftmost run of cached blocks; the longest hit ends at the rightmost run. Search right "
        "to left and stop at the first run of num_contiguous_blocks you find",
    ),
    (
        "without nulls",
        _without_nulls,
        "you returned the run without the positions before it. The list is the hit's block table: entry i is "
        "prompt block i, and len(result) * block_size is the hit's length. Put block_pool.null_block at every "
        "position before the run",
    ),
    (
        "one block more",
        _one_block_more,
        "off by one: you needed num_contiguous_blocks + 1 cached blocks in a row; num_contiguous_blocks are "
        "enough (stop when the count reaches it: >=, not >)",
    ),
    (
        "one block fewer",
        _one_block_fewer,
        "off by one: you accepted num_contiguous_blocks - 1 cached blocks in a row; the window of the first "
        "token computed needs num_contiguous_blocks of them",
    ),
    (
        "whole run",
        _whole_run,
        "you kept every cached block of the run; only its last num_contiguous_blocks are under the window. Stop "
        "as soon as the run is num_contiguous_blocks long: every position before them holds block_pool.null_block",
    ),
    (
        "no reset",
        _no_reset,
        "the blocks of a run must be contiguous: set the run's count back to 0 at every miss (a block that is "
        "not cached breaks the run)",
    ),
    (
        "group 0",
        _group_zero,
        "you looked up group 0's blocks (the full-attention group's): pass the group, "
        "block_pool.get_cached_block(block_hash, kv_cache_group_id)",
    ),
    (
        "no partial run",
        _no_partial_run,
        "with no run of num_contiguous_blocks, a shorter run that starts at block 0 is still a hit (the window "
        "of its next token reaches back to the start of the prompt, and all of that is cached): return those "
        "blocks instead of []",
    ),
    (
        "skips block 0",
        _skips_block_0,
        "your search never looks at block 0: walk i from max_num_blocks - 1 down to 0, block 0 included "
        "(range(max_num_blocks - 1, -1, -1); the stop of a range is excluded)",
    ),
    (
        "one position fewer",
        _one_position_fewer,
        "you searched the first max_num_blocks - 1 positions only: every position below max_num_blocks may "
        "hit, the last one included",
    ),
    (
        "partial run anywhere",
        _partial_run_anywhere,
        "a run shorter than num_contiguous_blocks is a hit only when it starts at block 0; anywhere else part of "
        "the window before it is not cached, so there is no hit there (return [] when no run starts at block 0)",
    ),
    (
        "block 0 as missing",
        _block_0_as_missing,
        "pool block 0 is a block like any other, and it holds a cached block of this group here: your answer "
        "treats it as not cached. Test for a miss with `block is None`, not with truthiness (`if not block_id` "
        "is true for block 0)",
    ),
    (
        "nothing below a window",
        _nothing_below_a_window,
        "max_num_blocks is below num_contiguous_blocks, so no whole window fits under the cap, but a prefix "
        "shorter than a window is still a hit when all of it, from block 0 on, is cached (the window of its "
        "next token reaches back to the prompt's start): do not return [] early, return the run that starts at "
        "block 0",
    ),
    (
        "ignores max_num_blocks",
        _ignores_max,
        "look at positions 0 .. max_num_blocks - 1 only (start the search at max_num_blocks - 1, not at "
        "len(block_hashes) - 1): the caller caps the hit (the last-block rule, and the full-attention group's hit)",
    ),
]
HINTS = {label: hint for label, _, hint in MISTAKES}


# -- pools --------------------------------------------------------------------------------------------------
def _hashes(tokens: Sequence[int]) -> list[BlockHash]:
    return hash_request_tokens(list(tokens), BLOCK_SIZE)


PROMPT_HASHES = _hashes(list(range(300, 335)))  # 35 tokens: 8 full blocks


def _cache(pool: BlockPool, block_id: int, block_hash: BlockHash, group: int) -> None:
    cache_block(pool, pool.blocks[block_id], block_hash, kv_cache_group_id=group)


def _make_pool(
    sliding: Sequence[int],
    full: Sequence[int] | None = None,
    num_blocks: int = 24,
    hashes: Sequence[BlockHash] = PROMPT_HASHES,
    group: int = SLIDING,
    in_use: Sequence[int] = (),
) -> BlockPool:
    """Group 0 caches prompt blocks ``full`` (default: all) in pool blocks i; ``group`` caches ``sliding`` in 10 + i."""
    pool = BlockPool(num_blocks)
    for i in range(len(hashes)) if full is None else full:
        _cache(pool, i, hashes[i], 0)
    for i in sliding:
        _cache(pool, OFFSET + i, hashes[i], group)
    pool.touch([pool.blocks[i] for i in in_use])
    return pool


def _null_state(pool: BlockPool) -> tuple:
    null = pool.null_block
    return (null.block_id, null.ref_cnt, null.block_hash, null.prev_free_block, null.next_free_block)


def _state(pool: BlockPool) -> dict:
    state = pool_state(pool)
    state["null block"] = _null_state(pool)
    return state


def _changes(before: dict, after: dict) -> str:
    """What differs between two ``_state`` s, in words: ``ref_cnt of block 15: 0 -> 1; the free queue``."""
    said = []
    for key in before:
        if before[key] == after[key]:
            continue
        if key == "ref_cnt":
            changed = [(i, a, b) for i, (a, b) in enumerate(zip(before[key], after[key])) if a != b]
            said += [f"ref_cnt of block {i}: {a} -> {b}" for i, a, b in changed[:3]]
        elif key != "num_free_blocks":
            said.append(f"the {key}" if key != "null block" else "block_pool.null_block (its ref_cnt, hash or links)")
    return "; ".join(said) or "its state"


def _describe(result, pool: BlockPool) -> str:
    """``[null × 5, 15, 16]``: block ids, the pool's null block as null."""
    if not isinstance(result, list):
        return repr(result)
    items = []
    for item in result:
        if item is pool.null_block:
            items.append("null")
        elif isinstance(item, KVCacheBlock):
            items.append(str(item.block_id))
        elif item is None:
            items.append("None")
        elif isinstance(item, bytes):
            items.append(item.hex()[:8] + "…")
        else:
            items.append(repr(item)[:40])
    leading = 0
    while leading < len(items) and items[leading] == "null":
        leading += 1
    if leading >= 2:
        items = [f"null × {leading}"] + items[leading:]
    return "[" + ", ".join(items) + "]"


def _runs(ids: Sequence[int]) -> str:
    """``[3, 4, 5, 7]`` -> ``3-5, 7``."""
    if not ids:
        return "none"
    parts, start = [], ids[0]
    for previous, current in zip(ids, list(ids[1:]) + [None]):
        if current != previous + 1 if current is not None else True:
            parts.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ", ".join(parts)


_NOTHING = object()


def _in_pool(pool: BlockPool, block: KVCacheBlock) -> bool:
    return (
        isinstance(block.block_id, int)
        and 0 <= block.block_id < pool.num_blocks
        and pool.blocks[block.block_id] is block
    )


class _SlidingWindowCheck:
    """Runs the learner's function on one pool, checks everything a right answer satisfies, names the mistake."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.check = Checker(NAME)
        self.alive = {label for label, _, _ in MISTAKES}  # mistakes that agreed with the reference so far

    def run(
        self,
        pool: BlockPool,
        hashes: list[BlockHash],
        max_num_blocks: int,
        num_contiguous_blocks: int,
        group: int,
        case: str,
        random_case: bool = False,
        given: list[BlockHash] | None = None,
    ) -> list:
        check = self.check
        before = _state(pool)
        before_hashes = [h.hex()[:8] for h in hashes]
        given = list(hashes) if given is None else given
        call = (
            f"{case}: {NAME}(pool, {len(hashes)} hashes, max_num_blocks={max_num_blocks}, "
            f"num_contiguous_blocks={num_contiguous_blocks}, kv_cache_group_id={group})"
        )
        reads_before = CountingBlock.reads
        result = check.call(
            self.fn,
            pool,
            given,
            max_num_blocks,
            num_contiguous_blocks,
            group,
            what=call,
            expected="the hit's blocks: block_pool.null_block before a run of cached blocks",
        )
        self.reads_in_call = CountingBlock.reads - reads_before  # block attributes read (counting blocks only)
        result = check.expect_list(result, call, random_case=random_case)
        check.expect_unchanged(
            before_hashes,
            [h.hex()[:8] if isinstance(h, bytes) else h for h in given],
            call,
            "block_hashes list",
            "block_hashes is the request's own list (request.block_hashes): index it (block_hashes[i]) or loop "
            "over range(max_num_blocks - 1, -1, -1); never reverse it, pop from it or cut it in place",
        )
        after = _state(pool)
        check.expect(
            after == before,
            f"{call}: the pool changed during the lookup: {_changes(before, after)}",
            "a lookup only looks: get_computed_blocks takes no references (no touch, no ref_cnt += 1); "
            "allocate_slots touches the blocks later, once the scheduler admits the request",
            random_case=random_case,
        )
        self._check_items(result, pool, call, random_case, group)
        expected = reference_find_sliding_window_cache_hit(
            pool, list(hashes), max_num_blocks, num_contiguous_blocks, group
        )
        one_null_too_many = (
            len(result) == len(expected) + 1 > 1
            and result[0] is pool.null_block
            and all(a is b for a, b in zip(result[1:], expected))
        )
        check.expect(
            len(result) <= max_num_blocks,
            f"{call}: returned {len(result)} entries, {_describe(result, pool)}: more than max_num_blocks",
            "one null too many: a run that starts at position i has i positions before it, so "
            "[block_pool.null_block] * i, not * (i + 1)"
            if one_null_too_many
            else HINTS["ignores max_num_blocks"],
            random_case=random_case,
        )
        stray = next((b for b in result if b is not pool.null_block and b.kv_cache_group_id != group), None)
        stray = stray or next((b for b in result if b is not pool.null_block and b.block_hash is None), None)
        if stray is not None:
            where = (
                "is not cached at all"
                if stray.block_hash is None
                else f"is cached for group {stray.kv_cache_group_id}, not for group {group}"
            )
            check.fail(
                f"{call}: returned {_describe(result, pool)}; block {stray.block_id} {where}",
                HINTS["group 0"]
                if stray.block_hash is not None and stray.kv_cache_group_id == 0
                else "return only what block_pool.get_cached_block(block_hash, kv_cache_group_id) gives you, with "
                "the kv_cache_group_id you are given",
            )
        got_text, expected_text = _describe(result, pool), _describe(expected, pool)
        same = len(result) == len(expected) and all(a is b for a, b in zip(result, expected))
        if not same:
            hint = None
            if self._ignores_the_pool_it_is_given(hashes, max_num_blocks, num_contiguous_blocks, group):
                hint = (
                    "it keeps state between calls (a cache keyed by the hashes?): given a fresh pool, your function "
                    "returned blocks of an earlier call's pool, or nothing where every hash is cached. What is "
                    "cached changes between calls: look every hash up in the pool you are given, every time"
                )
            hint = hint or self._diagnose(result, pool, hashes, max_num_blocks, num_contiguous_blocks, group)
            check.expect_equal(
                got_text,
                expected_text,
                call,
                hint or self._what_is_wrong(result, pool, hashes, num_contiguous_blocks, group),
                random_case=random_case,
            )
        self._forget_mistakes(pool, hashes, max_num_blocks, num_contiguous_blocks, group, expected)
        return result

    def _ignores_the_pool_it_is_given(self, hashes: list, max_num_blocks: int, n: int, group: int) -> bool:
        """On fresh pools (nothing cached; every hash cached) the learner's function returns a block of
        another pool, or nothing where every hash is cached: it answers from what earlier calls saw."""
        for cache_every_hash in (False, True):
            pool = BlockPool(len(hashes) + 2)
            if cache_every_hash:
                for i, block_hash in enumerate(hashes):
                    cache_block(pool, pool.blocks[i], block_hash, kv_cache_group_id=group)
            own = {id(block) for block in pool.blocks} | {id(pool.null_block)}
            try:
                found = self.fn(pool, list(hashes), max_num_blocks, n, group)
            except Exception:  # noqa: BLE001 - a probe: the calls the check reports are the others
                continue
            if not isinstance(found, (list, tuple)):
                continue
            if any(isinstance(block, KVCacheBlock) and id(block) not in own for block in found):
                return True
            if cache_every_hash and not found and 1 <= n <= max_num_blocks <= len(hashes):
                return True
        return False

    def _check_items(self, result: list, pool: BlockPool, call: str, random_case: bool, group: int) -> None:
        check = self.check
        wrong = next((item for item in result if isinstance(item, (int, bytes))), None)
        if wrong is not None:
            check.fail(
                f"{call}: returned {_describe(result, pool)}, which holds {type(wrong).__name__} items",
                "return the KVCacheBlock objects themselves (block_pool.get_cached_block(...) and "
                "block_pool.null_block), not block ids or hashes: allocate_slots touches them and puts them in the "
                "block table",
            )
        first_real = next((i for i, item in enumerate(result) if isinstance(item, KVCacheBlock)), len(result))
        stray_none = next((i for i in range(first_real, len(result)) if result[i] is None), None)
        if stray_none is not None:
            check.fail(
                f"{call}: returned {_describe(result, pool)}: entry {stray_none} is None, after a block",
                f"get_cached_block found nothing for block_hashes[{stray_none}] in group {group}, yet your answer "
                "puts it in the run. Either the run's count was not set back to 0 at that miss (a block that is not "
                "cached breaks the run: it must start again after it), or the positions you return are not the "
                "ones you checked (an index off by one when you walk from the right, e.g. max_num_blocks - j "
                "instead of max_num_blocks - 1 - j?)",
            )
        if any(item is None for item in result):
            check.fail(
                f"{call}: returned {_describe(result, pool)}, with None where no block is needed",
                "put block_pool.null_block there, not None: the engine's block tables hold a block at every "
                "position (the null block is the placeholder the model runner skips)",
            )
        wrong = next((item for item in result if not isinstance(item, KVCacheBlock)), _NOTHING)
        if wrong is not _NOTHING:
            check.fail(
                f"{call}: returned a list holding {type(wrong).__name__} items ({repr(wrong)[:60]})",
                "return a list of KVCacheBlock objects: block_pool.null_block, then the cached blocks",
            )
        fake_null = next((b for b in result if b.block_id == NULL_BLOCK_ID and b is not pool.null_block), None)
        check.expect(
            fake_null is None,
            f"{call}: returned a block with id {NULL_BLOCK_ID} that is not block_pool.null_block",
            "use the pool's own null block, block_pool.null_block, not a new KVCacheBlock(-1): the engine "
            "recognises it by identity (block is block_pool.null_block) and never frees or touches it",
            random_case=random_case,
        )
        foreign_at = next((i for i, b in enumerate(result) if b is not pool.null_block and not _in_pool(pool, b)), None)
        # A placeholder before the run (the same object at every position up to it) stands in for the null block.
        placeholder = foreign_at is not None and all(b is result[foreign_at] for b in result[: foreign_at + 1])
        check.expect(
            foreign_at is None,
            f"{call}: returned block {result[foreign_at].block_id if foreign_at is not None else ''} at position "
            f"{foreign_at}, which is not one of the pool's blocks",
            "the positions before the run hold the pool's own null block, block_pool.null_block, not a new "
            "KVCacheBlock: the engine recognises it by identity and never frees or touches it"
            if placeholder
            else "return what block_pool.get_cached_block(block_hash, kv_cache_group_id) gives you in this call: "
            "not a new KVCacheBlock, and not one remembered from an earlier call (another pool's block)",
            random_case=random_case,
        )

    def _diagnose(self, result, pool, hashes, max_num_blocks, n, group) -> str | None:
        """The hint of the known mistake (one that agreed with the reference so far) whose answer this is;
        when several give this very answer, each of them."""
        hints = []
        for label, mistake, hint in MISTAKES:
            if label not in self.alive:
                continue
            theirs = mistake(pool, list(hashes), max_num_blocks, n, group)
            if theirs is not None and len(theirs) == len(result) and all(a is b for a, b in zip(theirs, result)):
                hints.append(hint)
        if len(hints) > 1:
            return "one of these mistakes gives exactly your answer here: " + " | OR | ".join(hints)
        return hints[0] if hints else None

    def _what_is_wrong(self, result, pool, hashes, n, group) -> str:
        """What is wrong in an answer no known mistake explains, from its shape."""
        null = pool.null_block
        real = [i for i, block in enumerate(result) if block is not null]
        if result and not real:
            return (
                f"your answer is {len(result)} null blocks and no cached one: it claims a hit of "
                f"{len(result)} blocks with nothing cached. With no run found (and block 0 not cached) the hit is [] "
                "(the list's length is the hit's length: return only up to the run's last block)"
            )
        if real and any(result[i] is null for i in range(real[0], len(result))):
            return (
                "a null block after a cached one: the list must end with the run's last block (trim what comes "
                "after it), and the run must be contiguous (count from 0 again at every miss)"
            )
        # Where each returned block really is in the prompt: a gap between them is a run that was not reset.
        where = {id(_get(pool, hashes, j, group)): j for j in range(len(hashes)) if _get(pool, hashes, j, group)}
        positions = [where.get(id(result[i])) for i in real]
        if len(positions) > 1 and None not in positions and positions == sorted(positions):
            if positions != list(range(positions[0], positions[0] + len(positions))):
                return HINTS["no reset"]
        if len(positions) > 1 and positions == list(range(positions[0], positions[0] - len(positions), -1)):
            return (
                "the run's blocks are in reverse order: you collected them right to left, but the hit is a block "
                "table in prompt order (entry i is prompt block i): reverse the run, or fill the entries by index"
            )
        misplaced = next((i for i in real if result[i] is not _get(pool, hashes, i, group)), None)
        if misplaced is not None:
            there = _get(pool, hashes, misplaced, group)
            return (
                f"entry {misplaced} is block {result[misplaced].block_id}, but prompt block {misplaced}'s hash is "
                + (f"cached for group {group} in block {there.block_id}" if there else f"not cached for group {group}")
                + ": entry i of the hit must be the block cached for block_hashes[i] (null before the run)"
            )
        if real and real[0] > 0 and len(real) < n:
            return HINTS["partial run anywhere"]
        return (
            "search right to left for the first run of num_contiguous_blocks blocks cached for this group; return "
            "null at every position before it and end the list with the run (no run: the run that starts at block 0)"
        )

    def _forget_mistakes(self, pool, hashes, max_num_blocks, n, group, expected) -> None:
        """Mistakes whose answer differs from the reference's here would have failed already: not a diagnosis later."""
        for label, mistake, _ in MISTAKES:
            if label in self.alive:
                theirs = mistake(pool, list(hashes), max_num_blocks, n, group)
                if theirs is not None and not (
                    len(theirs) == len(expected) and all(a is b for a, b in zip(theirs, expected))
                ):
                    self.alive.discard(label)


def _case(sliding: Sequence[int], max_num_blocks: int, n: int, what: str, full: str = "all 8") -> str:
    blocks = _runs(sorted(sliding))
    pool_blocks = _runs(sorted(OFFSET + i for i in sliding))
    return (
        f"{what} (group 1 caches "
        + (f"prompt blocks {blocks}, in pool blocks {pool_blocks}" if sliding else "no block")
        + f"; group 0 caches {full})"
    )


@guarded_check(part="find_sliding_window_cache_hit")
def check_find_sliding_window_cache_hit(find_sliding_window_cache_hit: Callable) -> None:
    """The learner's ``find_sliding_window_cache_hit(block_pool, block_hashes, max_num_blocks,
    num_contiguous_blocks, kv_cache_group_id)``."""
    runner = _SlidingWindowCheck(find_sliding_window_cache_hit)
    check = runner.check
    hashes = PROMPT_HASHES

    def fixed(sliding, max_num_blocks, n, what, **pool_kwargs):
        pool = _make_pool(sliding, **pool_kwargs)
        full = pool_kwargs.get("full")
        described = _case(sliding, max_num_blocks, n, what, "all 8" if full is None else f"prompt blocks {_runs(full)}")
        return runner.run(pool, hashes, max_num_blocks, n, pool_kwargs.get("group", SLIDING), described)

    # 1. Group 1 caches nothing, group 0 everything: no hit for group 1.
    fixed([], 8, 2, "nothing cached for the sliding window")
    # 2. One run at the right end (longer than needed): its last 2 blocks, null before them.
    fixed([3, 4, 5, 6], 7, 2, "a run of 4 cached blocks, 2 needed")
    # 3. Two runs: the rightmost one is the longest hit.
    fixed([1, 2, 5, 6], 8, 2, "two runs of 2 cached blocks")
    # 4. A miss breaks a run: blocks 2 and 4 are not contiguous.
    fixed([2, 4], 6, 2, "cached blocks 2 and 4 with block 3 missing")
    # 5. No run of 3, but blocks 0 and 1 are cached: a hit that starts at block 0.
    fixed([0, 1, 4], 6, 3, "no run of 3, blocks 0-1 cached")
    # 6. Only block 0 cached.
    fixed([0], 4, 2, "only block 0 cached")
    # 7. A short run that does not start at block 0 is no hit.
    fixed([3, 4], 6, 3, "a run of 2 where 3 are needed, not at block 0")
    # 8. The cap: runs beyond max_num_blocks do not count.
    fixed([2, 3, 6, 7], 6, 2, "runs at blocks 2-3 and 6-7, max_num_blocks=6")
    fixed([5, 6, 7], 7, 3, "a run of 3 at blocks 5-7, max_num_blocks=7")
    fixed([0, 1, 2, 3], 0, 2, "max_num_blocks=0")
    fixed([0, 1, 2, 3, 4, 5], 2, 3, "blocks 0-5 cached, max_num_blocks=2 below num_contiguous_blocks=3")
    fixed([0, 1, 2, 3, 4, 5, 6, 7], 8, 2, "everything cached, max_num_blocks = len(block_hashes)")
    # 9. One block is a whole window (num_contiguous_blocks=1).
    fixed([2, 5], 7, 1, "num_contiguous_blocks=1")
    # 10. Blocks in use by another request are hits too; group 0 missing blocks changes nothing for group 1.
    fixed([4, 5], 7, 2, "blocks 14 and 15 in use by another request", in_use=[14, 15, 0], full=[0, 1])
    # 10b. Pool block 0 may be a hit too (a block id is no truth value).
    pool = _make_pool([], full=[])
    for block_id, i in ((0, 3), (1, 4)):
        _cache(pool, block_id, hashes[i], SLIDING)
    runner.run(pool, hashes, 6, 2, SLIDING, "group 1 caches prompt blocks 3-4 in pool blocks 0-1; group 0 caches none")
    # 11. Another group id: the function must use the one it is given.
    pool = _make_pool([3, 4], group=2)
    for i in (5, 6):
        _cache(pool, OFFSET + i, hashes[i], SLIDING)  # group 1 caches other blocks
    runner.run(
        pool,
        hashes,
        8,
        2,
        2,
        "kv_cache_group_id=2, a second sliding-window group (group 2 caches prompt blocks 3-4 in pool blocks "
        "13-14; group 1 caches 5-6 in 15-16; group 0 all 8)",
    )
    # 12. The same lookup twice: a new list each time, the same answer (no state kept between calls).
    fixed([4, 5], 7, 2, "the same lookup, a first time")
    fixed([4, 5], 7, 2, "the same lookup, a second time")

    # 13. O(max_num_blocks) dict lookups, not a scan of the pool.
    pool = counting_pool(20_000)
    for i in range(8):
        _cache(pool, i, hashes[i], 0)
    for i in (5, 6):
        _cache(pool, OFFSET + i, hashes[i], SLIDING)
    runner.run(pool, hashes, 8, 2, SLIDING, "a pool of 20,000 blocks (group 1 caches prompt blocks 5-6)")
    lookup = "block_pool.get_cached_block(block_hash, kv_cache_group_id)"
    expect_hash_map_lookups(check, runner.reads_in_call, len(hashes), lookup)

    # 14. Random pools.
    rng = check.rng
    for _ in range(150):
        num_hashes = rng.randint(0, 8)
        sliding = [i for i in range(num_hashes) if rng.random() < 0.5]
        full = list(range(rng.randint(0, num_hashes)))
        n = rng.randint(1, 4)
        max_num_blocks = rng.randint(0, num_hashes)
        pool = _make_pool(sliding, full=full, hashes=hashes[:num_hashes])
        case = (
            f"random pool: group 1 caches prompt blocks {_runs(sliding)} (pool blocks 10 + i), group 0 "
            f"{_runs(full)}; {num_hashes} hashes"
        )
        runner.run(pool, hashes[:num_hashes], max_num_blocks, n, SLIDING, case, random_case=True)

    # 15. A real hybrid KVCacheManager: the learner's function is the sliding-window group's lookup.
    for scenario in range(12):
        _engine_scenario(runner, scenario)
    check.passed()


def _engine_scenario(runner: _SlidingWindowCheck, seed: int) -> None:
    """Requests sharing prefixes through a hybrid manager whose sliding-window lookup is the learner's."""
    import random

    rng = random.Random(1000 + seed)
    window = rng.choice([5, 9, 13])  # cdiv(window - 1, 4): 1, 2 or 3 blocks
    num_blocks = rng.choice([24, 40, 80])
    current = {"request": ""}

    def lookup(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
        request_id = current["request"]
        case = (
            f"a hybrid KVCacheManager (block_size {BLOCK_SIZE}, sliding_window {window}, {num_blocks} blocks, "
            f"scenario {seed}), request {request_id}'s lookup"
        )
        runner.run(
            block_pool,
            list(block_hashes),
            max_num_blocks,
            num_contiguous_blocks,
            kv_cache_group_id,
            case,
            random_case=True,
            given=block_hashes,
        )
        return reference_find_sliding_window_cache_hit(
            block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id
        )

    config = make_kv_cache_config([window, None], BLOCK_SIZE, num_blocks)
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, kv_cache_config=config, find_sliding_window_cache_hit=lookup)
    prefixes = [[rng.randrange(40) for _ in range(rng.randint(8, 40))] for _ in range(2)]
    running: list[Request] = []
    for index in range(10):
        prefix = rng.choice(prefixes)
        cut = rng.randint(0, len(prefix))
        prompt = prefix[:cut] + [rng.randrange(40) for _ in range(rng.randint(1, 12))]
        request = Request(f"r{index}", prompt, BLOCK_SIZE)
        current["request"] = request.request_id
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert num_hit_tokens <= max_cache_hit_blocks(request.num_tokens, BLOCK_SIZE) * BLOCK_SIZE
        if manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits) is None:
            continue
        request.num_computed_tokens = request.num_tokens
        for _ in range(rng.randint(0, 6)):  # decode a few tokens: blocks leave the window
            request.append_output_token_ids(rng.randrange(40))
            if manager.allocate_slots(request, 1) is None:
                break
            request.num_computed_tokens += 1
        running.append(request)
        while running and (len(running) > 2 or rng.random() < 0.5):
            manager.free(running.pop(rng.randrange(len(running))))
    for request in running:
        manager.free(request)
