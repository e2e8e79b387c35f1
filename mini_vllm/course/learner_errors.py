"""What a learner reads when one of their parts fails inside the engine: their error, a note, their frames.

The engine finishes a request whose forward pass raised with
``finish_reason="error"`` and goes on serving; a part the scheduler calls
stops the step instead. :class:`~mini_vllm.course.learner_engine.LearnerLLM`
records every exception a learner's part raises (:func:`recording_errors`)
and, after the call, raises the first one as itself (:func:`part_error`),
with a note naming the part and how to step back (:func:`part_error_note`)
and a traceback cut to the learner's own frames. An error the engine raises
itself in a step that ran the learner's parts, or a stall, gets a note naming
those parts and their checks (:func:`explained`). A part that returns
something else than the blocks the engine needs fails at once, naming the
entry (:func:`as_list_of_blocks`).

vLLM has no counterpart: it logs a failed step and aborts its requests; the
course raises the learner's own exception instead.
"""

from __future__ import annotations

import functools
from types import TracebackType
from typing import Any

from ..scheduler import EngineStalled
from ._harness import _raised_in_learner_code, first_not_a, learners_frames
from .parts import PARTS_BY_KEY, parts_dir


BLOCK_PARTS = ("free_queue", "free_blocks", "free_request_blocks", "get_new_blocks", "schedule_waiting")
"""The parts that can stall the engine (:class:`~mini_vllm.scheduler.EngineStalled`): they free, allocate or admit."""


def is_a_part_error(error: BaseException, part_errors: list[tuple[str, BaseException]]) -> bool:
    """``error`` is one a learner's part raised during the call (kept in ``part_errors``, alone, to raise as itself)."""
    if not any(error is raised for _, raised in part_errors):
        return False
    part_errors[:] = [(key, raised) for key, raised in part_errors if raised is error]
    return True


def explained(error: Exception, whose: dict[str, str]) -> Exception | None:
    """``error`` (raised by the engine during a call to a learner's engine whose parts are ``whose``) with a note
    saying which of the learner's parts it comes from, and only the frames worth reading; None to raise it as it is.

    A stall (:class:`~mini_vllm.scheduler.EngineStalled`) names the parts that free, allocate or admit; an
    error of the engine's own code in a step (a block removed twice from the free queue, a block cached twice),
    or of a class of the learner's the engine calls directly (the free queue), names every part of theirs that ran.
    """
    if isinstance(error, EngineStalled):
        error.add_note(stall_note(whose))
        error.__cause__, error.__suppress_context__ = None, True
        return error.with_traceback(None)  # the scheduler's frames: the message says it all
    yours = [key for key, who in whose.items() if who == "yours"]
    if not yours or not _raised_in_a_step(error.__traceback__):
        return None
    # Show where it fired, not the ~10 frames of the step that led there.
    in_yours = _raised_in_learner_code(error)
    error.add_note(_engine_error_note(yours, in_yours))
    tb = error.__traceback__
    return error.with_traceback(_from_the_learners_code(tb) if in_yours else _last_frames(tb, 2))


def part_error(part_errors: list[tuple[str, BaseException]]) -> BaseException:
    """The first error a learner's part raised during the call, with :func:`part_error_note`, to raise as itself
    (``part_errors`` is emptied)."""
    key, error = part_errors[0]
    part_errors.clear()
    error.add_note(part_error_note(key))
    # The engine's frames tell a learner nothing: from their own code on, or none at all for a wrong return.
    tb = None if isinstance(error, NotAListOfBlocks) else _from_the_learners_code(error.__traceback__)
    return error.with_traceback(tb)


def stall_note(whose: dict[str, str]) -> str:
    """Which of the learner's parts running here own the blocks and the admissions that stalled."""
    yours = [key for key in BLOCK_PARTS if whose[key] == "yours"]
    if not yours:
        return "every part that frees, allocates or admits is the reference's here"
    checks = ", ".join(f"check_{key}" for key in yours)
    return (
        f"this engine runs your {', '.join(yours)}: a block that never returns to the free queue, or an "
        f"admission that admits nothing, stops the engine. Run their checks ({checks}) "
        "until they pass; learner_engine(parts={}) builds an engine of the reference alone."
    )


def _engine_error_note(yours: list[str], in_yours: bool) -> str:
    checks = ", ".join(f"check_{key}" for key in yours)
    where = (
        "your own code raised this (a class of yours the engine calls directly, such as your free queue)"
        if in_yours
        else "the engine's own code raised this"
    )
    return (
        f"{where}, in a step that ran your {', '.join(yours)}: something one of them returned or left behind "
        "broke what the engine relies on (each free block in the free queue once, ref counts that match the "
        "requests holding a block, one cached block per hash). Run their checks "
        f"({checks}) until they pass; learner_engine(parts={{}}) builds an engine of the reference alone."
    )


def _raised_in_a_step(tb: TracebackType | None) -> bool:
    """``tb`` passes through ``LLMEngine.step`` (not, say, the validation of a bad prompt before any step)."""
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "step" and code.co_filename.endswith("llm_engine.py"):
            return True
        tb = tb.tb_next
    return False


def _last_frames(tb: TracebackType | None, count: int) -> TracebackType | None:
    """The innermost ``count`` frames of ``tb``."""
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    return frames[-count] if len(frames) >= count else (frames[0] if frames else None)


def _from_the_learners_code(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` cut to :func:`learners_frames` (what ``learner_traceback`` prints for a check), to raise again;
    unchanged when no frame is the learner's."""
    found = learners_frames(tb)
    if found is None:
        return tb
    start, count = found
    last = start
    for _ in range(count - 1):
        last = last.tb_next
    last.tb_next = None
    return start


def part_error_note(key: str) -> str:
    """What a learner reads under an exception their part ``key`` raised: which part, where to fix it, how to step back."""
    part = PARTS_BY_KEY[key]
    path = parts_dir() / f"{key}.py"
    kept = f" (kept in {path})" if path.exists() else ""
    return (
        f"your part {key!r}{kept} raised during this call; its requests finished with finish_reason='error' "
        f"and the engine freed their blocks. Fix it in exercise {part.chapter} (or in that file), or go back to "
        f"the reference: from mini_vllm.course import reset_parts; reset_parts({key!r}) forgets the kept file, "
        "learner_engine(parts={}) builds an engine of the reference alone."
    )


RETURNS_BLOCKS = {
    "find_longest_cache_hit": "the hit's blocks, in order",
    "find_sliding_window_cache_hit": "the hit's blocks, block_pool.null_block for each one outside the window",
    "get_new_blocks": "the blocks popped from the free queue",
}
"""The parts that return a list of ``KVCacheBlock``, and what it holds: the engine uses every entry as a block."""


class NotAListOfBlocks(TypeError):
    """A part of :data:`RETURNS_BLOCKS` returned something else: the message says what, the traceback is the engine's."""


def as_list_of_blocks(key: str, returned: Any) -> list:
    """``returned`` as the list of ``KVCacheBlock`` the engine expects; else :class:`NotAListOfBlocks` (a ``TypeError``)
    naming ``key`` and the entry.

    A tuple is taken as a list, as the checks take it. Without this, a ``None`` in a
    learner's list surfaces steps later as the engine's ``'NoneType' object has no attribute 'ref_cnt'``.
    """
    from ..block_pool import KVCacheBlock

    what = RETURNS_BLOCKS[key]
    if isinstance(returned, tuple):
        returned = list(returned)
    if not isinstance(returned, list):
        raise NotAListOfBlocks(
            f"your {key} returned {type(returned).__name__} {returned!r:.80}: return a list of KVCacheBlock ({what})"
        )
    if (wrong := first_not_a(KVCacheBlock, returned)) is not None:
        index, entry = wrong
        raise NotAListOfBlocks(
            f"your {key} returned a list whose entry {index} is {entry!r:.80} ({type(entry).__name__}), not a "
            f"KVCacheBlock: the list holds {what}"
        )
    return returned


def recording_errors(errors: list, key: str, fn: Any) -> Any:
    """``fn``, recording into ``errors`` any exception it raises before raising it on (classes pass as they are).

    A part in :data:`RETURNS_BLOCKS` that returns something else than a list (or tuple) of
    blocks raises a ``TypeError`` saying which entry (:func:`as_list_of_blocks`).
    """
    if isinstance(fn, type) or not callable(fn):
        return fn  # the free queue: its errors reach the caller directly (scheduling is not a forward pass)

    @functools.wraps(fn)
    def part(*args: Any, **kwargs: Any) -> Any:
        try:
            returned = fn(*args, **kwargs)
            return as_list_of_blocks(key, returned) if key in RETURNS_BLOCKS else returned
        except Exception as error:
            errors.append((key, error))
            raise

    return part
