"""Checks for chapter 02: the learner's ``FreeKVCacheBlockQueue``.

The queue is a doubly linked list threaded through the blocks themselves
(``prev_free_block`` / ``next_free_block``). The check first runs short fixed
scenarios, each aimed at one typical mistake, and after every operation
verifies ``num_free_blocks`` (read first: the pool reads it without listing
the queue), the order (head to tail) and that the links of
neighbouring blocks agree with each other. Two queues alive at once must not
interfere (state on the class, or in a mutable default, is shared), and every
operation on a queue of 20,000 blocks must read only a handful of links: the
blocks count their link reads and comparisons, so an O(n) walk or a search of
a Python list shows up (and is stopped early). The list of blocks given to
the constructor must stay as it was, after ``__init__`` and after every
operation (the pool keeps using it as ``BlockPool.blocks``). Then it drives
the learner's queue and the reference with the same random operations and
compares them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..block_pool import FreeKVCacheBlockQueue as ReferenceQueue
from ..block_pool import KVCacheBlock
from ._harness import CheckFailure, Checker, guarded_check, learner_error
from .fixtures import CountingBlock, TooManySteps, block_ids


GIVEN_LIST_HINT = (
    "the queue must never change the list of blocks __init__ is given, in __init__ or later: the pool keeps "
    "using it (BlockPool.blocks is that very list, block i at index i, for the pool's whole life). Read it "
    "(a for loop over it), link the blocks through prev_free_block/next_free_block and keep your sentinels "
    "(or head and tail) on self; never pop from it, insert sentinels into it, sort it, or remove blocks from it"
)


def _expect_given_list_unchanged(check: Checker, given: list, blocks: list, case: str) -> None:
    """``given`` (the list passed to the constructor) must still hold exactly ``blocks``, in order."""
    if len(given) == len(blocks) and all(a is b for a, b in zip(given, blocks)):
        return
    ids = [getattr(b, "block_id", b) for b in given]
    expected = [b.block_id for b in blocks]
    if len(expected) <= 12:
        change = f"\n    before: {expected}\n    after:  {ids}"
    else:
        first = next((i for i, (a, b) in enumerate(zip(given, blocks)) if a is not b), min(len(given), len(blocks)))
        change = (
            f" (it held {len(expected):,} blocks, now {len(ids):,}; first change at index {first}: "
            f"{ids[first : first + 3] if first < len(ids) else 'the end'} instead of {expected[first : first + 3]})"
        )
    check.fail(f"{case}: your queue changed the list of blocks the caller passed to __init__{change}", GIVEN_LIST_HINT)


class _Scenario:
    """A learner's queue over fresh blocks, plus what it should contain."""

    def __init__(self, check: Checker, queue_cls: Callable, num_blocks: int, name: str) -> None:
        self.check = check
        self.name = name
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.given = list(self.blocks)  # the caller's list (the pool's blocks): it must stay as it is
        self.queue = check.call(
            queue_cls,
            self.given,
            what=f"{name}: FreeKVCacheBlockQueue(blocks of ids 0..{num_blocks - 1})",
            expected="a queue holding every block given, head first",
        )
        self.expected = list(range(num_blocks))
        self.history = ["init"]
        self.verify("the queue starts with every block given, in that order (head first)")

    def where(self) -> str:
        return f"{self.name}: after {' -> '.join(self.history)}"

    def verify(self, hint: str) -> None:
        check = self.check
        _expect_given_list_unchanged(check, self.given, self.blocks, self.where())
        count = self.queue.num_free_blocks  # before the listing: the pool reads the count on its own
        free = self.free_list()
        got = block_ids(free)
        check.expect_equal(
            got, self.expected, f"{self.where()}: get_all_free_blocks() (head to tail)", self._named(free) or hint
        )
        count_hint = (
            "num_free_blocks must change in every operation: -1 in popleft and remove, +1 in append and appendleft"
        )
        if self.history == ["init"] and count == 2 * len(self.expected) > 0:
            count_hint = (
                "num_free_blocks counts every block twice: __init__ sets it to len(blocks) AND adds one per "
                "block (through append, or by hand); count them once"
            )
        count_hint = _stale_count_hint(count, self.queue.num_free_blocks, len(self.expected)) or count_hint
        check.expect_equal(count, len(self.expected), f"{self.where()}: num_free_blocks", count_hint)
        # The links must agree in both directions: the next operation follows them.
        links = ("prev_free_block", "next_free_block")
        check.expect(
            len(free) < 2 or any(getattr(block, link, None) is not None for block in free for link in links),
            f"{self.where()}: get_all_free_blocks() gives {block_ids(free)}, but no block in the queue has a "
            "neighbour: every prev_free_block and next_free_block is None",
            "the links live in the blocks themselves: the queue is threaded through each block's "
            "prev_free_block/next_free_block (set them in __init__ and in every operation), not kept in a Python "
            "list on the queue, whose remove and pop(0) cost O(n); the pool and vLLM's free queue need the links",
        )
        ends = [("first", free[0], "prev_free_block"), ("last", free[-1], "next_free_block")] if free else []
        for which, block, link in ends:
            neighbour = getattr(block, link, None)
            check.expect(
                not any(neighbour is other for other in self.blocks),
                f"{self.where()}: block {block.block_id} is the {which} in the queue, but its {link} is "
                f"{_name(neighbour)}, a block that is not in the queue",
                self._both_sides_hint(),
            )
        for left, right in zip(free, free[1:]):
            check.expect(
                left.next_free_block is right and right.prev_free_block is left,
                f"{self.where()}: blocks {left.block_id} and {right.block_id} are neighbours in the queue, but "
                f"block {left.block_id}.next_free_block is {_name(left.next_free_block)} and "
                f"block {right.block_id}.prev_free_block is {_name(right.prev_free_block)}",
                self._both_sides_hint(),
            )

    def _both_sides_hint(self) -> str:
        """The links the last operation must set on both sides of the block it moved."""
        operation = self.history[-1].split("(", 1)[0]
        links = {
            "init": "__init__ links every block both ways: b.prev = the block before it AND that block's next = b",
            "append": "append(b) links b between the last block and the tail: last.next = b, b.prev = last, "
            "b.next = tail AND tail.prev = b",
            "appendleft": "appendleft(b) links b between the head and the first block: head.next = b, b.prev = head, "
            "b.next = first AND first.prev = b",
        }.get(operation, "remove(b) (popleft too) sets b.prev.next = b.next AND b.next.prev = b.prev")
        return (
            f"every change must fix the links on BOTH sides; after {self.history[-1]}: {links} (forgetting one "
            "neighbour breaks a later operation)"
        )

    def _named(self, free: list) -> str:
        """A hint naming the mistake when ``free`` (what get_all_free_blocks returned) is what a known one
        gives ("" otherwise)."""
        got = block_ids(free)
        if got == self.expected:
            return ""
        pool_ids = {block.block_id for block in self.blocks}
        if len(got) > len(self.expected) and [i for i in got if i in pool_ids] == self.expected:
            return (
                f"the list holds {sorted(set(got) - pool_ids)}, which are no free blocks: leave the sentinels out "
                "(start at head.next_free_block and stop when you reach the tail)"
            )
        if len(self.history) >= 2 and all(step.startswith("append(") for step in self.history[-2:]):
            lost = self.expected[-2]
            if got == [i for i in self.expected if i != lost]:
                return (
                    f"block {lost}, appended just before, is gone from the queue: after append(b) the block "
                    "before the tail must be b (the tail's back link: fake_tail.prev_free_block = b), because the "
                    "next append links the new block after whatever that link names"
                )
        swapped = self.expected[1:2] + self.expected[:1] + self.expected[2:]
        if self.history[-1].startswith("appendleft") and len(got) > 1 and got == swapped:
            return (
                "appendleft put the block second, after the first free block: it goes first, between the head "
                "sentinel and the old first block"
            )
        ours = {id(block) for block in self.blocks}
        strangers = [b for b in free if id(b) not in ours and getattr(b, "block_id", None) != -1]
        if strangers:
            return (
                f"the list holds block objects this queue was never given (block {strangers[0].block_id} of an "
                "earlier queue): state shared between queues. Keep the sentinels and the count on self, set in "
                "__init__, not on the class (fake_head = ... in the class body is one object for every queue)"
            )
        if self._linked_in_expected_order():
            return (
                f"the blocks' own links are right (followed here, they give {self.expected}), so the mistake is "
                "in get_all_free_blocks(): start at the first free block (the head sentinel's next_free_block), "
                "collect each block and follow next_free_block until you reach the tail sentinel"
            )
        return ""

    def _linked_in_expected_order(self) -> bool:
        """The blocks' prev/next links, followed here, give the expected order (whatever get_all_free_blocks says)."""
        chain = [self.blocks[i] for i in self.expected]
        if len(chain) < 2:  # one block's links say nothing about the order
            return False
        pool = {id(block) for block in self.blocks}
        outer = (getattr(chain[0], "prev_free_block", None), getattr(chain[-1], "next_free_block", None))
        if any(id(neighbour) in pool for neighbour in outer):
            return False
        return all(
            getattr(left, "next_free_block", None) is right and getattr(right, "prev_free_block", None) is left
            for left, right in zip(chain, chain[1:])
        )

    def free_list(self) -> list:
        """``get_all_free_blocks()`` as a list of blocks, or a message saying what came back instead."""
        return self.check.expect_list(
            self.call("get_all_free_blocks"),
            f"{self.where()}: get_all_free_blocks()",
            KVCacheBlock,
            "KVCacheBlock",
            fresh=False,
        )

    def call(self, operation: str, *args):
        """Run one of the learner's methods; a crash becomes a message that says after what."""
        self.check.case = f"{self.where()}: {operation}()"
        try:
            return getattr(self.queue, operation)(*args)
        except (NotImplementedError, CheckFailure):
            raise
        except Exception as error:  # noqa: BLE001 - reported with the operations that led to it
            _expect_given_list_unchanged(self.check, self.given, self.blocks, f"{self.where()}: {operation}()")
            hint = ""
            if isinstance(error, AttributeError) and "NoneType" in str(error):
                hint = (
                    "follow the links by hand on a small queue; a link left pointing at None (or at a block "
                    "that has left the queue) is the usual cause"
                )
            raise learner_error(
                self.check.name,
                f"{self.where()}: {operation}()",
                error,
                expected="the operation to succeed on this queue",
                hint=hint,
            ) from None

    def popleft(self, hint: str) -> None:
        self.history.append("popleft()")
        block = self.call("popleft")
        head = self.expected.pop(0)
        got = getattr(block, "block_id", block)
        if got != head and self.expected and got == self.expected[-1]:
            hint = f"popleft took the TAIL (block {got}); it must take the head (block {head}), the block reused first"
        self.check.expect_equal(got, head, f"{self.where()}: the block popleft() returned", hint)
        self._expect_unlinked(block, "popleft")
        self.verify(hint)

    def remove(self, block_id: int, hint: str) -> None:
        self.history.append(f"remove({block_id})")
        self.call("remove", self.blocks[block_id])
        self.expected.remove(block_id)
        self._expect_unlinked(self.blocks[block_id], "remove")
        self.verify(hint)

    def append(self, block_id: int, hint: str) -> None:
        self.history.append(f"append({block_id})")
        self.call("append", self.blocks[block_id])
        self.expected.append(block_id)
        self.verify(hint)

    def appendleft(self, block_id: int, hint: str) -> None:
        self.history.append(f"appendleft({block_id})")
        self.call("appendleft", self.blocks[block_id])
        got = block_ids(self.free_list())
        if got and got[-1] == block_id and got[0] != block_id:
            hint = f"appendleft put block {block_id} at the TAIL; it must go to the head (reused first)"
        self.expected.insert(0, block_id)
        self.verify(hint)

    def _expect_unlinked(self, block: Any, operation: str) -> None:
        self.check.expect(
            getattr(block, "prev_free_block", None) is None and getattr(block, "next_free_block", None) is None,
            f"{self.where()}: the block that left the queue still has links "
            f"(prev_free_block={_name(getattr(block, 'prev_free_block', None))}, "
            f"next_free_block={_name(getattr(block, 'next_free_block', None))})",
            f"{operation} must clear the block's prev_free_block and next_free_block (set them to None): "
            "a block outside the queue has no neighbours",
        )


def _stale_count_hint(before_listing: int, after_listing: int, expected: int) -> str:
    """The hint for a count that is right only once ``get_all_free_blocks()`` has walked the list ("" otherwise)."""
    if before_listing == expected or after_listing != expected:
        return ""
    return (
        f"num_free_blocks was {before_listing} before get_all_free_blocks() and {after_listing} after it: your "
        "queue brings the count up to date only when it walks the list. The pool reads num_free_blocks on its "
        "own, between operations (does a request fit?), and never lists the queue to do so: keep it right at "
        "all times, -1 in popleft and remove, +1 in append and appendleft"
    )


def _name(block: Any) -> str:
    if block is None:
        return "None"
    block_id = getattr(block, "block_id", "?")
    return f"block {block_id}" if block_id != -1 else "a sentinel"


def _expect_value_error_on_empty(check: Checker, queue: Any, case: str) -> None:
    try:
        result = queue.popleft()
    except ValueError:
        check.expect(True, case)
        return
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the message names what was raised instead
        check.expect(
            False,
            f"{case}: popleft() raised {type(error).__name__}: {error}",
            "popleft on an empty queue must raise ValueError (the pool relies on it), not another exception",
        )
        return
    check.expect(
        False,
        f"{case}: popleft() returned {_name(result)} instead of raising",
        'popleft on an empty queue must raise ValueError("No free blocks available")',
    )


_LARGE = 20_000
_MAX_STEPS_PER_OPERATION = 40


def _check_constant_time(check: Checker, queue_cls: Callable) -> None:
    """On a queue of 20,000 blocks, each operation may touch only a few blocks (O(1))."""
    blocks = [CountingBlock(i) for i in range(_LARGE)]
    given = list(blocks)
    budget = 50 * _LARGE
    CountingBlock.reads, CountingBlock.budget = 0, budget
    try:
        queue = check.call(queue_cls, given, what=f"FreeKVCacheBlockQueue of {_LARGE:,} blocks")
    except TooManySteps:
        check.fail(
            f"building a queue of {_LARGE:,} blocks read more than {budget:,} block links or comparisons "
            "(stopped there): __init__ costs O(n^2), so one of the operations it uses is O(n)",
            "each append must be O(1): link the block after the current tail, and keep num_free_blocks as a "
            "counter (never count by walking the list or by len() of a list you build)",
        )
    finally:
        CountingBlock.budget = None
    _expect_given_list_unchanged(check, given, blocks, f"a queue of {_LARGE:,} blocks, just built")
    middle = blocks[_LARGE // 2]
    operations = [
        ("remove(a block in the middle)", lambda: queue.remove(middle)),
        ("append(that block)", lambda: queue.append(middle)),
        ("popleft()", lambda: queue.popleft()),
        ("appendleft(the popped block)", lambda: queue.appendleft(blocks[0])),
        ("remove(the block at the tail)", lambda: queue.remove(middle)),
        ("num_free_blocks", lambda: queue.num_free_blocks),
    ]
    for label, operation in operations:
        CountingBlock.reads, CountingBlock.budget = 0, 100 * _MAX_STEPS_PER_OPERATION
        try:
            check.call(operation, what=f"a queue of {_LARGE:,} blocks: {label}")
        except TooManySteps:
            pass  # reported below, with the count
        finally:
            CountingBlock.budget = None
        steps = CountingBlock.reads
        check.expect(
            steps <= _MAX_STEPS_PER_OPERATION,
            f"a queue of {_LARGE:,} blocks: {label} read {steps:,} block links or comparisons"
            f"{' (stopped there)' if steps > 100 * _MAX_STEPS_PER_OPERATION else ''}; "
            f"an O(1) operation needs a handful, whatever the queue's length",
            "the queue must not walk the list or search a Python list (list.remove, list.index, `in`, "
            "pop(0) on a list of blocks): relink the block's neighbours through prev_free_block/next_free_block, "
            "and keep num_free_blocks as a counter you update in every operation",
        )
    _expect_given_list_unchanged(check, given, blocks, f"a queue of {_LARGE:,} blocks, after its operations")


def _check_independent_queues(check: Checker, queue_cls: Callable) -> None:
    """Two live queues must not share state (class attributes, mutable defaults)."""
    first_blocks = [KVCacheBlock(i) for i in range(3)]
    second_blocks = [KVCacheBlock(10 + i) for i in range(2)]
    first = check.call(queue_cls, list(first_blocks), what="a first queue of blocks 0, 1, 2")
    second = check.call(
        queue_cls, list(second_blocks), what="a second queue of blocks 10, 11, while the first is alive"
    )
    check.call(second.popleft, what="popleft() on the second queue")
    counts = (first.num_free_blocks, second.num_free_blocks)  # before the listings, as the pool reads them
    got_first = block_ids(check.call(first.get_all_free_blocks, what="get_all_free_blocks() on the first queue"))
    got_second = block_ids(check.call(second.get_all_free_blocks, what="get_all_free_blocks() on the second queue"))
    check.expect(
        got_first == [0, 1, 2] and got_second == [11] and counts == (3, 1),
        "two queues alive at once interfere: the first queue (blocks 0, 1, 2) holds "
        f"{got_first} with num_free_blocks {counts[0]}, the second (blocks 10, 11, one popped) "
        f"holds {got_second} with num_free_blocks {counts[1]}",
        "keep all state on the instance (self.x = ... in __init__): a class attribute (fake_head = ... or "
        "num_free_blocks = 0 in the class body, changed through the class) or a mutable default argument "
        "(def __init__(self, blocks=[])) is shared by every queue, and the engine has one pool per LLM",
    )


@guarded_check(part="free_queue")
def check_free_queue(queue_cls: Callable) -> None:
    """The learner's ``FreeKVCacheBlockQueue`` class (constructed as ``queue_cls(blocks)``)."""
    check = Checker("FreeKVCacheBlockQueue")

    s = _Scenario(check, queue_cls, 5, "popleft order")
    s.popleft("popleft takes the head: the first block given to __init__")
    s.popleft("popleft takes the head")

    s = _Scenario(check, queue_cls, 5, "remove from the middle")
    s.remove(2, "remove(b) unlinks b wherever it is")
    s.popleft("popleft after a remove")
    s.append(2, "append puts the block at the tail")
    s.remove(3, "remove from the middle, again")
    s.popleft("popleft follows the relinked neighbours")

    s = _Scenario(check, queue_cls, 4, "remove the tail, then append")
    s.remove(3, "remove the last block")
    s.append(3, "append after removing the tail uses the new tail")
    s.remove(0, "remove the head")
    s.appendleft(0, "appendleft after removing the head uses the new head")

    s = _Scenario(check, queue_cls, 3, "two appends in a row")
    s.popleft("popleft")
    s.popleft("popleft")
    s.append(0, "append puts the block at the tail")
    s.append(1, "a second append goes after the first: the tail moved")

    s = _Scenario(check, queue_cls, 4, "appendleft")
    s.popleft("popleft")
    s.popleft("popleft")
    s.appendleft(0, "appendleft puts the block at the head: it will be reused first")
    s.appendleft(1, "appendleft puts the block at the head")
    s.popleft("popleft takes what appendleft put at the head")

    s = _Scenario(check, queue_cls, 3, "empty queue")
    for _ in range(3):
        s.popleft("pop every block")
    _expect_value_error_on_empty(check, s.queue, f"{s.where()}: popleft() on the empty queue")
    s.append(1, "append into an empty queue")
    s.appendleft(2, "appendleft into a queue of one")
    s.remove(1, "remove the tail of a queue of two")
    s.remove(2, "remove the last block left")
    _expect_value_error_on_empty(check, s.queue, f"{s.where()}: popleft() on the emptied queue")

    s = _Scenario(check, queue_cls, 0, "a queue built from no blocks")
    _expect_value_error_on_empty(check, s.queue, f"{s.where()}: popleft() on a queue built empty")

    _check_independent_queues(check, queue_cls)
    _check_constant_time(check, queue_cls)

    # Random operation sequences, step by step against the reference.
    for trial in range(40):
        num_blocks = check.rng.randint(1, 12)
        mine_blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        ref_blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        mine_given = list(mine_blocks)
        mine = check.call(queue_cls, mine_given, what=f"random trial {trial}: a queue of {num_blocks} blocks")
        ref = ReferenceQueue(ref_blocks)
        in_queue = set(range(num_blocks))
        history: list[str] = []
        for _ in range(30):
            out_of_queue = sorted(set(range(num_blocks)) - in_queue)
            choices = []
            if in_queue:
                choices += ["popleft", "remove"]
            if out_of_queue:
                choices += ["append", "appendleft"]
            op = check.rng.choice(choices)
            if op == "popleft":
                history.append("popleft()")
                got = check.call(mine.popleft, what=f"random trial {trial}: {' -> '.join(history)}")
                got, expected = getattr(got, "block_id", got), ref.popleft().block_id
                in_queue.discard(expected)
                check.expect_equal(
                    got, expected, f"random trial {trial}: {' -> '.join(history)}: popleft()", random_case=True
                )
            else:
                pool = sorted(in_queue) if op == "remove" else out_of_queue
                block_id = check.rng.choice(pool)
                history.append(f"{op}({block_id})")
                check.call(
                    getattr(mine, op), mine_blocks[block_id], what=f"random trial {trial}: {' -> '.join(history)}"
                )
                getattr(ref, op)(ref_blocks[block_id])
                if op == "remove":
                    in_queue.discard(block_id)
                else:
                    in_queue.add(block_id)
            mine_count = mine.num_free_blocks  # before the listing, as the pool reads it
            mine_free = check.call(mine.get_all_free_blocks, what=f"random trial {trial}: get_all_free_blocks()")
            check.expect_equal(
                (block_ids(mine_free), mine_count),
                (block_ids(ref.get_all_free_blocks()), ref.num_free_blocks),
                f"random trial {trial}: after {' -> '.join(history[-6:])}: (queue head to tail, num_free_blocks)",
                _stale_count_hint(mine_count, mine.num_free_blocks, ref.num_free_blocks),
                random_case=True,
            )
        _expect_given_list_unchanged(check, mine_given, mine_blocks, f"random trial {trial}: after 30 operations")
    check.passed()
