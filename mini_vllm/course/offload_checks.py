"""Checks for the offloading chapter (06c): ``lru_evict(policy, n, protected)``, the CPU tier's LRU eviction.

The learner's function gets an ``LRUCachePolicy`` (``mini_vllm/kv_offload/lru.py``)
and must evict exactly ``n`` of its idle chunks (``policy.evictable``: ref_cnt 0,
no store or load in flight) that are not in ``protected``, the smallest
``(policy.ranks[key], key)`` first, each through ``policy.remove(key)``, and
return them as ``(key, chunk)`` pairs in that order; with fewer than ``n``
candidates it returns None and changes nothing.

The check builds the same policy twice by hand (which chunks, their ranks and
ref_cnts), runs the learner's function on one and the reference on the other,
and compares after every call what each returned and what the policy holds.
Each hand-built case carries one mistake people make (a protected or busy
chunk evicted, the most recent evicted instead of the least, a request's head
before its tail, a partial eviction, keys returned instead of pairs, a change
left behind by a refusal); random policies get several calls in a row, with
loads and stores starting and finishing between them, as in the tier: which
chunks are idle changes from call to call, and ``policy.evictable`` says which.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from ..kv_offload.cache_policy import STORE_IN_FLIGHT, ChunkStatus
from ..kv_offload.lru import LRUCachePolicy, lru_evict
from ._harness import Checker, guarded_check

NAME = "lru_evict"

Spec = tuple[str, tuple[int, int], int]
"""One chunk of a hand-built policy: (its name, its rank, its ref_cnt)."""


def key_of(name: str) -> bytes:
    """A readable offload key: the check's chunks are named, their keys are the names' bytes."""
    return name.encode()


def _calls_evict(policy: LRUCachePolicy, n: int, protected: set) -> None:
    raise RecursionError(
        "lru_evict called policy.evict(...), which is the function you are writing (the policy's evict calls it): "
        "choose the chunks from policy.evictable and policy.ranks, and remove each with policy.remove(key)"
    )


def make_policy(chunks: Sequence[Spec]) -> LRUCachePolicy:
    """An LRU policy holding ``chunks`` in the order given; chunk ids 0, 1, ... in that order."""
    policy = LRUCachePolicy(cache_capacity=max(len(chunks), 1), evict=_calls_evict)
    for chunk_id, (name, rank, ref_cnt) in enumerate(chunks):
        key = key_of(name)
        chunk = ChunkStatus(chunk_id)
        chunk.ref_cnt = ref_cnt
        policy.chunks[key] = chunk
        policy.ranks[key] = rank
        if ref_cnt == 0:
            policy.evictable.add(key)
    return policy


def policy_state(policy: LRUCachePolicy) -> dict:
    """What the policy holds, comparable between two policies built alike (and printed when they differ)."""
    return {
        "chunks": {
            key.decode(): f"chunk_id {chunk.chunk_id}, ref_cnt {chunk.ref_cnt}"
            for key, chunk in sorted(policy.chunks.items())
        },
        "ranks": {key.decode(): rank for key, rank in sorted(policy.ranks.items())},
        "evictable": sorted(key.decode() for key in policy.evictable),
    }


def _names(keys) -> list[str]:
    return [key.decode() if isinstance(key, bytes) else repr(key) for key in keys]


def _set_text(keys) -> str:
    """A set of keys as a set of names, ``{'a', 'c'}`` (``set()`` when empty): what ``protected`` is."""
    return "{" + ", ".join(map(repr, sorted(_names(keys)))) + "}" if keys else "set()"


# -- one call, compared -----------------------------------------------------------------
class _EvictCheck:
    def __init__(self, evict: Callable) -> None:
        self.evict = evict
        self.check = Checker(NAME)

    def compare(
        self, mine: LRUCachePolicy, reference: LRUCachePolicy, n: int, protected: set, case: str, random_case=False
    ) -> None:
        """Call the learner's function on ``mine`` and the reference on ``reference`` (built alike); compare."""
        check = self.check
        before = policy_state(mine)
        ref_cnts = {key: chunk.ref_cnt for key, chunk in mine.chunks.items()}  # what a busy chunk was doing
        candidates = [key for key in mine.evictable if key not in protected]
        asked = f"{case}: lru_evict(policy, n={n}, protected={_set_text(protected)})"
        protected_given = set(protected)
        got = check.call(
            self.evict,
            mine,
            n,
            protected_given,
            what=asked,
            expected="a list of (key, chunk) pairs, or None",
        )
        expected = lru_evict(reference, n, set(protected))
        check.expect(
            protected_given == protected,
            f"{asked}: your code changed the protected set it was given",
            "protected is the caller's: read it, never add to it or remove from it",
            random_case=random_case,
        )
        if expected is None:
            self._refused(got, mine, before, n, candidates, asked, random_case)
        else:
            self._evicted(got, expected, mine, before, ref_cnts, protected, asked, random_case)
        check.expect_equal(
            policy_state(mine),
            policy_state(reference),
            f"{asked}: what the policy holds afterwards",
            "every evicted chunk leaves policy.chunks, policy.ranks and policy.evictable (policy.remove(key) does all "
            "three); no other chunk changes",
            random_case=random_case,
        )

    def _refused(self, got, mine, before, n, candidates, asked, random_case) -> None:
        check = self.check
        if got is not None:
            if isinstance(got, (list, tuple)) and len(got) < n:
                check.fail(
                    f"{asked}: only {len(candidates)} chunks can go, and your code evicted {len(got)} of them",
                    "all or nothing: when fewer than n chunks are idle and unprotected, evict none and return None "
                    "(the manager then refuses the store); a partial eviction loses prefixes for nothing",
                )
            check.fail(
                f"{asked}: only {len(candidates)} chunks can go (idle and not protected), expected None, "
                f"got {got!r:.200}",
                "a chunk in protected, or whose key is not in policy.evictable (a store or a load in flight), "
                "never goes; with fewer than n candidates return None",
            )
        check.expect_equal(
            policy_state(mine),
            before,
            f"{asked}: your code returned None but changed the policy",
            "decide first (count the candidates), remove after: a refusal must leave the policy as it was",
            random_case=random_case,
        )

    def _evicted(self, got, expected, mine, before, ref_cnts, protected, asked, random_case) -> None:
        check = self.check
        if got is None:
            check.fail(
                f"{asked}: {len(expected)} chunks can go, expected {_names(k for k, _ in expected)}, got None",
                "None is only for 'fewer than n candidates': the candidates are the keys of policy.evictable "
                "not in protected",
            )
        got = check.expect_list(got, asked, random_case=random_case)
        for item in got:
            if isinstance(item, bytes):
                check.fail(
                    f"{asked}: returned keys ({_names(got)}), not (key, chunk) pairs",
                    "return [(key, policy.chunks[key]), ...]: the manager gives each evicted chunk's slot "
                    "(chunk.chunk_id) back to its pool; read the chunk before policy.remove(key) forgets it",
                )
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], ChunkStatus)):
                check.fail(f"{asked}: the list holds {item!r:.100}, not a (key, chunk) pair")
        keys = [key for key, _ in got]
        expected_keys = [key for key, _ in expected]
        for key in keys:
            name = key.decode() if isinstance(key, bytes) else key
            if key in protected:
                check.fail(
                    f"{asked}: evicted {name!r}, which is protected",
                    "a protected key (one the same store offers) must still be in the tier afterwards: skip "
                    "every key in protected",
                )
            if name in before["chunks"] and name not in before["evictable"]:
                ref_cnt = ref_cnts[key]
                what = (
                    "being stored (ref_cnt -1)" if ref_cnt == STORE_IN_FLIGHT else f"being loaded (ref_cnt {ref_cnt})"
                )
                check.fail(
                    f"{asked}: evicted {name!r}, which is {what}",
                    "only idle chunks go: the candidates are the keys in policy.evictable (ref_cnt 0)",
                )
        if len(keys) != len(expected_keys):
            check.fail(f"{asked}: evicted {len(keys)} chunks ({_names(keys)}), n={len(expected_keys)} were asked for")
        if keys != expected_keys:
            ranks = {name: tuple(rank) for name, rank in before["ranks"].items()}
            newest = sorted(
                (key for key in map(key_of, before["evictable"]) if key not in protected),
                key=lambda key: (ranks[key.decode()], key),
                reverse=True,
            )
            if set(keys) == set(expected_keys):
                hint = "the right chunks in the wrong order: return them oldest first, smallest (rank, key) first"
            elif keys == newest[: len(keys)]:
                hint = "these are the most recently used: LRU evicts the least recent, the smallest rank first"
            elif [ranks[key.decode()] for key in keys] == [ranks[key.decode()] for key in expected_keys]:
                hint = "chunks of equal rank go by their key, the smaller first: sort by (policy.ranks[key], key)"
            elif [ranks[key.decode()][0] for key in keys] == [ranks[key.decode()][0] for key in expected_keys]:
                hint = (
                    "a rank is a pair (use number, -end position): compare the whole pair, so that within a request "
                    "the tail (larger end position, smaller -position) goes before the head"
                )
            else:
                hint = "sort the candidates by (policy.ranks[key], key) and evict the first n"
            check.fail(f"{asked}: evicted {_names(keys)}, expected {_names(expected_keys)}\n    ranks: {ranks}", hint)
        for (key, chunk), (_, expected_chunk) in zip(got, expected):
            if chunk.chunk_id != expected_chunk.chunk_id:
                check.fail(
                    f"{asked}: returned {key.decode()!r} with chunk {chunk.chunk_id}, it held chunk "
                    f"{expected_chunk.chunk_id}",
                    "pair each key with its own chunk, policy.chunks[key]",
                )
        check.expect(True, asked, random_case=random_case)


# -- the cases ---------------------------------------------------------------------------------
IDLE, LOADING = 0, 2

FIXED_CASES: list[tuple[str, list[Spec], int, set[str]]] = [
    (
        "five idle chunks, two to evict (the oldest two go, oldest first)",
        [("d", (4, 0), IDLE), ("a", (1, 0), IDLE), ("e", (5, 0), IDLE), ("b", (2, 0), IDLE), ("c", (3, 0), IDLE)],
        2,
        set(),
    ),
    (
        "the oldest chunk is protected (the store offers it)",
        [("a", (1, 0), IDLE), ("b", (2, 0), IDLE), ("c", (3, 0), IDLE)],
        1,
        {"a"},
    ),
    (
        "the oldest chunk is being loaded, the next one being stored",
        [("a", (1, 0), LOADING), ("b", (2, 0), STORE_IN_FLIGHT), ("c", (3, 0), IDLE), ("d", (4, 0), IDLE)],
        1,
        set(),
    ),
    (
        "one request's prefix, stored head first: its tail goes before its head",
        [("head", (7, -1), IDLE), ("middle", (7, -2), IDLE), ("tail", (7, -3), IDLE), ("later", (9, 0), IDLE)],
        2,
        set(),
    ),
    (
        "two chunks of one rank (two groups, one position): the smaller key first",
        [("y", (3, -2), IDLE), ("x", (3, -2), IDLE), ("z", (5, 0), IDLE)],
        1,
        set(),
    ),
    (
        "three to evict, only two can go (one protected, one being loaded)",
        [("a", (1, 0), IDLE), ("b", (2, 0), LOADING), ("c", (3, 0), IDLE), ("d", (4, 0), IDLE)],
        3,
        {"c"},
    ),
    ("nothing to evict (n=0): an empty list, not None", [("a", (1, 0), IDLE)], 0, set()),
    (
        "every chunk busy (two loads, one store): nothing can go",
        [("a", (1, 0), LOADING), ("b", (2, 0), 1), ("c", (3, -16), STORE_IN_FLIGHT)],
        1,
        set(),
    ),
    (
        "every idle chunk goes (n = the number of candidates)",
        [("a", (2, 0), IDLE), ("b", (1, 0), IDLE), ("c", (3, 0), LOADING)],
        2,
        set(),
    ),
]


def _random_specs(rng: random.Random) -> list[Spec]:
    specs = []
    for i in range(rng.randint(0, 9)):
        rank = (rng.randint(1, 6), -rng.randint(0, 3) if rng.random() < 0.6 else 0)
        ref_cnt = rng.choice([IDLE, IDLE, IDLE, LOADING, 1, STORE_IN_FLIGHT])
        specs.append((f"k{i}", rank, ref_cnt))
    rng.shuffle(specs)
    return specs


def _transfers_start_and_finish(rng: random.Random, policies: Sequence[LRUCachePolicy]) -> None:
    """Between two calls, as in the tier (``CPUOffloadingManager``): some loads start (``ref_cnt`` + 1; an idle
    chunk leaves ``policy.evictable``), some loads and stores finish (back to 0: evictable again); alike in each
    policy (they hold the same keys: the comparison after each call says so)."""
    changes = [(key, rng.choice(("load", "finish"))) for key in sorted(policies[0].chunks) if rng.random() < 0.3]
    for policy in policies:
        for key, change in changes:
            chunk = policy.chunks[key]
            if change == "load" and chunk.ref_cnt >= 0:
                if chunk.ref_cnt == 0:
                    policy.mark_non_evictable(key)
                chunk.ref_cnt += 1
            elif change == "finish" and chunk.ref_cnt != 0:
                chunk.ref_cnt = 0 if chunk.ref_cnt == STORE_IN_FLIGHT else chunk.ref_cnt - 1
                if chunk.ref_cnt == 0:
                    policy.mark_evictable(key)


@guarded_check(part="lru_evict")
def check_lru_evict(lru_evict: Callable) -> None:
    """The learner's ``lru_evict(policy, n, protected)`` against the reference, on hand-built and random policies."""
    runner = _EvictCheck(lru_evict)
    for case, specs, n, protected in FIXED_CASES:
        keys = {key_of(name) for name in protected}
        runner.compare(make_policy(specs), make_policy(specs), n, keys, case)
    rng = runner.check.rng
    for trial in range(150):
        specs = _random_specs(rng)
        mine, reference = make_policy(specs), make_policy(specs)
        for call in range(3):  # several calls in a row on the same policy, transfers in between
            if call:
                _transfers_start_and_finish(rng, [mine, reference])
            names = [name for name, _, _ in specs]
            protected = {key_of(name) for name in names if rng.random() < 0.25}
            n = rng.randint(0, max(len(reference.evictable) + 1, 1))
            runner.compare(mine, reference, n, protected, f"random policy {trial}, call {call + 1}", random_case=True)
    runner.check.passed()
