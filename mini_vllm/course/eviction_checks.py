"""Checks for chapter 06: freeing blocks and popping new ones (with lazy eviction).

The learner writes three functions over a ``BlockPool``:

* ``free_blocks(pool, ordered_blocks)`` — drop one reference per block; a block
  reaching ref_cnt 0 goes back to the free queue: with a hash to the tail, in
  the order given; without one to the head (``BlockPool.free_blocks``).
* ``free_request_blocks(pool, req_blocks)`` — release one request's block
  table, last block first (what ``KVCacheManager.free`` does with it).
* ``get_new_blocks(pool, num_blocks)`` — pop blocks from the head; a popped
  block that still holds a cached prefix is evicted: its hash is cleared and it
  leaves the map (``BlockPool.get_new_blocks``).

Each check builds the same pool twice (deterministically), runs the learner's
function on one and the reference on the other, and compares the whole state:
the free queue head to tail, every ref_cnt and hash, and the map. Pools with
caching off, busy pools asked for more than is free, the caller's lists left
unchanged, and O(blocks handled) on a pool of 20,000 blocks are checked too.
"""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..block_pool import BlockHashToBlockMap, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from ..events import BlockRemoved
from ..hashing import BlockHash, hash_request_tokens
from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ..scheduler import schedule_whole_prompt
from ._harness import CheckFailure, Checker, Mistake, guarded_check, learner_error, snapshot
from .fixtures import CountingBlock, cache_block, counting_pool, pool_state

BLOCK_SIZE = 4


BLOCK_REMOVED = (
    "BlockRemoved(block_hashes=(block_hash,), block_ids=(block.block_id,), group_idx=block.kv_cache_group_id)"
)
"""The event an eviction records, as the hints write it: ``block_hash`` and the group read before they are cleared."""


# -- building pools -------------------------------------------------------------
def _hash(tag: int) -> BlockHash:
    return hash_request_tokens([tag] * BLOCK_SIZE, BLOCK_SIZE)[0]


def _take(pool: BlockPool, ids: Sequence[int], ref_cnt: int = 1, hashed: Sequence[int] = ()) -> list[KVCacheBlock]:
    """Give blocks ``ids`` ``ref_cnt`` references (out of the free queue); cache the ``hashed`` ones."""
    blocks = [pool.blocks[i] for i in ids]
    for _ in range(ref_cnt):
        pool.touch(blocks)
    for block in blocks:
        if block.block_id in hashed:
            cache_block(pool, block, _hash(block.block_id))
    return blocks


def _cache_free(pool: BlockPool, ids: Sequence[int], block_hash: BlockHash | None = None) -> None:
    """Make free blocks cached-but-free (as after their request finished), in place in the queue."""
    for block_id in ids:
        cache_block(pool, pool.blocks[block_id], block_hash if block_hash is not None else _hash(block_id))


def _compare_states(check: Checker, got: BlockPool, expected: BlockPool, case: str, hint: str = "", random_case=False):
    got_state, expected_state = pool_state(got), pool_state(expected)
    for key in expected_state:
        check.expect_equal(got_state[key], expected_state[key], f"{case}: {key}", hint, random_case=random_case)


def _queue(pool: BlockPool) -> list[int]:
    """The free queue's block ids, head to tail."""
    return list(pool.snapshot().free_block_queue)


def _in_map(pool: BlockPool, block: KVCacheBlock) -> bool:
    return any(b is block for _, b in pool.cached_block_hash_to_block.items())


def _large_pool(num_in_use: int) -> tuple[BlockPool, list[KVCacheBlock], dict]:
    """20,000 counting blocks, the first ``num_in_use`` in use (every other one cached), and the
    map's items() and the queue's get_all_free_blocks() counting their calls: O(n) scans show up."""
    scans = {"items": 0, "get_all_free_blocks": 0}

    class ScanCountingQueue(FreeKVCacheBlockQueue):
        def get_all_free_blocks(self):
            scans["get_all_free_blocks"] += 1
            return super().get_all_free_blocks()

    class ScanCountingMap(BlockHashToBlockMap):
        def items(self):
            scans["items"] += 1
            return super().items()

    pool = counting_pool(20_000, free_queue=ScanCountingQueue, cached_block_hash_to_block=ScanCountingMap())
    in_use = _take(pool, list(range(num_in_use)), hashed=list(range(0, num_in_use, 2)))
    _cache_free(pool, [num_in_use + 1, num_in_use + 3])
    scans.update(items=0, get_all_free_blocks=0)
    CountingBlock.reads = 0
    return pool, in_use, scans


def _expect_constant_time(check: Checker, case: str, scans: dict, num_blocks: int) -> None:
    reads = CountingBlock.reads
    check.expect(
        not scans["items"] and not scans["get_all_free_blocks"] and reads <= 15 * max(num_blocks, 1) + 10,
        f"{case}: your code read {reads:,} block attributes, walked the hash map {scans['items']} time(s) and "
        f"listed the free queue {scans['get_all_free_blocks']} time(s): its cost grows with the pool "
        "(20,000 blocks), not with the blocks it handles",
        "work on the blocks you are given or pop: free_block_queue.append/appendleft/popleft and "
        "cached_block_hash_to_block.pop(block_hash, block_id) are all O(1); never search the whole queue, "
        "the map or pool.blocks",
    )


def _reference_free_blocks(pool: BlockPool, ordered_blocks) -> None:
    BlockPool.free_blocks(pool, ordered_blocks)


def _reference_get_new_blocks(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    return BlockPool.get_new_blocks(pool, num_blocks)


def _random_pool(seed: int) -> tuple[KVCacheManager, dict[str, Request]]:
    """A pool after a few requests (sharing prefixes) ran and some finished: the same for one seed.

    Every fifth seed has prefix caching off: no block gets a hash, every freed block goes to the head.
    """
    rng = random.Random(seed)
    manager = KVCacheManager(num_blocks=rng.randint(8, 14), block_size=BLOCK_SIZE, enable_caching=seed % 5 != 4)
    prefixes = [[rng.randrange(30) for _ in range(rng.choice([4, 8]))] for _ in range(2)]
    running: dict[str, Request] = {}
    for index in range(rng.randint(3, 6)):
        tokens = rng.choice(prefixes) + [rng.randrange(30) for _ in range(rng.randint(1, 9))]
        request = Request(f"r{index}", tokens, block_size=BLOCK_SIZE)
        if schedule_whole_prompt(manager, request) is None:
            continue
        running[request.request_id] = request
        if rng.random() < 0.5:  # some finish at once
            finished = running.pop(rng.choice(list(running)))
            manager.free(finished)
    return manager, running


def _free_random_pools(
    check: Checker,
    free_table: Callable,
    reference_free_table: Callable,
    hint: str = "",
    mistakes: Sequence[tuple[Callable, str]] = (),
) -> None:
    """Random pools, built twice per seed: free each running request's table with the learner's
    ``free_table(pool, table)`` on one and the reference on the other, comparing the pools after each
    (``hint``: what a difference most likely means; ``mistakes``: ``(free_table, hint)`` of known
    mistakes, whose hint is given when the learner's pool is the one that mistake leaves)."""
    for seed in range(60):
        manager, running = _random_pool(seed)
        expected_manager, _ = _random_pool(seed)
        for done, request_id in enumerate(running):
            free_table(manager.block_pool, manager.req_to_blocks.pop(request_id))
            reference_free_table(expected_manager.block_pool, expected_manager.req_to_blocks.pop(request_id))
            got = pool_state(manager.block_pool)
            case, why = f"random pool (seed {seed}), request {request_id} freed", hint
            if got != pool_state(expected_manager.block_pool):
                for mistake, mistake_hint in mistakes:
                    replayed, _ = _random_pool(seed)
                    for earlier in list(running)[:done]:
                        reference_free_table(replayed.block_pool, replayed.req_to_blocks.pop(earlier))
                    mistake(replayed.block_pool, replayed.req_to_blocks.pop(request_id))
                    if pool_state(replayed.block_pool) == got:
                        why = mistake_hint
                        break
            _compare_states(check, manager.block_pool, expected_manager.block_pool, case, why, random_case=True)


# -- free_blocks ------------------------------------------------------------------
# FREE_BLOCKS_PROBES: pools whose table is freed last block first (as the manager does), each with
# its table of the typical mistakes, then compared with the reference.
def _one_request() -> tuple[BlockPool, list[KVCacheBlock]]:
    """Blocks 0-2 full and cached, block 3 partial (no hash)."""
    pool = BlockPool(8)
    return pool, _take(pool, [0, 1, 2, 3], hashed=[0, 1, 2])


def _shared() -> tuple[BlockPool, list[KVCacheBlock]]:
    """Blocks 0 and 1 held by two requests (ref_cnt 2), block 4 by one."""
    pool = BlockPool(8)
    both = _take(pool, [0, 1], ref_cnt=2, hashed=[0, 1])
    return pool, both + _take(pool, [4], hashed=[])


def _uncached() -> tuple[BlockPool, list[KVCacheBlock]]:
    """Caching off: a whole table without hashes."""
    pool = BlockPool(6, enable_caching=False)
    return pool, _take(pool, [0, 1, 2])


@dataclass
class _Freed:
    """What the learner's free_blocks left: the pool, and the table it was given (in block-id order)."""

    pool: BlockPool
    table: list[KVCacheBlock]

    @property
    def queue(self) -> list[int]:
        return _queue(self.pool)

    @property
    def ref_cnts(self) -> list[int]:
        return [block.ref_cnt for block in self.table]

    @property
    def missing(self) -> list[int]:
        """The table's blocks that are not in the free queue."""
        return [block.block_id for block in self.table if block.block_id not in self.queue]


ONE_REQUEST_MISTAKES = (  # blocks 0-2 cached, 3 partial, freed as ordered_blocks = [3, 2, 1, 0]
    Mistake(
        lambda freed: not all(ref_cnt == 0 for ref_cnt in freed.ref_cnts),
        lambda freed: f"one request freed: ref_cnt of blocks 0-3 should be 0, got {freed.ref_cnts}",
        "decrement block.ref_cnt once for every block you are given",
    ),
    Mistake(
        lambda freed: bool(freed.missing),
        lambda freed: (
            f"one request freed: blocks {freed.missing} reached ref_cnt 0 but were not returned to the "
            f"free queue (queue: {freed.queue})"
        ),
        "a block whose ref_cnt reaches 0 goes back into pool.free_block_queue: the pool has no other way to "
        "find it again",
    ),
    Mistake(
        lambda freed: (
            not (
                [block.block_hash is not None for block in freed.table] == [True, True, True, False]
                and all(_in_map(freed.pool, block) for block in freed.table[:3])
            )
        ),
        "one request freed: blocks 0-2 lost their hash or left the map",
        "freeing evicts nothing: a freed block keeps its hash and K/V until it is popped for reuse (lazy "
        "eviction), so a later request can still hit it",
    ),
    Mistake(
        lambda freed: freed.queue[0] != 3,
        lambda freed: (
            f"one request freed: block 3 has no hash and should be at the head of the free queue; queue: {freed.queue}"
        ),
        "a block without a hash (a partial block) can never be hit, so it goes to the HEAD "
        "(free_block_queue.appendleft): reused first, it costs no cached prefix",
    ),
    Mistake(
        lambda freed: freed.queue[-3:] != [2, 1, 0],
        lambda freed: (
            "one request freed with ordered_blocks = [3, 2, 1, 0]: the queue should end with 2, 1, 0; "
            f"queue: {freed.queue}"
        ),
        "append the hashed blocks to the TAIL in the order given (do not reverse or sort them yourself: "
        "the caller already passes them in eviction order)",
    ),
)

SHARED_MISTAKES = (  # blocks 0, 1 (ref_cnt 2) and 4 (ref_cnt 1) freed once
    Mistake(
        lambda freed: freed.ref_cnts != [1, 1, 0],
        lambda freed: (
            "blocks 0, 1 shared (ref_cnt 2) and 4 (ref_cnt 1) freed once: ref_cnt should be [1, 1, 0], "
            f"got {freed.ref_cnts}"
        ),
        "subtract exactly one reference per block",
    ),
    Mistake(
        lambda freed: 0 in freed.queue or 1 in freed.queue,
        lambda freed: (
            f"blocks 0 and 1 still have ref_cnt 1 (another request holds them) but are in the free queue: {freed.queue}"
        ),
        "only a block whose ref_cnt reaches 0 goes back to the free queue",
    ),
)

UNCACHED_MISTAKES = (  # caching off, blocks 0, 1, 2 (no hashes) freed as ordered_blocks = [2, 1, 0]
    Mistake(
        lambda freed: freed.queue[:3] != [2, 1, 0],
        lambda freed: (
            "caching off, blocks 0, 1, 2 (no hashes) freed as ordered_blocks = [2, 1, 0]: the queue "
            f"should start 2, 1, 0; queue: {freed.queue}"
        ),
        "blocks without a hash go to the head TOGETHER, keeping the order given (vLLM's prepend_n): the first "
        "of them becomes the new head. appendleft one by one reverses them: collect them, then appendleft "
        "them last one first",
    ),
)


@dataclass(frozen=True)
class _FreeProbe:
    """Free ``build()``'s table last block first; none of ``mistakes`` may show, then the pool must be the reference's.

    ``keeps_given``: the case that names the call when the list given must come back unchanged.
    """

    build: Callable[[], tuple[BlockPool, list[KVCacheBlock]]]
    mistakes: tuple[Mistake, ...]
    compared: str
    keeps_given: str = ""


FREE_BLOCKS_PROBES = (
    # 1. One request's table: the hashed blocks to the tail, the partial one to the head.
    _FreeProbe(
        _one_request,
        ONE_REQUEST_MISTAKES,
        "one request freed",
        keeps_given="one request freed with ordered_blocks = [3, 2, 1, 0]",
    ),
    # 2. Blocks still held by another request (ref_cnt 2) must stay out of the queue.
    _FreeProbe(_shared, SHARED_MISTAKES, "a shared prefix freed by one of its two requests"),
    # 2b. Caching off: a whole table without hashes goes to the head, in the order given.
    _FreeProbe(_uncached, UNCACHED_MISTAKES, "caching off: a request's blocks freed"),
)


@guarded_check(part="free_blocks")
def check_free_blocks(free_blocks: Callable) -> None:
    """The learner's ``free_blocks(pool, ordered_blocks)``."""
    check = Checker("free_blocks")
    raw_free_blocks = free_blocks
    free_blocks = check.wrap(free_blocks, "free_blocks", "one reference dropped per block given")

    for probe in FREE_BLOCKS_PROBES:
        pool, table = probe.build()
        given = list(reversed(table))
        free_blocks(pool, given)
        if probe.keeps_given:
            check.expect_unchanged(
                [block.block_id for block in reversed(table)],
                snapshot(given),
                probe.keeps_given,
                "ordered_blocks",
                "ordered_blocks is the caller's list (for KVCacheManager.free, the request's block table): loop over "
                "it, do not reverse, sort or empty it in place",
            )
        check.expect_no_mistakes(probe.mistakes, _Freed(pool, table))
        expected_pool, expected_table = probe.build()
        _reference_free_blocks(expected_pool, list(reversed(expected_table)))
        _compare_states(check, pool, expected_pool, probe.compared)

    # 3. An iterator, as KVCacheManager.free passes it (reversed(...)).
    pool, table = _one_request()
    try:
        raw_free_blocks(pool, reversed(table))
    except TypeError as err:
        raise CheckFailure(
            f"free_blocks: calling it with reversed(table) raised TypeError: {err}\n"
            "    hint: ordered_blocks may be any iterable (KVCacheManager.free passes reversed(blocks)): "
            "loop over it with a for loop, do not index it or take its len()"
        ) from None
    expected_pool, expected_table = _one_request()
    _reference_free_blocks(expected_pool, reversed(expected_table))
    _compare_states(  # case 1 freed this very table as a list, and passed: the iterator is the difference
        check,
        pool,
        expected_pool,
        "ordered_blocks given as an iterator (reversed(table)), after the same table given as a list passed",
        "an iterator can be looped over only once, and the second loop finds it empty: loop over ordered_blocks "
        "once, or make a list of it first (blocks = list(ordered_blocks))",
    )

    # 4. Freed blocks join the tail after the blocks already free, oldest first (LRU).
    def two_requests() -> tuple[BlockPool, list[KVCacheBlock], list[KVCacheBlock]]:
        pool = BlockPool(10)
        first = _take(pool, [0, 1, 2], hashed=[0, 1, 2])
        second = _take(pool, [3, 4, 5], hashed=[3, 4])
        return pool, first, second

    pool, first, second = two_requests()
    free_blocks(pool, list(reversed(first)))
    free_blocks(pool, list(reversed(second)))
    expected_pool, e_first, e_second = two_requests()
    _reference_free_blocks(expected_pool, list(reversed(e_first)))
    _reference_free_blocks(expected_pool, list(reversed(e_second)))
    _compare_states(
        check,
        pool,
        expected_pool,
        "two requests freed one after the other",
        "the request freed last has its blocks at the very tail: they are the most recently used",
    )

    # 5. O(number of blocks freed): three blocks of a pool of 20,000.
    pool, in_use, scans = _large_pool(3)
    free_blocks(pool, list(reversed(in_use)))
    _expect_constant_time(check, "3 blocks freed in a pool of 20,000", scans, 3)

    # 6. Random pools (some with caching off): free the running requests one by one, as the engine does.
    _free_random_pools(
        check,
        lambda pool, table: free_blocks(pool, list(reversed(table))),
        lambda pool, table: _reference_free_blocks(pool, list(reversed(table))),
    )
    check.passed()


# -- free_request_blocks ------------------------------------------------------------
@guarded_check(part="free_request_blocks")
def check_free_request_blocks(free_request_blocks: Callable) -> None:
    """The learner's ``free_request_blocks(pool, req_blocks)`` (it calls their ``free_blocks``).

    When it fails and the ``free_blocks`` it calls is the learner's own and fails
    its own check, the message says so: the mistake is there, not here.
    """
    try:
        _check_free_request_blocks(free_request_blocks)
    except CheckFailure as failure:  # (a stub's NotImplementedError names its own function: it goes through)
        if not _calls_a_failing_free_blocks(free_request_blocks):
            raise
        raise CheckFailure(
            "free_request_blocks: it calls your free_blocks, which fails its own check "
            "(check_free_blocks, above): fix free_blocks first, then run this check again.\n"
            f"    what this check saw: {failure.seen}"
        ) from None


def _calls_a_failing_free_blocks(free_request_blocks: Callable) -> bool:
    """True when ``free_request_blocks`` calls the learner's own ``free_blocks`` and that fails its check."""
    helper = getattr(free_request_blocks, "__globals__", {}).get("free_blocks")
    if not callable(helper) or getattr(helper, "__module__", None) != "__main__":
        return False
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            check_free_blocks.__wrapped__(helper)  # the check alone: a pass keeps nothing here
        except Exception:  # noqa: BLE001 - a CheckFailure, the stub's NotImplementedError, anything: it fails
            return True
    return False


def _check_free_request_blocks(free_request_blocks: Callable) -> None:
    check = Checker("free_request_blocks")
    free_request_blocks = check.wrap(free_request_blocks, "free_request_blocks", "every block of the table freed once")

    # 1. The chapter's example: pool of 10, A = 48 shared tokens + 7, B = the same 48 + 5.
    def chapter_example() -> tuple[KVCacheManager, Request, Request]:
        manager = KVCacheManager(num_blocks=10, block_size=16)
        shared = list(range(1000, 1048))
        a = Request("A", shared + list(range(7)))
        b = Request("B", shared + list(range(100, 105)))
        for request in (a, b):
            schedule_whole_prompt(manager, request)
        return manager, a, b

    manager, a, b = chapter_example()
    table_a = list(manager.req_to_blocks["A"])
    given = manager.req_to_blocks.pop("A")
    free_request_blocks(manager.block_pool, given)
    check.expect_unchanged(
        [b.block_id for b in table_a],
        snapshot(given),
        "A freed",
        "block table (req_blocks)",
        "reversed(req_blocks) gives the blocks last first without changing the list; req_blocks.reverse() "
        "(or .sort(), .pop()) changes the caller's block table",
    )
    queue = _queue(manager.block_pool)
    check.expect(
        [blk.ref_cnt for blk in table_a] == [1, 1, 1, 0],
        f"A freed (blocks [0, 1, 2, 3], the first three shared with B): ref_cnt should be [1, 1, 1, 0], "
        f"got {[blk.ref_cnt for blk in table_a]}",
        "free every block of the table exactly once",
    )
    free_request_blocks(manager.block_pool, manager.req_to_blocks.pop("B"))
    queue = _queue(manager.block_pool)
    check.expect(
        queue[-3:] != [0, 1, 2],
        f"A then B freed: the free queue is {queue}; it ends with 0, 1, 2, so block 2 would be kept longest and "
        "block 0 evicted first: you freed the table in table order",
        "free a request's blocks LAST block first (reversed(req_blocks)): the tail of a prefix is evicted before "
        "its head, which every request with the same start needs",
    )
    check.expect_equal(
        queue,
        [4, 3, 5, 6, 7, 8, 9, 2, 1, 0],
        "A then B freed: the free queue (head -> tail)",
        "pass reversed(req_blocks) to your free_blocks",
    )

    # 2. Random pools.
    _free_random_pools(
        check,
        free_request_blocks,
        lambda pool, table: pool.free_blocks(reversed(table)),
        "free the blocks in the reverse of the block table's order (the request's last block first), whatever "
        "their block ids: the free queue then evicts a prefix's last blocks before its first ones, which more "
        "requests share",
        mistakes=[
            (
                lambda pool, table: [pool.free_blocks([block]) for block in reversed(table)],
                "you called free_blocks once per block. The blocks without a hash go to the HEAD of the queue, and "
                "freed one at a time each lands in front of the one before, which reverses them: pass all of the "
                "request's blocks to free_blocks in one call, in the order you already use",
            )
        ],
    )
    check.passed()


# -- get_new_blocks ----------------------------------------------------------------
# The check runs GET_NEW_BLOCKS_CASES in order: each row is a pool, how many blocks to ask for, and
# what must come out. _Pop compares everything with the reference; _Probe looks for the typical
# mistakes of its table, each named by its own message; _TooMany asks for more than is free.
def _cached_head() -> BlockPool:
    pool = BlockPool(6)
    _cache_free(pool, [0, 1])  # blocks 0 and 1: free, but still holding K/V some request may hit
    return pool


def _cached_for_group_1() -> BlockPool:
    """A hybrid model's pool: the head block is cached for KV-cache group 1 (a sliding-window group)."""
    pool = BlockPool(6)
    cache_block(pool, pool.blocks[0], _hash(0), kv_cache_group_id=1)
    return pool


def _twins() -> BlockPool:
    """Two blocks hold the same contents: evicting one must leave the other findable."""
    pool = BlockPool(6)
    shared_hash = _hash(99)
    _cache_free(pool, [0], shared_hash)
    _take(pool, [3])
    pool.blocks[3].block_hash = shared_hash
    pool.cached_block_hash_to_block.insert(shared_hash, pool.blocks[3])
    return pool


def _mixed() -> BlockPool:
    """Several blocks, cached and empty mixed."""
    pool = BlockPool(8)
    _take(pool, [0, 1, 2])
    BlockPool.free_blocks(pool, [pool.blocks[2]])  # an empty block at the head
    _cache_free(pool, [5, 6])
    return pool


def _busy() -> BlockPool:
    """5 of 8 blocks in use, 3 free."""
    pool = BlockPool(8)
    _take(pool, [0, 1, 2, 3, 4], hashed=[0, 1])
    _cache_free(pool, [6])
    return pool


@dataclass
class _Popped:
    """What one call of the learner's get_new_blocks left: the pool, and the blocks it returned."""

    pool: BlockPool
    got: Any

    @property
    def ids(self) -> list[int]:
        return [block.block_id for block in self.got]

    @property
    def removed(self) -> list[BlockRemoved]:
        return [event for event in self.pool.kv_event_queue if isinstance(event, BlockRemoved)]


def _stale_id(popped: _Popped) -> int | None:
    stale = popped.pool.get_cached_block(_hash(0))
    return stale.block_id if stale is not None else None


def _event_hint(popped: _Popped) -> str:
    """Why the BlockRemoved events of popping the cached blocks 0 and 1 are not the engine's."""
    removed = popped.removed
    if removed and all(event.block_hashes == (None,) for event in removed):
        return (
            "your events name the hash None: you queued them after clearing block.block_hash. Keep the hash "
            "first (block_hash = block.block_hash), or queue the event before setting block.block_hash = None"
        )
    if any(not isinstance(e.block_hashes, tuple) or not isinstance(e.block_ids, tuple) for e in removed):
        return (
            "block_hashes and block_ids are tuples of one entry each, (block_hash,) and (block.block_id,) (the "
            "trailing comma makes the tuple): a list or a bare value is another event than the engine's"
        )
    return (
        "record each eviction when the pool records events: if pool.enable_kv_cache_events: "
        f"pool.kv_event_queue.append({BLOCK_REMOVED}) (a router mirrors each replica's cache from these events; "
        "read the block's hash and group before you clear them)"
    )


CACHED_HEAD_MISTAKES = (  # blocks 0 and 1 cached and free at the head: get_new_blocks(pool, 1)
    Mistake(
        lambda popped: popped.ids != [0],
        lambda popped: f"blocks 0 and 1 are cached and free at the head: get_new_blocks(pool, 1) returned {popped.ids}",
        "pop from the head even when the head block is cached: the queue order already is the eviction order",
    ),
    Mistake(
        lambda popped: _stale_id(popped) is not None,
        lambda popped: (
            f"block 0 was popped for reuse, but pool.get_cached_block(its old hash) still returns block "
            f"{_stale_id(popped)}: a stale map entry"
        ),
        "evict the popped block: pool.cached_block_hash_to_block.pop(block.block_hash, block.block_id). "
        "Otherwise the next request with that prefix 'hits' a block whose K/V are being overwritten",
    ),
    Mistake(
        lambda popped: popped.pool.blocks[0].block_hash is not None,
        "block 0 was popped for reuse and left the map, but it still carries its old block_hash",
        "clear it (block.block_hash = None): the block will hold other tokens now, and cache_full_blocks "
        "refuses a block that already has a hash",
    ),
    Mistake(
        lambda popped: (
            not (_in_map(popped.pool, popped.pool.blocks[1]) and popped.pool.blocks[1].block_hash is not None)
        ),
        "popping block 0 also evicted block 1, which stays in the free queue",
        "evict only the blocks you pop: the others stay cached until their turn (lazy eviction)",
    ),
    # An eviction is something the engine reports: its counter, and a KV event when someone listens.
    Mistake(
        lambda popped: popped.pool.num_evictions != 1,
        lambda popped: (
            f"block 0's prefix was evicted, but pool.num_evictions is {popped.pool.num_evictions} (expected 1)"
        ),
        "count every eviction: pool.num_evictions += 1 (the engine's stats and vLLM's metrics report it)",
    ),
)

CACHED_HEAD_EVENT_MISTAKES = (  # the same pool, recording events: get_new_blocks(pool, 2)
    Mistake(
        lambda popped: (
            popped.removed != [BlockRemoved(block_hashes=(_hash(0),), block_ids=(0,)), BlockRemoved((_hash(1),), (1,))]
        ),
        lambda popped: (
            f"with pool.enable_kv_cache_events on, popping the cached blocks 0 and 1 recorded {popped.removed}"
        ),
        _event_hint,
    ),
)

GROUP_1_MISTAKES = (  # block 0 cached for KV-cache group 1, events on: get_new_blocks(pool, 1)
    Mistake(
        lambda popped: [event.group_idx for event in popped.removed] != [1],
        lambda popped: (
            "a hybrid model's pool: block 0, cached for KV-cache group 1, was popped; its BlockRemoved "
            f"events carry group_idx {[event.group_idx for event in popped.removed]} (expected [1])"
        ),
        "an event names the group the block was cached for, or a router mirroring that group's cache never "
        f"drops it: {BLOCK_REMOVED}, read before you reset it",
    ),
    Mistake(
        lambda popped: popped.pool.blocks[0].kv_cache_group_id != 0,
        lambda popped: (
            "a hybrid model's pool: block 0 left the cache, but still says kv_cache_group_id "
            f"{popped.pool.blocks[0].kv_cache_group_id}"
        ),
        "reset it with the hash (block.kv_cache_group_id = 0): a block's group means something only while "
        "it holds a hash, and the next request may cache it for another group",
    ),
)

TWINS_MISTAKES = (  # blocks 0 and 3 hold one prefix; block 0 is popped: get_new_blocks(pool, 1)
    Mistake(
        lambda popped: popped.pool.get_cached_block(_hash(99)) is not popped.pool.blocks[3],
        lambda popped: (
            "blocks 0 and 3 both hold one prefix; popping block 0 should leave block 3 in the map, but "
            f"pool.get_cached_block(hash) returns {_block_id(popped.pool.get_cached_block(_hash(99)))}"
        ),
        "remove only the popped block from the map: pool.cached_block_hash_to_block.pop(hash, block.block_id)",
    ),
)


def _block_id(block: KVCacheBlock | None) -> int | None:
    return block.block_id if block is not None else None


@dataclass(frozen=True)
class _Pop:
    """Pop ``num_blocks`` from ``build()``'s pool; everything must match the reference's pool."""

    build: Callable[[], BlockPool]
    num_blocks: int
    case: str
    hint: str = ""


@dataclass(frozen=True)
class _Probe:
    """Pop ``num_blocks`` from ``build()``'s pool (recording events when ``listened``); none of ``mistakes`` may show.

    ``returns_list``: the case that names the call when the result must first be a list of blocks.
    """

    build: Callable[[], BlockPool]
    num_blocks: int
    mistakes: tuple[Mistake, ...]
    listened: bool = False
    returns_list: str = ""


@dataclass(frozen=True)
class _TooMany:
    """Ask ``build()``'s pool for more blocks than are free: ValueError, and the pool untouched."""

    build: Callable[[], BlockPool]
    num_blocks: int
    case: str  # names the call when it raises something else
    not_refused: str
    not_refused_hint: str
    changed: str
    changed_hint: str


GET_NEW_BLOCKS_CASES = (
    # 1. A fresh pool: blocks come from the head, with one reference each.
    _Pop(lambda: BlockPool(6), 3, "3 blocks from a fresh pool of 6"),
    # 2. The head block holds a cached prefix: popping it evicts it.
    _Probe(
        _cached_head, 1, CACHED_HEAD_MISTAKES, returns_list="get_new_blocks(pool, 1) with a cached block at the head"
    ),
    _Probe(_cached_head, 2, CACHED_HEAD_EVENT_MISTAKES, listened=True),
    _Pop(_cached_head, 1, "a cached block at the head is popped"),
    # 2b. A hybrid model's pool: the head block is cached for KV-cache group 1 (a sliding-window group).
    _Probe(_cached_for_group_1, 1, GROUP_1_MISTAKES, listened=True),
    _Pop(_cached_for_group_1, 1, "a block cached for KV-cache group 1 (a hybrid model) is popped"),
    # 3. Two blocks hold the same contents: evicting one must leave the other findable.
    _Probe(_twins, 1, TWINS_MISTAKES),
    _Pop(_twins, 1, "one of two blocks with the same hash is popped"),
    # 4. Several blocks, cached and empty mixed.
    _Pop(_mixed, 4, "4 blocks from a queue mixing empty and cached blocks"),
    # 5. Asking for nothing, and asking for too much.
    _Pop(lambda: BlockPool(4), 0, "0 blocks", "asking for 0 blocks returns [] and changes nothing"),
    _TooMany(
        _cached_head,
        7,
        "asked for 7 blocks from a pool with 6 free",
        "asked for 7 blocks from a pool with 6 free, and no ValueError was raised",
        "check pool.get_num_free_blocks() first and raise ValueError when it is too small",
        "asked for 7 blocks with 6 free: ValueError was raised, but only after blocks were popped or evicted",
        "check the count BEFORE popping anything: a failed request must leave the pool untouched "
        "(the scheduler tries again next step)",
    ),
    # 6. A busy pool: 5 of 8 blocks in use, 3 free; asking for 4 must fail and change nothing.
    _TooMany(
        _busy,
        4,
        "a busy pool (8 blocks, 5 in use, 3 free)",
        "a busy pool (8 blocks, 5 in use, 3 free): get_new_blocks(pool, 4) did not raise ValueError",
        "compare with the FREE blocks, pool.get_num_free_blocks(), not with pool.num_blocks: blocks in use "
        "cannot be handed out",
        "a busy pool (8 blocks, 5 in use, 3 free): get_new_blocks(pool, 4) raised ValueError, but only after "
        "popping blocks: the pool changed",
        "compare num_blocks with the FREE blocks, pool.get_num_free_blocks(), BEFORE popping anything; "
        "pool.num_blocks counts the blocks in use too",
    ),
    _Pop(_busy, 3, "a busy pool (5 of 8 in use): all 3 free blocks popped"),
    # 7. A pool with prefix caching off: no block is cached, nothing to evict.
    _Pop(lambda: _random_pool(4)[0].block_pool, 1, "a pool with prefix caching off"),
)


def _random_pops(num_cases: int = 80) -> list[_Pop]:
    """Random pools (some with caching off), each asked for up to all of its free blocks."""
    pops = []
    for seed in range(num_cases):
        rng = random.Random(1000 + seed)
        num_free = _random_pool(seed)[0].block_pool.get_num_free_blocks()
        num_blocks = rng.randint(0, num_free)
        pops.append(
            _Pop(
                lambda seed=seed: _random_pool(seed)[0].block_pool,
                num_blocks,
                f"random pool (seed {seed}), {num_blocks} of {num_free} free blocks popped",
            )
        )
    return pops


@guarded_check(part="get_new_blocks")
def check_get_new_blocks(get_new_blocks: Callable) -> None:
    """The learner's ``get_new_blocks(pool, num_blocks)``."""
    check = Checker("get_new_blocks")
    raw_get_new_blocks = get_new_blocks
    get_new_blocks = check.wrap(get_new_blocks, "get_new_blocks", "a list of num_blocks blocks popped from the head")

    def raises_value_error(pool: BlockPool, num_blocks: int, case: str) -> bool:
        """True if the learner's get_new_blocks raised ValueError; another exception is reported."""
        try:
            raw_get_new_blocks(pool, num_blocks)
        except ValueError:
            return True
        except (NotImplementedError, CheckFailure):
            raise
        except Exception as error:  # noqa: BLE001 - reported with the case
            raise learner_error(
                check.name,
                f"{case}: get_new_blocks(pool, {num_blocks})",
                error,
                expected="ValueError (not enough free blocks)",
                hint="check pool.get_num_free_blocks() first and raise ValueError when it is too small",
            ) from None
        return False

    def pop(row: _Pop, random_case: bool = False) -> None:
        build, num_blocks, case, hint = row.build, row.num_blocks, row.case, row.hint
        pool, expected_pool = build(), build()
        got = get_new_blocks(pool, num_blocks)
        expected = _reference_get_new_blocks(expected_pool, num_blocks)
        got = check.expect_list(got, case, KVCacheBlock, "the popped KVCacheBlock objects", random_case)
        check.expect(
            all(b.ref_cnt == 1 for b in got),
            f"{case}: the returned blocks have ref_cnt {[b.ref_cnt for b in got]}",
            "a new block has one user, the request that asked for it: set ref_cnt = 1",
            random_case=random_case,
        )
        check.expect_equal(
            [b.block_id for b in got],
            [b.block_id for b in expected],
            f"{case}: the blocks returned",
            hint or "pop from the HEAD of the free queue (free_block_queue.popleft()), in order",
            random_case=random_case,
        )
        _compare_states(check, pool, expected_pool, case, hint, random_case=random_case)
        # What the pool reports, with KV events off (as above) and on: the same evictions, the same events.
        check.expect_equal(
            pool.num_evictions,
            expected_pool.num_evictions,
            f"{case}: pool.num_evictions",
            "count only the popped blocks that still had a hash: a block without one held no prefix to evict",
            random_case=random_case,
        )
        check.expect(
            not pool.kv_event_queue,
            f"{case}: with pool.enable_kv_cache_events off, you queued {list(pool.kv_event_queue)[:3]}",
            "queue BlockRemoved only when pool.enable_kv_cache_events is on: otherwise nobody empties the queue",
            random_case=random_case,
        )
        listened, expected_listened = build(), build()
        listened.enable_kv_cache_events = expected_listened.enable_kv_cache_events = True
        raw_get_new_blocks(listened, num_blocks)
        _reference_get_new_blocks(expected_listened, num_blocks)
        check.expect_equal(
            list(listened.kv_event_queue),
            list(expected_listened.kv_event_queue),
            f"{case}, with pool.enable_kv_cache_events on: the BlockRemoved events",
            "one BlockRemoved per popped block that had a hash, queued before clearing block.block_hash "
            "(an event carrying None names no prefix)",
            random_case=random_case,
        )

    def probe(row: _Probe) -> None:
        pool = row.build()
        if row.listened:
            pool.enable_kv_cache_events = True
        got = get_new_blocks(pool, row.num_blocks)
        if row.returns_list:
            got = check.expect_list(got, row.returns_list, KVCacheBlock, "KVCacheBlock")
        check.expect_no_mistakes(row.mistakes, _Popped(pool, got))

    def too_many(row: _TooMany) -> None:
        pool = row.build()
        before = pool_state(pool)
        if not raises_value_error(pool, row.num_blocks, row.case):
            check.fail(row.not_refused, row.not_refused_hint)
        check.expect(pool_state(pool) == before, row.changed, row.changed_hint)

    run = {_Pop: pop, _Probe: probe, _TooMany: too_many}
    for row in GET_NEW_BLOCKS_CASES:
        run[type(row)](row)

    # 8. O(number of blocks popped): two blocks (one of them cached) from a pool of 20,000.
    pool, _, scans = _large_pool(0)
    get_new_blocks(pool, 2)
    _expect_constant_time(check, "2 blocks popped from a pool of 20,000", scans, 2)

    # 9. Random pools (some with caching off).
    for row in _random_pops():
        pop(row, random_case=True)
    check.passed()
