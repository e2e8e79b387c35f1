"""Checks for chapter 02: the learner's ``FreeKVCacheBlockQueue``.

The queue is a doubly linked list threaded through the blocks themselves
(``prev_free_block`` / ``next_free_block``). The check first runs short fixed
scenarios, each aimed at one typical mistake, and after every operation
verifies the order (head to tail), ``num_free_blocks`` and that the links of
neighbouring blocks agree with each other. Then it drives the learner's queue
and the reference with the same random operations and compares them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..block_pool import FreeKVCacheBlockQueue as ReferenceQueue
from ..block_pool import KVCacheBlock
from ._harness import Checker


def _ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


class _Scenario:
    """A learner's queue over fresh blocks, plus what it should contain."""

    def __init__(self, check: Checker, queue_cls: Callable, num_blocks: int, name: str) -> None:
        self.check = check
        self.name = name
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.queue = queue_cls(self.blocks)
        self.expected = list(range(num_blocks))
        self.history = ["init"]
        self.verify("the queue starts with every block given, in that order (head first)")

    def where(self) -> str:
        return f"{self.name}: after {' -> '.join(self.history)}"

    def verify(self, hint: str) -> None:
        check = self.check
        got = _ids(self.call("get_all_free_blocks"))
        check.expect_equal(got, self.expected, f"{self.where()}: get_all_free_blocks() (head to tail)", hint)
        check.expect_equal(
            self.queue.num_free_blocks, len(self.expected), f"{self.where()}: num_free_blocks",
            "num_free_blocks must change in every operation: -1 in popleft and remove, +1 in append and appendleft",
        )
        # The links must agree in both directions: the next operation follows them.
        free = self.call("get_all_free_blocks")
        ends = [("first", free[0], "prev_free_block"), ("last", free[-1], "next_free_block")] if free else []
        for which, block, link in ends:
            neighbour = getattr(block, link, None)
            check.expect(
                not any(neighbour is other for other in self.blocks),
                f"{self.where()}: block {block.block_id} is the {which} in the queue, but its {link} is "
                f"{_name(neighbour)}, a block that is not in the queue",
                "every change must fix the links on BOTH sides: remove(b) sets b.prev.next = b.next AND "
                "b.next.prev = b.prev (forgetting one neighbour breaks a later append or popleft)",
            )
        for left, right in zip(free, free[1:]):
            check.expect(
                left.next_free_block is right and right.prev_free_block is left,
                f"{self.where()}: blocks {left.block_id} and {right.block_id} are neighbours in the queue, but "
                f"block {left.block_id}.next_free_block is {_name(left.next_free_block)} and "
                f"block {right.block_id}.prev_free_block is {_name(right.prev_free_block)}",
                "every change must fix the links on BOTH sides: remove(b) sets b.prev.next = b.next AND "
                "b.next.prev = b.prev (forgetting one neighbour breaks a later append or popleft)",
            )

    def call(self, operation: str, *args):
        """Run one of the learner's methods; a crash becomes a message that says after what."""
        try:
            return getattr(self.queue, operation)(*args)
        except NotImplementedError:
            raise
        except Exception as error:  # noqa: BLE001 - reported with the operations that led to it
            raise AssertionError(
                f"{self.check.name}: {self.where()}: {operation}() raised {type(error).__name__}: {error}"
                "\n    hint: follow the links by hand on a small queue; a link left pointing at a block that "
                "has left the queue is the usual cause"
            ) from error

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
        got = _ids(self.call("get_all_free_blocks"))
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
            False, f"{case}: popleft() raised {type(error).__name__}: {error}",
            "popleft on an empty queue must raise ValueError (the pool relies on it), not another exception",
        )
        return
    check.expect(
        False, f"{case}: popleft() returned {_name(result)} instead of raising",
        "popleft on an empty queue must raise ValueError(\"No free blocks available\")",
    )


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

    # Random operation sequences, step by step against the reference.
    for trial in range(40):
        num_blocks = check.rng.randint(1, 12)
        mine_blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        ref_blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        mine, ref = queue_cls(mine_blocks), ReferenceQueue(ref_blocks)
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
                got, expected = mine.popleft().block_id, ref.popleft().block_id
                history.append("popleft()")
                in_queue.discard(expected)
                check.expect_equal(got, expected, f"random trial {trial}: {' -> '.join(history)}: popleft()",
                                   random_case=True)
            else:
                pool = sorted(in_queue) if op == "remove" else out_of_queue
                block_id = check.rng.choice(pool)
                getattr(mine, op)(mine_blocks[block_id])
                getattr(ref, op)(ref_blocks[block_id])
                history.append(f"{op}({block_id})")
                if op == "remove":
                    in_queue.discard(block_id)
                else:
                    in_queue.add(block_id)
            check.expect_equal(
                (_ids(mine.get_all_free_blocks()), mine.num_free_blocks),
                (_ids(ref.get_all_free_blocks()), ref.num_free_blocks),
                f"random trial {trial}: after {' -> '.join(history[-6:])}: (queue head to tail, num_free_blocks)",
                random_case=True,
            )
    check.passed()


__all__ = ["check_free_queue"]
