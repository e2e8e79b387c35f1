"""Shared machinery of the exercise checks.

A check compares the learner's function with the reference implementation
on fixed edge cases (the mistakes people actually make) and on random inputs,
raises :class:`CheckFailure` (an ``AssertionError``) with a message that says
what went wrong and on which input, and prints one short pass line.

Every call into the learner's code goes through :func:`call_learner` (or
``Checker.call``): an exception raised there becomes a message that names the
input or operation that triggered it, what was expected and the likely
mistake, followed by a traceback that starts at the learner's own code (the
checker's frames are cut). :func:`guarded_check` wraps each ``check_*`` as a
last line of defence, so a check never ends in an unexplained error, and
registers it in :data:`CHECKS` (``mini_vllm.course`` exports every registered
check by its name: decorating a ``check_*`` is all it takes to add one).

A check's typical mistakes are rows of a table, :class:`Mistake`: how the
mistake shows in what a case observed, the message's line and its hint.
``Checker.expect_no_mistakes`` runs a case's rows in order and fails on the
first that shows; :func:`first_mistake` picks the hint that explains a wrong
result. A new mistake is a new row.
"""

from __future__ import annotations

import copy
import functools
import random
import sys
import sysconfig
import traceback
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..tools import paths
from .parts import PARTS_BY_KEY, keep

Hint = str | dict[type[BaseException], str] | Callable[[BaseException], str]
"""The likely mistake behind a learner's exception: one for all, one per exception type, or one read from the
exception (a function of it; "" leaves the general guess)."""

_PACKAGE_DIRS = tuple(
    str(path)
    for path in (
        paths.PACKAGE_DIR,  # the engine, the course, the widgets, the tools
        paths.KERNELS_DIR,
    )
)
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}) + (
    sys.prefix,
    sys.base_prefix,
)


class CheckFailure(AssertionError):
    """What a check found wrong: the message names the case, the mistake and the fix.

    In Jupyter it is shown as its message alone (``_render_traceback_``): the
    checker's own frames would only hide the message. When the failure comes
    from an exception in the learner's code, ``learner_traceback`` holds that
    exception's traceback, cut so that it starts at the learner's code.
    """

    def __init__(self, message: str, learner_traceback: str = "") -> None:
        super().__init__(message + (f"\n{learner_traceback}" if learner_traceback else ""))
        self.message = message
        self.learner_traceback = learner_traceback

    @property
    def seen(self) -> str:
        """The message without its hint: what was wrong, for a caller that names the fix itself."""
        return self.message.split("\n    hint: ")[0]

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing the full traceback.
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: " + str(self)]


@dataclass(frozen=True)
class Mistake:
    """One typical mistake, a row of a check's table: how it shows, what the learner is told, and the hint.

    ``shows(seen)`` is true when the mistake is in ``seen``, what running one case observed (the
    learner's result, the pool they left, ...). ``problem`` and ``hint`` are the message's two
    lines: text, or a function of ``seen`` when the message names what was seen.
    """

    shows: Callable[[Any], bool]
    problem: str | Callable[[Any], str] = ""
    hint: str | Callable[[Any], str] = ""

    def problem_for(self, seen: Any) -> str:
        return self.problem(seen) if callable(self.problem) else self.problem

    def hint_for(self, seen: Any) -> str:
        return self.hint(seen) if callable(self.hint) else self.hint


def unequal(case: str, expected: Any, got: Any) -> str:
    """``case`` followed by what was expected and what came, as :meth:`Checker.expect_equal` words a failure
    (a row of mistakes whose problem is a wrong value writes its problem with it)."""
    return f"{case}\n    expected: {_short(expected)}\n    got:      {_short(got)}"


def first_mistake(mistakes: Iterable[Mistake], seen: Any) -> Mistake | None:
    """The first row whose mistake shows in ``seen`` (the most telling explanation comes first), else None."""
    return next((mistake for mistake in mistakes if mistake.shows(seen)), None)


class Checker:
    """Counts the cases a check ran, remembers the current one and formats failure messages."""

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.rng = random.Random(seed)
        self.num_fixed = 0
        self.num_random = 0
        self.case = "the first case"  # what the check is doing now (for guarded_check)
        self._returned: list[list] = []  # lists returned so far (expect_list(fresh=True))

    def fail(self, case: str, hint: str = "") -> None:
        raise CheckFailure(f"{self.name}: {case}" + (f"\n    hint: {hint}" if hint else ""))

    def expect_equal(self, got: Any, expected: Any, case: str, hint: str = "", random_case: bool = False) -> None:
        """Fail with a helpful message unless ``got == expected``."""
        self._count(random_case)
        if got != expected:
            message = f"{self.name}: {unequal(case, expected, got)}"
            if hint:
                message += f"\n    hint: {hint}"
            raise CheckFailure(message)

    def expect(self, condition: bool, case: str, hint: str = "", random_case: bool = False) -> None:
        self._count(random_case)
        if not condition:
            self.fail(case, hint)

    def expect_no_mistakes(
        self, mistakes: Iterable[Mistake], seen: Any, where: str = "", random_case: bool = False, counted: bool = True
    ) -> None:
        """Run one case's table: fail with the first row whose mistake shows in ``seen``.

        The message is ``where`` (the case, when the rows do not name it) followed by the row's
        problem, then its hint. Each row counts as one case of the pass line, as one ``expect``
        does; ``counted=False`` for rows that only explain a case counted elsewhere.
        """
        for mistake in mistakes:
            if counted:
                self._count(random_case)
            if mistake.shows(seen):
                self.fail(where + mistake.problem_for(seen), mistake.hint_for(seen))

    def _count(self, random_case: bool) -> None:
        if random_case:
            self.num_random += 1
        else:
            self.num_fixed += 1

    def call(self, fn: Callable, *args, what: str, expected: str = "", hint: Hint = "", **kwargs):
        """Call the learner's ``fn``; an exception becomes a message about ``what`` was called.

        ``hint``: the likely mistake behind any exception, or a dict of hints by exception type
        (``{IndexError: "..."}``) with :func:`likely_mistake`'s guess for the others.
        """
        self.case = what
        return call_learner(fn, *args, name=self.name, what=what, expected=expected, hint=hint, **kwargs)

    def wrap(self, fn: Callable, label: str, expected: str = "") -> Callable:
        """``fn`` with every call guarded: a crash names the call and its arguments."""

        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            shown = ", ".join([_short(a, 60) for a in args] + [f"{k}={_short(v, 60)}" for k, v in kwargs.items()])
            what = f"{label}({shown})"
            self.case = what
            return call_learner(fn, *args, name=self.name, what=what, expected=expected, **kwargs)

        return guarded

    def expect_list(
        self,
        value: Any,
        case: str,
        item_type: type | None = None,
        item_name: str = "",
        random_case: bool = False,
        fresh: bool = True,
    ) -> list:
        """``value`` as a list; a generator, None or another type fails with a message naming it.

        A tuple is accepted (and converted). ``item_type``: every item must be one.
        ``fresh``: the list must be a new object, not one an earlier call returned
        (a mutable default argument or a module-level list returns the same one).
        """
        self._count(random_case)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            self.fail(f"{case}: returned {describe_type(value)}, not a list", not_a_list_hint(value))
        if fresh:
            if any(value is earlier for earlier in self._returned):
                self.fail(
                    f"{case}: returned the very list object an earlier call returned",
                    "build a new list in every call (result = [] inside the function): a mutable default "
                    "argument (def f(..., result=[])) or a module-level list is shared by every call, so "
                    "each call adds to what the previous ones returned",
                )
            self._returned.append(value)
        if item_type is not None and (wrong := first_not_a(item_type, value)) is not None:
            self.fail(
                f"{case}: the list holds {describe_type(wrong[1])} ({_short(wrong[1], 80)}); "
                f"expected {item_name or item_type.__name__ + ' items'}",
            )
        return value

    def expect_unchanged(self, before: Any, after: Any, case: str, what: str, hint: str) -> None:
        """The learner's code must not change what the caller passed in."""
        self._count(False)
        if before != after:
            self.fail(
                f"{case}: your code changed the {what} the caller passed in\n    before: {_short(before)}\n"
                f"    after:  {_short(after)}",
                hint,
            )

    def passed(self) -> None:
        print(f"✓ {self.name}: {self.num_fixed} edge cases and {self.num_random} random cases agree with the reference")


def snapshot(value: Any) -> Any:
    """A deep copy to compare with later (a list of blocks is compared by block ids)."""
    if isinstance(value, (list, tuple)) and value and all(hasattr(v, "block_id") for v in value):
        return [v.block_id for v in value]
    return copy.deepcopy(value)


def first_not_a(item_type: type, items: list) -> tuple[int, Any] | None:
    """``(index, item)`` of the first item that is not an ``item_type``; None when all are."""
    return next(((index, item) for index, item in enumerate(items) if not isinstance(item, item_type)), None)


def describe_type(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, types.GeneratorType):
        return "a generator"
    if isinstance(value, Iterator):
        return f"an iterator ({type(value).__name__})"
    return f"a {type(value).__name__}"


def not_a_list_hint(value: Any) -> str:
    if value is None:
        return (
            'your function returned None: did you forget the `return` at the end, or return None for "nothing" '
            "(`return result or None`, `if not result: return None`)? An empty answer is an empty list, []"
        )
    if isinstance(value, (types.GeneratorType, Iterator)):
        return (
            "a generator (a function with `yield`, or a `(... for ...)` expression) can be read only once and "
            "has no len(): return a list, e.g. `[... for ...]` or `list(...)`"
        )
    if hasattr(value, "block_id"):
        return "you returned one block: return a list of blocks, even when it holds a single one"
    return "build a list and return it"


CHECKS: dict[str, Callable] = {}
"""Every ``check_*`` decorated with :func:`guarded_check`, by name (``mini_vllm.course`` exports them all)."""


def guarded_check(part: str | None = None) -> Callable[[Callable], Callable]:
    """Decorate and register a ``check_*``: it ends only in a pass line, a :class:`CheckFailure` or the stub's error.

    Anything else escaping it (an unexpected value that made the analysis
    itself fail) is turned into a message that names the case being run.
    ``part``: a key of :data:`mini_vllm.course.parts.PARTS`; when the check
    passes, its first argument (the learner's implementation) is kept as that
    part of the learner's engine (:func:`mini_vllm.course.parts.keep`).
    """
    if part is not None and part not in PARTS_BY_KEY:
        raise ValueError(f"guarded_check: part={part!r} is not in parts.PARTS ({sorted(PARTS_BY_KEY)})")

    def decorate(check_fn: Callable) -> Callable:
        name = check_fn.__name__
        if not name.startswith("check_") or CHECKS.get(name, check_fn).__module__ != check_fn.__module__:
            raise ValueError(f"guarded_check: {name!r} must be named check_* and defined in one module only")

        @functools.wraps(check_fn)
        def wrapper(*args, **kwargs):
            result = _run_guarded(check_fn, args, kwargs)
            if part is not None and args:
                keep(part, args[0])
            return result

        wrapper.part = part
        CHECKS[name] = wrapper
        return wrapper

    return decorate


def _run_guarded(check_fn: Callable, args: tuple, kwargs: dict):
    try:
        return check_fn(*args, **kwargs)
    except CheckFailure:
        raise
    except NotImplementedError as error:
        if not is_the_stub(error):
            raise
        raise not_written_yet(check_fn.__name__, error).with_traceback(None) from None
    except Exception as error:  # noqa: BLE001 - reported with the case that was running
        name = check_fn.__name__.removeprefix("check_")
        origin = learner_traceback(error)
        message = (
            f"{name}: the check could not go on: {type(error).__name__}: {error}\n"
            "    hint: your code returned or left behind something the check did not expect "
            "(a wrong type, a missing attribute, an inconsistent structure); "
            f"{likely_mistake(error)}"
        )
        raise CheckFailure(message, origin) from None


STUB_MESSAGE = "your code here"
"""How every exercise stub's ``raise NotImplementedError(...)`` starts (``mini_vllm.course.build.STUB``)."""


def is_the_stub(error: NotImplementedError) -> bool:
    """``error`` is an exercise stub's: raised in the learner's code, or saying "your code here"."""
    return _raised_in_learner_code(error) or str(error).startswith(STUB_MESSAGE)


def not_written_yet(check_name: str, error: NotImplementedError) -> NotImplementedError:
    """The stub's own ``NotImplementedError`` (its type stays: graders count "not done" by it), shown in one line.

    In Jupyter, ``_render_traceback_`` replaces the traceback through the check (some 40 lines) by
    ``not written yet: <the stub's function> ...``; elsewhere that line is a note under the error.
    """
    stub = _innermost_learner_function(error) or check_name.removeprefix("check_")
    line = (
        f"not written yet: {stub} is still the exercise's stub (it raises NotImplementedError). Write it, run its "
        f"cell, then run {check_name} again"
    )
    error._render_traceback_ = lambda: [line]
    error.add_note(line)
    return error


def _innermost_learner_function(error: BaseException) -> str | None:
    """The qualified name of the innermost function of the learner's that ``error`` passed through, if any."""
    tb, name = error.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if _is_learner_file(code.co_filename) and code.co_name != "<module>":
            name = code.co_qualname.rsplit("<locals>.", 1)[-1]  # Queue.popleft, not make_queue.<locals>.Queue.popleft
        tb = tb.tb_next
    return name


def call_learner(
    fn: Callable, *args, name: str = "your function", what: str = "", expected: str = "", hint: Hint = "", **kwargs
):
    """Call the learner's function; an exception becomes a :class:`CheckFailure`.

    NotImplementedError (the exercise stub) and :class:`CheckFailure` pass
    through untouched. The message says ``what`` was called (the input or
    operation), what was ``expected``, the likely mistake (``hint``, or one
    guessed from the exception) and a traceback that starts at the learner's code.
    """
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001 - reported with the input that triggered it
        raise learner_error(
            name, what or f"calling {getattr(fn, '__name__', 'your function')}", error, expected, hint
        ) from None


def learner_error(name: str, what: str, error: BaseException, expected: str = "", hint: Hint = "") -> CheckFailure:
    root = _innermost(error)
    if isinstance(hint, dict):  # a hint for some kinds of exception; the general guess for the others
        hint = next((text for kind, text in hint.items() if isinstance(root, kind)), "")
    elif callable(hint):  # a hint read from the exception itself (its message names what went wrong)
        hint = hint(root)
    lines = [f"{name}: {what} raised {type(root).__name__}: {_first_line(root)}"]
    if expected:
        lines.append(f"    expected: {expected}")
    lines.append(f"    likely mistake: {hint or likely_mistake(root)}")
    return CheckFailure("\n".join(lines), learner_traceback(error))


def _innermost(error: BaseException) -> BaseException:
    """Triton's interpreter wraps the kernel's exception; the original is more telling."""
    seen = 0
    while type(error).__name__ in ("InterpreterError", "CompilationError") and error.__cause__ is not None and seen < 5:
        error, seen = error.__cause__, seen + 1
    return error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def likely_mistake(error: BaseException) -> str:
    """A guess at the mistake behind a typical exception."""
    text = str(error)
    kind = type(error).__name__
    if isinstance(error, RecursionError):
        return (
            "a function or method calls itself without end (e.g. append calling self.append instead of "
            "linking the blocks, or a property that reads itself)"
        )
    if "mask" in text and "dtype" in text:
        return (
            "a Triton mask must be boolean: build it from comparisons combined with & and |, e.g. "
            "(heads < num_kv_heads) & (dims < head_dim); multiplying or adding masks gives integers. "
            "Combining the tile mask with a scalar condition, in_tile & (slot >= 0), gives an integer mask in "
            "Triton's interpreter too: skip the padding token with `if slot < 0: return` instead, or write "
            "tl.where(slot >= 0, in_tile, False)"
        )
    if isinstance(error, TypeError):
        if "generator" in text:
            return (
                "a generator is not a list: it has no len() and no indexing, and it can be read only once; "
                "build a list ([... for ...]) where a list is needed"
            )
        if "BlockHashToBlockMap" in text and ("iterable" in text or "subscriptable" in text):
            return (
                "the pool's hash map is not a dict (`in`, `[...]` and loops do not work on it): look a hash up with "
                "block_pool.get_cached_block(block_hash), which returns the block or None"
            )
        if "'KVCacheBlocks'" in text:  # get_computed_blocks' hit: no len(), indexing or loop of its own
            return (
                "new_computed_blocks is a KVCacheBlocks (one list of blocks per KV-cache group, in .blocks), not a "
                "list: you need not look inside it. Pass it to allocate_slots as it is, and count the hit's tokens "
                "with num_new_local_computed_tokens"
            )
        if "not iterable" in text and "'KVCacheBlock'" in text:
            return "you passed one block where a list (or any iterable) of blocks is expected: wrap it, [block]"
        if "not iterable" in text:
            return "something you loop over is not a collection (a single value, or None): check what you pass"
        if "not subscriptable" in text or "has no len()" in text:
            return (
                "you indexed or took len() of something that can only be looped over (reversed(...), a "
                "generator): use a for loop, or make a list first"
            )
        if "NoneType" in text:
            return "a value you compute with is None: a function that forgot to return, or a lookup that found nothing"
        if "argument" in text and _raised_in_learner_code(error):
            return (
                "a call in your code passes other arguments than that function or method takes: compare it "
                "with its signature (help(...) shows it)"
            )
        if "argument" in text:
            return "a function was called with other arguments than it takes: keep the signature the exercise gives"
        return "a value of the wrong type: print the types of what your code receives and returns"
    if isinstance(error, AttributeError):
        if "NoneType" in text:
            return (
                "something you expected to be an object is None: e.g. the link past the end of the list, "
                "or get_cached_block(...) for a hash that is not cached"
            )
        return "an attribute or method that the object does not have: check the names the exercise uses"
    if isinstance(error, IndexError) and "out of bounds for dimension" in text:
        return (
            "an index past the end of a tensor (the message says which dimension and its size, the traceback "
            "which line): check the loop bounds and the size you gave the tensor when you created it"
        )
    if isinstance(error, IndexError):
        return (
            "an index past the end: check your loop bounds (range(start, end), len(...) // block_size) and "
            "that the list you index is the one you meant"
        )
    if isinstance(error, KeyError):
        return "a dict lookup with a key that is not there: check with `in`, or use .get(key)"
    if isinstance(error, ZeroDivisionError):
        return "a division by zero: an empty range or a sum of zero weights"
    if isinstance(error, ValueError) and _raised_in_learner_code(error):
        return (
            "your own code raised this ValueError: check the condition before that raise (e.g. >= where > "
            "is meant: asking for exactly as much as there is is allowed)"
        )
    if isinstance(error, ValueError):
        return (
            "a ValueError: if it comes from the engine (e.g. 'No free blocks available'), your code asked for "
            "more than there is, or did the same thing twice"
        )
    if isinstance(error, AssertionError):
        return "an assert in your code failed"
    return f"{kind}: read the traceback below, it starts at your code"


def _raised_in_learner_code(error: BaseException) -> bool:
    """The innermost Python frame of ``error``'s traceback is the learner's code (their own ``raise``,
    or a built-in called from it), not the engine's, the check's or a library's."""
    traceback = error.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return _is_learner_file(traceback.tb_frame.f_code.co_filename)


def _is_learner_file(filename: str) -> bool:
    if filename.startswith("<") and not filename.startswith("<ipython"):
        return False  # <frozen ...>, <string> from libraries
    if filename.startswith(_PACKAGE_DIRS):
        return False
    return not filename.startswith(_LIBRARY_DIRS)


def learners_frames(tb: types.TracebackType | None) -> tuple[types.TracebackType, int] | None:
    """The part of ``tb`` a learner reads: its first frame in the learner's code and how many frames to
    keep from there, up to one frame past their last (the call their last line made). The engine's
    frames above, and a library's deep below (Triton's interpreter runs a kernel ~15 frames down), tell
    a learner nothing. None when no frame is theirs."""
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    theirs = [i for i, frame in enumerate(frames) if _is_learner_file(frame.tb_frame.f_code.co_filename)]
    if not theirs:
        return None
    return frames[theirs[0]], min(theirs[-1] + 2, len(frames)) - theirs[0]


def learner_traceback(error: BaseException) -> str:
    """The traceback of ``error`` from the first frame of the learner's code on ("" if none)."""
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 5:
        chain.append(chain[-1].__cause__)
    for item in reversed(chain):  # the innermost exception with learner frames tells most
        found = learners_frames(item.__traceback__)
        if found is None:
            continue
        start, count = found
        frames = traceback.extract_tb(start, limit=count)
        text = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(type(item), item))
        return "Traceback (your code first):\n" + text.rstrip()
    return ""


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    if " object at 0x" in text:  # a default repr says nothing but the type: name the type alone
        text = f"<{type(value).__name__}>"
    if isinstance(value, (bytes, bytearray)):
        text = value.hex()[:16] + "…"
    elif isinstance(value, list) and value and isinstance(value[0], bytes):
        text = "[" + ", ".join(v.hex()[:8] + "…" for v in value) + "]"
    return text if len(text) <= limit else text[: limit - 1] + "…"
