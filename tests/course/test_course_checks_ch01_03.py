"""The checks of chapters 01-03 accept a correct answer and reject the typical mistakes.

Each wrong implementation below is a mistake a learner makes; its check must
raise AssertionError with a message that names the mistake."""

from __future__ import annotations

import pytest
import torch
from course_fixtures import make_decode, rejects

from mini_vllm.block_pool import FreeKVCacheBlockQueue
from mini_vllm.course import check_decode_loop, check_free_queue, check_slot_mapping
from mini_vllm.course.one_sequence import contiguous_kv_cache, run_model
from mini_vllm.model_runner import compute_slot_mapping

# --------------------------------------------------------------------------- #
# Chapter 01: the decode loop
# --------------------------------------------------------------------------- #


def test_ch01_decode_loop_accepts_a_correct_loop(default_model, capsys):
    check_decode_loop(make_decode(), default_model)
    assert "✓ greedy_decode" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        # positions that never advance: every decode token at the first new position
        (make_decode(position=lambda prompt, tokens: len(prompt)), "positions advance"),
        # decoding without a cache: the whole sequence again every step
        (make_decode(feed_all=True), "WITHOUT a cache"),
        # seq_len that forgets the token just fed
        (make_decode(seq_len_shift=-1), "seq_len counts every token"),
        # not appending: the last prompt token is fed again and again
        (make_decode(feed_token=lambda prompt, tokens: prompt[-1]), "feed the token you generated"),
        # a new (empty) cache every step
        (make_decode(fresh_cache=True), "create the cache once"),
        # a cache with no room for the new tokens (found by a learner: the hint was about loop bounds)
        (make_decode(cache_for_prompt_only=True), r"size it for len\(prompt\) \+ max_new_tokens"),
    ],
    ids=["positions", "refeed", "seq_len", "append", "fresh-cache", "cache-too-small"],
)
def test_ch01_decode_loop_rejects_typical_mistakes(default_model, wrong, expected_message):
    rejects(check_decode_loop, wrong, expected_message, default_model, regex=True)


def test_ch01_decode_loop_rejects_an_extra_token(default_model):
    def one_too_many(model, prompt_ids, max_new_tokens):
        return make_decode()(model, prompt_ids, max_new_tokens + 1)

    rejects(check_decode_loop, one_too_many, "exactly max_new_tokens", default_model, regex=True)


def _never_appends(model, prompt_ids, max_new_tokens):
    """Found by a learner pass: a loop whose `while` measures a list it never appends to (it hung the check)."""
    kv_caches = contiguous_kv_cache(model.config, len(prompt_ids) + max_new_tokens)
    tokens = list(prompt_ids)
    logits = run_model(model, kv_caches, tokens, list(range(len(tokens))), seq_len=len(tokens))
    out = [int(logits.argmax())]
    while len(out) < max_new_tokens:
        logits = run_model(model, kv_caches, [out[-1]], [len(tokens)], seq_len=len(tokens) + 1)
        _next_token = int(logits.argmax())  # never appended
    return out


def test_ch01_decode_loop_that_never_appends_is_stopped(default_model):
    rejects(
        check_decode_loop,
        _never_appends,
        r"a loop that never ends\n.*hint: .*append each new token",
        default_model,
        regex=True,
    )


def test_ch01_engine_cell_stops_a_loop_that_never_ends(default_model):
    """Exercise 01's engine cell runs the learner's loop outside the check: it must not hang either."""
    from mini_vllm.course._harness import CheckFailure
    from mini_vllm.course.kv_cache_checks import with_a_forward_limit

    with pytest.raises(CheckFailure, match=r"called model\(...\) 18 times for max_new_tokens=5 .* never ends"):
        _never_appends(with_a_forward_limit(default_model, 5), [1, 2, 3], 5)
    assert len(make_decode()(with_a_forward_limit(default_model, 5), [1, 2, 3], 5)) == 5


def test_ch01_decode_loop_names_the_item_that_is_not_an_int(default_model):
    def tensors(model, prompt_ids, max_new_tokens):
        return [torch.tensor(t) for t in make_decode()(model, prompt_ids, max_new_tokens)]

    rejects(
        check_decode_loop,
        tensors,
        r"list of 6 whose item 0 is a Tensor \(6 of the 6 are not ints\)",
        default_model,
        regex=True,
    )


# --------------------------------------------------------------------------- #
# Chapter 02: the free-block queue
# --------------------------------------------------------------------------- #


class LearnerQueue:
    """A correct queue written independently of the reference (sentinels, links in the blocks)."""

    def __init__(self, blocks):
        from mini_vllm.block_pool import KVCacheBlock

        self.head, self.tail = KVCacheBlock(-1), KVCacheBlock(-1)
        self.head.next_free_block, self.tail.prev_free_block = self.tail, self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def _link_after(self, left, block):
        right = left.next_free_block
        left.next_free_block, block.prev_free_block = block, left
        block.next_free_block, right.prev_free_block = right, block
        self.num_free_blocks += 1

    def popleft(self):
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        block = self.head.next_free_block
        self.remove(block)
        return block

    def remove(self, block):
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block):
        self._link_after(self.tail.prev_free_block, block)

    def appendleft(self, block):
        self._link_after(self.head, block)

    def get_all_free_blocks(self):
        blocks, block = [], self.head.next_free_block
        while block is not self.tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class AppendForgetsTheTailsBackLink(LearnerQueue):
    """A learner pass: passed every fixed case (__init__ links its blocks itself), failed a random trial, no hint."""

    def __init__(self, blocks):
        super().__init__([])
        for block in blocks:
            self._link_after(self.tail.prev_free_block, block)

    def append(self, block):
        left = self.tail.prev_free_block
        left.next_free_block, block.prev_free_block, block.next_free_block = block, left, self.tail
        self.num_free_blocks += 1  # self.tail.prev_free_block = block is missing


class PopsTheTail(LearnerQueue):
    def popleft(self):
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        block = self.tail.prev_free_block
        self.remove(block)
        return block


class ForgetsTheNextNeighbour(LearnerQueue):
    def remove(self, block):
        block.prev_free_block.next_free_block = block.next_free_block  # next.prev is never fixed
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1


class ForgetsTheCount(LearnerQueue):
    def remove(self, block):
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None  # num_free_blocks stays


class AppendleftAtTheTail(LearnerQueue):
    def appendleft(self, block):
        self.append(block)


class NoValueErrorWhenEmpty(LearnerQueue):
    def popleft(self):
        block = self.head.next_free_block
        if block is self.tail:
            return None
        self.remove(block)
        return block


class KeepsStaleLinks(LearnerQueue):
    def remove(self, block):
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        self.num_free_blocks -= 1


class SentinelsInTheGivenList(LearnerQueue):
    """Links the blocks by putting its sentinels at both ends of the caller's list, then pairing neighbours."""

    def __init__(self, blocks):
        from mini_vllm.block_pool import KVCacheBlock

        self.head, self.tail = KVCacheBlock(-1), KVCacheBlock(-1)
        blocks.insert(0, self.head)  # the pool's own list: block i is no longer at index i
        blocks.append(self.tail)
        for left, right in zip(blocks, blocks[1:]):
            left.next_free_block, right.prev_free_block = right, left
        self.num_free_blocks = len(blocks) - 2


class PopsTheGivenList(LearnerQueue):
    def __init__(self, blocks):
        super().__init__([])
        while blocks:
            self.append(blocks.pop(0))  # empties the pool's own list


class RemovesFromTheGivenListLater(LearnerQueue):
    """Keeps the caller's list as "the free blocks" and removes from it as blocks leave the queue."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self.free = blocks

    def remove(self, block):
        super().remove(block)
        self.free.remove(block)


class KeepsTheGivenListToReadIt(LearnerQueue):
    """Correct: keeping the list is fine as long as it is only read."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self.all_blocks = blocks

    def get_all_free_blocks(self):
        assert len(self.all_blocks) >= self.num_free_blocks
        return super().get_all_free_blocks()


@pytest.mark.parametrize(
    "queue_cls",
    [FreeKVCacheBlockQueue, LearnerQueue, KeepsTheGivenListToReadIt],
    ids=["reference", "learner", "keeps the list to read it"],
)
def test_ch02_free_queue_accepts_correct_queues(queue_cls, capsys):
    check_free_queue(queue_cls)
    assert "✓ FreeKVCacheBlockQueue" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (PopsTheTail, "popleft took the TAIL"),
        (ForgetsTheNextNeighbour, "BOTH sides"),
        (ForgetsTheCount, "num_free_blocks"),
        (AppendleftAtTheTail, "appendleft put block . at the TAIL"),
        (NoValueErrorWhenEmpty, "must raise ValueError"),
        (KeepsStaleLinks, "clear the block's prev_free_block"),
    ],
)
def test_ch02_free_queue_rejects_typical_mistakes(wrong, expected_message):
    rejects(check_free_queue, wrong, expected_message, regex=True)


@pytest.mark.parametrize(
    "wrong, named",
    [
        (SentinelsInTheGivenList, "popleft order: after init: your queue changed the list of blocks"),
        (PopsTheGivenList, "popleft order: after init: your queue changed the list of blocks"),
        (RemovesFromTheGivenListLater, "popleft order: after init -> popleft(): your queue changed the list"),
    ],
    ids=["sentinels inserted", "popped in __init__", "removed from later"],
)
def test_ch02_free_queue_a_changed_list_of_blocks_is_named(wrong, named):
    """The caller's list must stay as given, after __init__ and after every operation.

    Without that test these ended in an AttributeError deep in remove (the sentinel handed back as block 0)
    or in an IndexError inside the check itself.
    """
    message = rejects(check_free_queue, wrong, "must never change the list of blocks __init__ is given")
    assert named in message
    assert "before: [0, 1, 2, 3, 4]" in message  # what the list held, and what it holds now
    assert "AttributeError" not in message and "IndexError" not in message


# --------------------------------------------------------------------------- #
# Chapter 03: slot mapping
# --------------------------------------------------------------------------- #


def test_ch03_slot_mapping_accepts_the_reference(capsys):
    check_slot_mapping(compute_slot_mapping)
    assert "✓ compute_slot_mapping" in capsys.readouterr().out


def _logical_index(block_ids, start, end, block_size):
    return [(p // block_size) * block_size + p % block_size for p in range(start, end)]


def _offset_from_chunk_start(block_ids, start, end, block_size):
    return [block_ids[p // block_size] * block_size + (p - start) % block_size for p in range(start, end)]


def _slot_without_multiplying(block_ids, start, end, block_size):
    return [block_ids[p // block_size] + p % block_size for p in range(start, end)]


def _inclusive_end(block_ids, start, end, block_size):
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end + 1)]


def _chunk_positions_from_zero(block_ids, start, end, block_size):
    return [block_ids[i // block_size] * block_size + i % block_size for i in range(end - start)]


def _adds_the_whole_position(block_ids, start, end, block_size):
    return [block_ids[p // block_size] * block_size + p for p in range(start, end)]


def _block_of_start_for_every_position(block_ids, start, end, block_size):
    block = block_ids[start // block_size]
    return [block * block_size + p % block_size for p in range(start, end)]


def _sixteen_written_in(block_ids, start, end, block_size):
    return [block_ids[p // 16] * 16 + p % 16 for p in range(start, end)]


def _next_position(block_ids, start, end, block_size):
    return [block_ids[(p + 1) // block_size] * block_size + (p + 1) % block_size for p in range(start, end)]


def _previous_position(block_ids, start, end, block_size):
    return [block_ids[(p - 1) // block_size] * block_size + (p - 1) % block_size for p in range(start, end)]


@pytest.mark.parametrize(
    "wrong,expected_message",
    [
        (_block_of_start_for_every_position, "looked up the block of `start` once"),
        (_sixteen_written_in, "you wrote 16 where block_size belongs"),
        (_next_position, "slot of the NEXT position"),
        (_previous_position, "slot of the PREVIOUS position"),
        (_logical_index, "LOGICAL block index"),
        (_offset_from_chunk_start, "start of the BLOCK"),
        (_slot_without_multiplying, "multiply the physical block id"),
        (_inclusive_end, "exclusive"),
        (_chunk_positions_from_zero, "counted from the start of the sequence"),
        (_adds_the_whole_position, "not the whole position"),
    ],
)
def test_ch03_slot_mapping_rejects_typical_mistakes(wrong, expected_message):
    rejects(check_slot_mapping, wrong, expected_message, regex=True)


def test_ch03_slot_mapping_an_empty_range_is_an_empty_list():
    """Found by a learner pass: `if start == end: return None` passed (no case had start == end)."""

    def none_when_empty(block_ids, start, end, block_size):
        if start == end:
            return None
        return compute_slot_mapping(block_ids, start, end, block_size)

    rejects(
        check_slot_mapping,
        none_when_empty,
        r"start == end == 16.* returned None, not a list\n.*return an empty list",
        regex=True,
    )


def test_ch02_free_queue_an_append_that_forgets_the_tails_back_link_is_named():
    message = rejects(check_free_queue, AppendForgetsTheTailsBackLink, "the tail's back link")
    assert "two appends in a row" in message


class ListingSkipsTheLastBlock(LearnerQueue):
    """Links right; get_all_free_blocks stops one block early (it was blamed on __init__)."""

    def get_all_free_blocks(self):
        return super().get_all_free_blocks()[:-1]


class ListingIncludesAStaleBlock(LearnerQueue):
    """Links right; get_all_free_blocks walks from the head sentinel and keeps it."""

    def get_all_free_blocks(self):
        return [self.head.next_free_block, *super().get_all_free_blocks()]


class CountsEveryBlockTwice(LearnerQueue):
    def __init__(self, blocks):
        super().__init__(blocks)
        self.num_free_blocks += len(blocks)  # len(blocks) plus one per append


class KeepsAPythonList:
    """The free blocks in a list on the queue: no block ever has a neighbour."""

    def __init__(self, blocks):
        self.free = list(blocks)
        self.num_free_blocks = len(self.free)

    def popleft(self):
        if not self.free:
            raise ValueError("No free blocks available")
        self.num_free_blocks -= 1
        return self.free.pop(0)

    def remove(self, block):
        self.free.remove(block)
        self.num_free_blocks -= 1

    def append(self, block):
        self.free.append(block)
        self.num_free_blocks += 1

    def appendleft(self, block):
        self.free.insert(0, block)
        self.num_free_blocks += 1

    def get_all_free_blocks(self):
        return list(self.free)


class SentinelsOnTheClass(LearnerQueue):
    """A learner pass: every queue shares the class's sentinels; it was told get_all_free_blocks was wrong."""

    from mini_vllm.block_pool import KVCacheBlock

    head, tail = KVCacheBlock(-1), KVCacheBlock(-1)

    def __init__(self, blocks):
        self.num_free_blocks = 0
        if self.head.next_free_block is None:
            self.head.next_free_block, self.tail.prev_free_block = self.tail, self.head
        for block in blocks:
            self.append(block)


class AppendleftLinksOneSide(LearnerQueue):
    def appendleft(self, block):
        first = self.head.next_free_block
        self.head.next_free_block, block.prev_free_block, block.next_free_block = block, self.head, first
        self.num_free_blocks += 1  # first.prev_free_block = block is missing


@pytest.mark.parametrize(
    "wrong, named, not_named",
    [
        (ListingSkipsTheLastBlock, "the mistake is in get_all_free_blocks()", "starts with every block given"),
        (ListingIncludesAStaleBlock, "the mistake is in get_all_free_blocks()", "starts with every block given"),
        (CountsEveryBlockTwice, "counts every block twice", "must change in every operation"),
        (KeepsAPythonList, "the links live in the blocks themselves", "BOTH sides"),
        (SentinelsOnTheClass, "state shared between queues", "the mistake is in get_all_free_blocks()"),
        (AppendleftLinksOneSide, "appendleft(b) links b between the head and the first block", "remove(b)"),
    ],
    ids=[
        "listing one short",
        "listing a block twice",
        "count doubled in __init__",
        "a Python list",
        "sentinels on the class",
        "appendleft one side",
    ],
)
def test_ch02_free_queue_blames_the_method_that_is_wrong(wrong, named, not_named):
    """Learner passes: these were blamed on __init__ (or, sharing state between queues, on
    get_all_free_blocks), got the generic count hint, or were told about remove's links when the queue
    keeps no links at all or appendleft broke them."""
    message = rejects(check_free_queue, wrong, named, regex=False)
    assert not_named not in message, message


class CountsOnlyWhenListed(LearnerQueue):
    """Issue 41: the count is brought up to date only inside get_all_free_blocks (it passed: the old check listed
    the queue before it read the count)."""

    def _link_after(self, left, block):
        right = left.next_free_block
        left.next_free_block, block.prev_free_block = block, left
        block.next_free_block, right.prev_free_block = right, block

    def remove(self, block):
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None

    def popleft(self):
        if self.head.next_free_block is self.tail:
            raise ValueError("No free blocks available")
        block = self.head.next_free_block
        self.remove(block)
        return block

    def get_all_free_blocks(self):
        blocks = super().get_all_free_blocks()
        self.num_free_blocks = len(blocks)
        return blocks


class CountsInInitThenOnlyWhenListed(CountsOnlyWhenListed):
    """The same, with a count that __init__ sets right: it goes stale at the first operation."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self.num_free_blocks = len(blocks)


@pytest.mark.parametrize(
    "wrong, where",
    [(CountsOnlyWhenListed, "after init: num_free_blocks"), (CountsInInitThenOnlyWhenListed, "popleft(): num_free")],
    ids=["from the start", "after the first operation"],
)
def test_ch02_free_queue_a_count_kept_up_to_date_only_by_the_listing_is_named(wrong, where):
    message = rejects(check_free_queue, wrong, "brings the count up to date only when it walks the list")
    assert where in message and "before get_all_free_blocks()" in message, message
