"""Checks for chapter 03: ``compute_slot_mapping(block_ids, start, end, block_size)``.

Token position ``p`` of a sequence lives in logical block ``p // block_size``
at offset ``p % block_size``; the block table maps the logical block to a
physical one, so its slot is ``block_ids[p // block_size] * block_size + p %
block_size``. The function returns the slots of positions ``start .. end-1``
(a prefill chunk, a prefill after a cache hit, or one decode token).

The check recognises the usual mistakes by comparing the learner's answer
with what each mistake would produce, then compares exactly with the
reference on fixed and random cases.
"""

from __future__ import annotations

from collections.abc import Callable

from ..model_runner import compute_slot_mapping as reference_slot_mapping
from ._harness import Checker, describe_type, guarded_check, snapshot


# What each typical mistake computes, with the hint that names it.
def _logical_blocks(block_ids, start, end, block_size):
    return [(p // block_size) * block_size + p % block_size for p in range(start, end)]


def _offset_from_start(block_ids, start, end, block_size):
    return [block_ids[p // block_size] * block_size + (p - start) % block_size for p in range(start, end)]


def _block_from_start(block_ids, start, end, block_size):
    return [block_ids[(p - start) // block_size] * block_size + p % block_size for p in range(start, end)]


def _chunk_relative(block_ids, start, end, block_size):
    return [block_ids[(p - start) // block_size] * block_size + (p - start) % block_size for p in range(start, end)]


def _no_multiply(block_ids, start, end, block_size):
    return [block_ids[p // block_size] + p % block_size for p in range(start, end)]


def _divide_the_slot(block_ids, start, end, block_size):
    # The table indexed with a slot-like number instead of the logical block.
    return [block_ids[min(p // block_size, len(block_ids) - 1)] * block_size + p for p in range(start, end)]


def _bit_tricks(block_ids, start, end, block_size):
    # p >> log2(block_size) and p & (block_size - 1): right only for powers of two.
    shift = block_size.bit_length() - 1
    return [block_ids[p >> shift] * block_size + (p & (block_size - 1)) for p in range(start, end)]


def _first_block_for_all(block_ids, start, end, block_size):
    # The block of `start` looked up once, used for every position of the chunk.
    return [block_ids[start // block_size] * block_size + p % block_size for p in range(start, end)]


def _sixteen(block_ids, start, end, block_size):
    return [block_ids[p // 16] * 16 + p % 16 for p in range(start, end)]


def _one_later(block_ids, start, end, block_size):
    return reference_slot_mapping(block_ids, start + 1, end + 1, block_size)


def _one_earlier(block_ids, start, end, block_size):
    return [block_ids[(p - 1) // block_size] * block_size + (p - 1) % block_size for p in range(start, end)]


def _inclusive_end(block_ids, start, end, block_size):
    return reference_slot_mapping(block_ids, start, min(end + 1, len(block_ids) * block_size), block_size)


_MISTAKES = [
    (
        _logical_blocks,
        "you used the LOGICAL block index (p // block_size) as if it were the physical block: "
        "look it up in the block table, block_ids[p // block_size]",
    ),
    (
        _offset_from_start,
        "the offset inside a block is p % block_size, counted from the start of the BLOCK, not from "
        "`start` (the chunk's first position): they differ when start is not a multiple of block_size",
    ),
    (
        _block_from_start,
        "the logical block is p // block_size with p the position in the SEQUENCE; you counted "
        "from `start`, so every chunk after the first reads the wrong entry of the block table",
    ),
    (
        _chunk_relative,
        "positions are counted from the start of the sequence (0), not from `start`: a chunk's "
        "tokens keep their sequence positions (p // block_size, p % block_size with p in range(start, end))",
    ),
    (
        _no_multiply,
        "a slot is block_id * block_size + offset: multiply the physical block id by block_size",
    ),
    (
        _divide_the_slot,
        "take the physical block from the block table (block_ids[p // block_size]) and add only the "
        "offset p % block_size, not the whole position",
    ),
    (
        _bit_tricks,
        "shifts and masks (p >> 4, p & (block_size - 1)) compute p // block_size and p % block_size only "
        "when block_size is a power of two; the engine accepts any block size: use // and %",
    ),
    (
        _first_block_for_all,
        "you looked up the block of `start` once and used it for every position: a chunk can cross into "
        "the next block, so look up block_ids[p // block_size] for each position p",
    ),
    (
        _sixteen,
        "you wrote 16 where block_size belongs: the engine (and this check) use other block sizes too; "
        "use the block_size argument in both the division and the remainder",
    ),
    (
        _one_later,
        "each of your slots is the slot of the NEXT position (p + 1): the slots are those of positions "
        "start, start+1, ..., end-1 exactly",
    ),
    (
        _one_earlier,
        "each of your slots is the slot of the PREVIOUS position (p - 1): positions count from 0, so "
        "position p itself goes in block p // block_size at offset p % block_size",
    ),
    (
        _inclusive_end,
        "`end` is exclusive: the slots of positions start, start+1, ..., end-1 (range(start, end))",
    ),
]


def _diagnose(got, block_ids, start, end, block_size) -> str:
    """The hint of the first typical mistake that reproduces ``got`` (or a generic one)."""
    for mistake, hint in _MISTAKES:
        try:
            if got == mistake(block_ids, start, end, block_size):
                return hint
        except IndexError:
            continue
    if isinstance(got, list) and len(got) != end - start:
        return f"return one slot per position in range(start, end): {end - start} slots"
    return "slot = block_ids[p // block_size] * block_size + p % block_size, for p in range(start, end)"


def _run(check: Checker, compute_slot_mapping: Callable, args: tuple, case: str, random_case: bool = False) -> None:
    block_ids, start, end, block_size = args
    given = list(block_ids)
    before = snapshot(given)
    got = check.call(
        compute_slot_mapping,
        given,
        start,
        end,
        block_size,
        what=f"{case}: compute_slot_mapping{args}",
        expected=f"{end - start} slots, one per position in range({start}, {end})",
    )
    if start == end and not isinstance(got, (list, tuple)):
        check.fail(
            f"{case}: compute_slot_mapping{args} returned {describe_type(got)}, not a list",
            "an empty range has no positions, so it has no slots: return an empty list [] "
            "(range(start, end) is empty and the loop adds nothing)",
        )
    got = check.expect_list(got, f"{case}: compute_slot_mapping{args}", int, "int slot numbers", random_case)
    check.expect_unchanged(
        before,
        given,
        f"{case}: compute_slot_mapping{args}",
        "block table (block_ids)",
        "the block table belongs to the request (the scheduler reuses it next step): read it, never "
        "append to it, pop from it or sort it",
    )
    expected = reference_slot_mapping(*args)
    hint = "" if got == expected else _diagnose(got, *args)
    check.expect_equal(got, expected, f"{case}: compute_slot_mapping{args}", hint, random_case)


@guarded_check(part="slot_mapping")
def check_slot_mapping(compute_slot_mapping: Callable) -> None:
    """The learner's ``compute_slot_mapping(block_ids, start, end, block_size) -> list[int]``."""
    check = Checker("compute_slot_mapping")
    cases = [
        ("a prefill of 10 tokens in block 7", ([7], 0, 10, 16)),
        ("a prefill of 40 tokens over a scattered table [7, 2, 9]", ([7, 2, 9], 0, 40, 16)),
        ("one decode token at position 37", ([7, 2, 9], 37, 38, 16)),
        ("a decode token that opens a new block (position 32)", ([7, 2, 9], 32, 33, 16)),
        ("a prefill after a 2-block cache hit (positions 32..49)", ([4, 0, 6, 3], 32, 50, 16)),
        ("a chunk that starts mid-block (positions 20..45)", ([5, 1, 8, 3], 20, 45, 16)),
        ("a second chunk, block_size 4 (positions 6..13)", ([9, 3, 0, 7, 5], 6, 14, 4)),
        ("an identity table [0, 1, 2] with a chunk at 5..11, block_size 4", ([0, 1, 2], 5, 11, 4)),
        ("block_size 6 (not a power of two), positions 4..17", ([3, 0, 8], 4, 18, 6)),
        ("block_size 12 (not a power of two), a decode token at 25", ([2, 7, 1], 25, 26, 12)),
        ("an empty range (start == end == 16): no positions", ([7, 2], 16, 16, 16)),
    ]
    for case, args in cases:
        _run(check, compute_slot_mapping, args, case)

    for _ in range(200):
        block_size = check.rng.choice([1, 2, 3, 4, 5, 12, 16])
        num_blocks = check.rng.randint(1, 6)
        block_ids = check.rng.sample(range(64), num_blocks)
        capacity = num_blocks * block_size
        start = check.rng.randrange(capacity)
        end = check.rng.randint(start + 1, capacity)
        _run(check, compute_slot_mapping, (block_ids, start, end, block_size), "random case", random_case=True)
    check.passed()
