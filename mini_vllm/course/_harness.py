"""Shared machinery of the exercise checks.

A check compares the learner's function with the reference implementation
on fixed edge cases (the mistakes people actually make) and on random inputs,
raises ``AssertionError`` with a message that says what went wrong and on
which input, and prints one short pass line.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any


class Checker:
    """Counts the cases a check ran and formats its failure messages."""

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.rng = random.Random(seed)
        self.num_fixed = 0
        self.num_random = 0

    def expect_equal(self, got: Any, expected: Any, case: str, hint: str = "", random_case: bool = False) -> None:
        """Fail with a helpful message unless ``got == expected``."""
        if random_case:
            self.num_random += 1
        else:
            self.num_fixed += 1
        if got != expected:
            message = f"{self.name}: {case}\n    expected: {_short(expected)}\n    got:      {_short(got)}"
            if hint:
                message += f"\n    hint: {hint}"
            raise AssertionError(message)

    def expect(self, condition: bool, case: str, hint: str = "", random_case: bool = False) -> None:
        if random_case:
            self.num_random += 1
        else:
            self.num_fixed += 1
        if not condition:
            raise AssertionError(f"{self.name}: {case}" + (f"\n    hint: {hint}" if hint else ""))

    def passed(self) -> None:
        print(f"✓ {self.name}: {self.num_fixed} edge cases and {self.num_random} random cases agree with the reference")


def call_learner(fn: Callable, *args, **kwargs):
    """Call the learner's function; NotImplementedError passes through untouched (the stub)."""
    return fn(*args, **kwargs)


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    if isinstance(value, (bytes, bytearray)):
        text = value.hex()[:16] + "…"
    elif isinstance(value, list) and value and isinstance(value[0], bytes):
        text = "[" + ", ".join(v.hex()[:8] + "…" for v in value) + "]"
    return text if len(text) <= limit else text[: limit - 1] + "…"
