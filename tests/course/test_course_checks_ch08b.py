"""The check of chapter 08b accepts the reference and rejects the typical mistakes, each with its message.

Each wrong ``find_sliding_window_cache_hit`` below is written the way a learner
writes it (not derived from the reference), with one mistake; the check must
raise a ``CheckFailure`` whose message names that mistake.
"""

from __future__ import annotations

import runpy
import textwrap

import pytest
from course_fixtures import rejects

from mini_vllm.block_pool import KVCacheBlock
from mini_vllm.course import check_find_sliding_window_cache_hit, kept_parts, use_parts
from mini_vllm.course import parts as parts_module
from mini_vllm.course._harness import CheckFailure
from mini_vllm.single_type_kv_cache_manager import find_sliding_window_cache_hit


def learner_lookup(
    block_pool,
    block_hashes,
    max_num_blocks,
    num_contiguous_blocks,
    kv_cache_group_id,
    *,
    needed=None,
    reset=True,
    group=None,
    nulls=True,
    partial_from_start=True,
    stop_at=None,
    null=None,
):
    """A correct lookup in a learner's style, unless one of the mistakes is switched on."""
    needed = num_contiguous_blocks if needed is None else needed(num_contiguous_blocks)
    group = kv_cache_group_id if group is None else group
    stop = max_num_blocks if stop_at is None else stop_at(block_hashes, max_num_blocks)
    placeholder = block_pool.null_block if null is None else null
    run = []  # the cached blocks of the current run, leftmost first
    for i in reversed(range(stop)):
        block = block_pool.get_cached_block(block_hashes[i], group)
        if block is None:
            if reset:
                run = []
            continue
        run.insert(0, block)
        if len(run) == needed:
            start = i
            return ([placeholder] * start if nulls else []) + run
    # No full run: the run that reaches block 0, if any.
    if run and (block_pool.get_cached_block(block_hashes[0], group) is run[0]):
        return run if partial_from_start else []
    return []


def test_ch08b_the_learner_style_lookup_is_correct(capsys):
    check_find_sliding_window_cache_hit(learner_lookup)
    assert "✓ find_sliding_window_cache_hit" in capsys.readouterr().out


def test_ch08b_find_sliding_window_cache_hit_accepts_the_reference(capsys):
    check_find_sliding_window_cache_hit(find_sliding_window_cache_hit)
    assert "✓ find_sliding_window_cache_hit" in capsys.readouterr().out


# -- the mistakes ------------------------------------------------------------------------------------------
def _left_to_right(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    hits = []  # chapter 05's lookup, with the group
    for block_hash in block_hashes[:max_num_blocks]:
        block = block_pool.get_cached_block(block_hash, kv_cache_group_id)
        if block is None:
            break
        hits.append(block)
    return hits


def _leftmost_run(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    run = []
    for i in range(max_num_blocks):  # left to right: the first run found is the leftmost
        block = block_pool.get_cached_block(block_hashes[i], kv_cache_group_id)
        run = run + [block] if block is not None else []
        if len(run) == num_contiguous_blocks:
            return [block_pool.null_block] * (i + 1 - len(run)) + run
    return _left_to_right(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id)


def _without_nulls(*args):
    return learner_lookup(*args, nulls=False)


def _needs_one_more(*args):
    return learner_lookup(*args, needed=lambda n: n + 1)


def _needs_one_fewer(*args):
    return learner_lookup(*args, needed=lambda n: max(1, n - 1))


def _count_greater_than(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    computed = [block_pool.null_block] * max_num_blocks
    count = 0
    for i in range(max_num_blocks - 1, -1, -1):
        block = block_pool.get_cached_block(block_hashes[i], kv_cache_group_id)
        if block is None:
            count = 0
            continue
        computed[i] = block
        count += 1
        if count > num_contiguous_blocks:  # meant >=
            return computed[: i + count]
    return computed[:count]


def _no_reset(*args):
    return learner_lookup(*args, reset=False)


def _ignores_the_group(*args):
    return learner_lookup(*args, group=0)


def _hard_codes_group_1(*args):
    return learner_lookup(*args, group=1)


def _empty_without_a_full_run(*args):
    return learner_lookup(*args, partial_from_start=False)


def _partial_run_anywhere(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    first_run = None  # (start, blocks) of the first run met from the right, however short
    run = []
    for i in range(max_num_blocks - 1, -1, -1):
        block = block_pool.get_cached_block(block_hashes[i], kv_cache_group_id)
        if block is None:
            if run and first_run is None:
                first_run = (i + 1, run)
            run = []
            continue
        run = [block] + run
        if len(run) == num_contiguous_blocks:
            return [block_pool.null_block] * i + run
    if run:
        return run
    if first_run is not None:  # "a shorter run is better than nothing"
        start, blocks = first_run
        return [block_pool.null_block] * start + blocks
    return []


def _ignores_max_num_blocks(*args):
    return learner_lookup(*args, stop_at=lambda hashes, max_num_blocks: len(hashes))


def _touches_the_hits(block_pool, *args):
    hit = learner_lookup(block_pool, *args)
    block_pool.touch([block for block in hit if block is not block_pool.null_block])
    return hit


def _takes_a_reference(block_pool, *args):
    hit = learner_lookup(block_pool, *args)
    for block in hit:
        block.ref_cnt += 1  # "the request holds them now"
    return hit


def _returns_block_ids(*args):
    return [block.block_id for block in learner_lookup(*args)]


def _returns_hashes(block_pool, block_hashes, *args):
    hit = learner_lookup(block_pool, block_hashes, *args)
    return [block.block_hash if block is not block_pool.null_block else None for block in hit]


def _none_for_null(*args):
    hit = learner_lookup(*args)
    return [None if block.block_id == -1 else block for block in hit]


def _a_new_null_block(*args):
    return learner_lookup(*args, null=KVCacheBlock(-1))


def _a_new_block_0_as_null(*args):
    """Found by a learner: a hand-made placeholder with a real block's id got a hint about get_cached_block."""
    return learner_lookup(*args, null=KVCacheBlock(0))


def _no_reset_with_a_counter(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, group):
    """Found by a learner: the run's counter not reset at a miss, blocks collected afterwards; the hint blamed
    an index off by one."""
    n = min(max_num_blocks, len(block_hashes))
    run, start = 0, 0
    for i in range(n - 1, -1, -1):
        if block_pool.get_cached_block(block_hashes[i], group) is None:
            continue  # meant: run = 0
        run += 1
        if run >= num_contiguous_blocks:
            start = i
            break
    if run == 0:
        return []
    blocks = [block_pool.get_cached_block(block_hashes[j], group) for j in range(start, start + run)]
    return [block_pool.null_block] * start + blocks


def _never_looks_at_block_0(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, group):
    """Found by a learner: range(n - 1, 0, -1); the hint was the general recipe."""
    n = min(max_num_blocks, len(block_hashes))
    run = []
    for i in range(n - 1, 0, -1):
        block = block_pool.get_cached_block(block_hashes[i], group)
        run = [block, *run] if block is not None else []
        if len(run) == num_contiguous_blocks:
            return [block_pool.null_block] * i + run
    return []


def _one_position_short(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, group):
    """Found by a learner: min(max_num_blocks - 1, ...); the hint was the general recipe."""
    n = min(max_num_blocks - 1, len(block_hashes))
    run = []
    for i in range(n - 1, -1, -1):
        block = block_pool.get_cached_block(block_hashes[i], group)
        run = [block, *run] if block is not None else []
        if len(run) == num_contiguous_blocks:
            return [block_pool.null_block] * i + run
    return run


def _reverses_the_hashes(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    block_hashes.reverse()  # "search from the right"
    found = []
    for i, block_hash in enumerate(block_hashes):
        j = len(block_hashes) - 1 - i
        if j >= max_num_blocks:
            continue
        block = block_pool.get_cached_block(block_hash, kv_cache_group_id)
        found = [block] + found if block is not None else []
        if len(found) == num_contiguous_blocks:
            return [block_pool.null_block] * j + found
    return []


def _whole_run(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    hit = learner_lookup(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id)
    i = len(hit) - num_contiguous_blocks - 1
    while len(hit) >= num_contiguous_blocks and i >= 0:  # "keep the rest of the run too"
        block = block_pool.get_cached_block(block_hashes[i], kv_cache_group_id)
        if block is None:
            break
        hit[i] = block
        i -= 1
    return hit


def _keeps_the_trailing_nulls(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    computed = [block_pool.null_block] * max_num_blocks
    count = 0
    for i in range(max_num_blocks - 1, -1, -1):
        block = block_pool.get_cached_block(block_hashes[i], kv_cache_group_id)
        count = count + 1 if block is not None else 0
        if block is not None:
            computed[i] = block
        if count >= num_contiguous_blocks:
            return computed  # not trimmed after the run
    return computed[:count]


def _scans_the_pool(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    class ScanningPool:
        null_block = block_pool.null_block

        @staticmethod
        def get_cached_block(block_hash, group):
            return next(
                (b for b in block_pool.blocks if b.block_hash == block_hash and b.kv_cache_group_id == group), None
            )

    return learner_lookup(ScanningPool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id)


def _keeps_state(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id, found=[]):  # noqa: B006
    found.clear()
    found.extend(learner_lookup(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id))
    return found


def _reversed_copy_off_by_one(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    count = 0  # "walk the hashes from the right": a reversed copy, the position computed back
    for j, block_hash in enumerate(block_hashes[:max_num_blocks][::-1]):
        i = max_num_blocks - j  # meant max_num_blocks - 1 - j
        if block_pool.get_cached_block(block_hash, kv_cache_group_id) is None:
            count = 0
            continue
        count += 1
        if count == num_contiguous_blocks:
            run = [block_pool.get_cached_block(h, kv_cache_group_id) for h in block_hashes[i : i + count]]
            return [block_pool.null_block] * i + run
    return [block_pool.get_cached_block(h, kv_cache_group_id) for h in block_hashes[:count]]


def _run_in_reverse(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    run = []
    for i in range(max_num_blocks - 1, -1, -1):
        block = block_pool.get_cached_block(block_hashes[i], kv_cache_group_id)
        if block is None:
            run = []
            continue
        run.append(block)  # collected right to left, never turned around
        if len(run) == num_contiguous_blocks:
            return [block_pool.null_block] * i + run
    return run


def _the_whole_table_without_a_run(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, group):
    hit = [block_pool.null_block] * max_num_blocks
    run = 0
    for i in range(max_num_blocks - 1, -1, -1):
        block = block_pool.get_cached_block(block_hashes[i], group)
        if block is None:
            run = 0
            continue
        hit[i] = block
        run += 1
        if run == num_contiguous_blocks:
            return hit[: i + run]
    return hit  # meant hit[:run]


MISTAKES = [
    (_left_to_right, "full attention's rule"),
    (_leftmost_run, "leftmost run"),
    (_without_nulls, "without the positions before it"),
    (_needs_one_more, "off by one: you needed num_contiguous_blocks + 1"),
    (_count_greater_than, "off by one: you needed num_contiguous_blocks + 1"),
    (_needs_one_fewer, "off by one: you accepted num_contiguous_blocks - 1"),
    (_no_reset, "count back to 0 at every miss"),
    (_ignores_the_group, "you looked up group 0's blocks"),
    (_hard_codes_group_1, "with the kv_cache_group_id you are given"),
    (_empty_without_a_full_run, "a shorter run that starts at block 0 is still a hit"),
    (_partial_run_anywhere, "only when it starts at block 0"),
    (_ignores_max_num_blocks, "look at positions 0 .. max_num_blocks - 1 only"),
    (_touches_the_hits, "a lookup only looks"),
    (_takes_a_reference, "a lookup only looks"),
    (_returns_block_ids, "not block ids or hashes"),
    (_returns_hashes, "not block ids or hashes"),
    (_none_for_null, "put block_pool.null_block there, not None"),
    (_a_new_null_block, "not a new KVCacheBlock(-1)"),
    (_a_new_block_0_as_null, "the positions before the run hold the pool's own null block, block_pool.null_block"),
    (_no_reset_with_a_counter, "the run's count was not set back to 0 at that miss"),
    (_never_looks_at_block_0, "your search never looks at block 0"),
    (_one_position_short, "you searched the first max_num_blocks - 1 positions only"),
    (_reverses_the_hashes, "changed the block_hashes list"),
    (_whole_run, "you kept every cached block of the run"),
    (_keeps_the_trailing_nulls, "a null block after a cached one"),
    (_scans_the_pool, "grows with the size of the pool"),
    (_keeps_state, "very list object an earlier call returned"),
    (_reversed_copy_off_by_one, "an index off by one"),
    (_run_in_reverse, "the run's blocks are in reverse order"),
    (_the_whole_table_without_a_run, "null blocks and no cached one"),
]


@pytest.mark.parametrize("wrong, fragment", MISTAKES, ids=lambda value: getattr(value, "__name__", "")[:40])
def test_ch08b_find_sliding_window_cache_hit_rejects_typical_mistakes(wrong, fragment):
    rejects(check_find_sliding_window_cache_hit, wrong, fragment)


def test_ch08b_find_sliding_window_cache_hit_names_the_input_and_the_answers():
    message = rejects(check_find_sliding_window_cache_hit, _left_to_right, "full attention's rule")
    assert "a run of 4 cached blocks, 2 needed" in message  # the case
    assert "max_num_blocks=7, num_contiguous_blocks=2, kv_cache_group_id=1" in message  # the call
    assert "expected: '[null × 5, 15, 16]'" in message and "got:      '[]'" in message


def test_ch08b_the_mistakes_are_told_apart():
    """Each mistake gets its own hint, not another mistake's (a catalogue that tests one mistake many times fails)."""
    hints = {}
    for wrong, _ in MISTAKES:
        with pytest.raises(CheckFailure) as info:
            check_find_sliding_window_cache_hit(wrong)
        hints[wrong.__name__] = str(info.value).split("hint: ", 1)[-1]
    assert len(set(hints.values())) >= len(MISTAKES) - 4, hints  # the off-by-ones, the lookups that touch, share one


def test_ch08b_find_sliding_window_cache_hit_lets_the_stub_error_through():
    def stub(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
        raise NotImplementedError("your code here")

    with pytest.raises(NotImplementedError):
        check_find_sliding_window_cache_hit(stub)


def test_ch08b_an_exception_in_the_learners_code_names_the_call():
    def starts_one_too_far(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
        run = []
        for i in range(max_num_blocks, -1, -1):  # meant max_num_blocks - 1
            block = block_pool.get_cached_block(block_hashes[i], kv_cache_group_id)
            run = [block] + run if block is not None else []
            if len(run) == num_contiguous_blocks:
                return [block_pool.null_block] * i + run
        return run

    message = rejects(check_find_sliding_window_cache_hit, starts_one_too_far, "raised IndexError")
    assert "nothing cached for the sliding window" in message and "max_num_blocks=8" in message
    assert "starts_one_too_far" in message  # the traceback starts at the learner's line


# -- a passing check keeps the part; the learner's engine hands it to the sliding-window group --------------
LEARNER_NOTEBOOK = """
from mini_vllm.course import check_find_sliding_window_cache_hit


def find_sliding_window_cache_hit(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
    hit = [block_pool.null_block] * max_num_blocks
    run = 0
    for i in range(max_num_blocks - 1, -1, -1):
        block = block_pool.get_cached_block(block_hashes[i], kv_cache_group_id)
        if block is None:
            run = 0
            continue
        hit[i] = block
        run += 1
        if run == num_contiguous_blocks:
            return hit[: i + run]
    return hit[:run]


check_find_sliding_window_cache_hit(find_sliding_window_cache_hit)
"""


def test_ch08b_a_passing_lookup_is_kept_and_becomes_the_engines_part(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(parts_module.PARTS_ENV, str(tmp_path / "parts"))
    script = tmp_path / "learner_notebook.py"
    script.write_text(textwrap.dedent(LEARNER_NOTEBOOK))
    runpy.run_path(str(script), run_name="__main__")
    assert "kept as your part 'find_sliding_window_cache_hit'" in capsys.readouterr().out
    assert kept_parts() == ["find_sliding_window_cache_hit"]
    kept = parts_module.load_part("find_sliding_window_cache_hit")
    parts = use_parts({"find_sliding_window_cache_hit": kept})
    assert parts.find_sliding_window_cache_hit is kept and parts.replaced() == ["find_sliding_window_cache_hit"]
    check_find_sliding_window_cache_hit(kept)  # loaded from its file, it passes again


def _stops_at_the_first_miss_from_the_right(block_pool, block_hashes, max_num_blocks, n, group):
    """A learner pass: stateless, but told "it keeps state between calls" (its [] matched an earlier right [])."""
    get = lambda h: block_pool.get_cached_block(h, group)  # noqa: E731 - a learner's style
    run = 0
    for i in range(max_num_blocks - 1, -1, -1):
        if get(block_hashes[i]) is None:
            break
        run += 1
        if run == n:
            return [block_pool.null_block] * i + [get(block_hashes[j]) for j in range(i, i + run)]
    return [get(block_hashes[j]) for j in range(run)] if run == max_num_blocks else []


_MEMO: dict = {}


def _memoizes_each_lookup(block_pool, block_hashes, max_num_blocks, n, group):
    """A learner pass: a right search over a module-level memo of lookups, told "you walked from block 0"."""
    get = lambda h: _MEMO.setdefault((h, group), block_pool.get_cached_block(h, group))  # noqa: E731
    run = 0
    for i in range(max_num_blocks - 1, -1, -1):
        run = run + 1 if get(block_hashes[i]) is not None else 0
        if run == n:
            return [block_pool.null_block] * i + [get(block_hashes[j]) for j in range(i, i + run)]
    return [get(block_hashes[j]) for j in range(run)]


def test_ch08b_state_between_calls_is_told_only_when_an_empty_pool_finds_blocks():
    message = rejects(check_find_sliding_window_cache_hit, _stops_at_the_first_miss_from_the_right, "expected")
    assert "keeps state" not in message, message
    _MEMO.clear()
    message = rejects(check_find_sliding_window_cache_hit, _memoizes_each_lookup, "it keeps state between calls")
    assert "walked from block 0" not in message


def test_ch08b_one_null_too_many_is_named():
    """A learner pass: [null] * (i + 1) was told to start the search at max_num_blocks - 1 (it did)."""

    def one_null_too_many(block_pool, block_hashes, max_num_blocks, n, group):
        hit = find_sliding_window_cache_hit(block_pool, block_hashes, max_num_blocks, n, group)
        return [block_pool.null_block] + hit if hit and hit[0] is block_pool.null_block else hit

    message = rejects(check_find_sliding_window_cache_hit, one_null_too_many, "one null too many")
    assert "max_num_blocks - 1" not in message


def _block_ids_as_truth_values(block_pool, block_hashes, max_num_blocks, n, group):
    """A learner pass: the search over block ids, a miss tested with `not block_id` (block 0 looks missing). It
    passed: no case cached a sliding-window block in pool block 0."""
    found = [block_pool.get_cached_block(h, group) for h in block_hashes[:max_num_blocks]]
    ids = [None if block is None else block.block_id for block in found]
    run = 0
    for i in range(len(ids) - 1, -1, -1):
        run = run + 1 if ids[i] else 0
        if run == n:
            return [block_pool.null_block] * i + found[i : i + n]
    return found[:run]


def _nothing_when_no_window_fits(block_pool, block_hashes, max_num_blocks, n, group):
    """A learner pass: an early return when the cap leaves no room for a window; only a random case caught it,
    with the general recipe for a hint."""
    if max_num_blocks < n:
        return []
    return learner_lookup(block_pool, block_hashes, max_num_blocks, n, group)


@pytest.mark.parametrize(
    "wrong, fragment",
    [
        (_block_ids_as_truth_values, "pool block 0 is a block like any other"),
        (_nothing_when_no_window_fits, "do not return [] early"),
    ],
    ids=["block ids as truth values", "nothing when no window fits"],
)
def test_ch08b_a_fixed_case_names_each_mistake(wrong, fragment):
    message = rejects(check_find_sliding_window_cache_hit, wrong, fragment)
    assert "random" not in message.split("hint:")[0], message  # a fixed case, built for it
