"""The learner's own engine: an ``LLM`` made of the learner's passing parts, the reference elsewhere.

    >>> from mini_vllm.course import learner_engine, show_parts
    >>> llm = learner_engine(device="cpu", num_blocks=64)   # every part you have kept so far
    your parts: FreeKVCacheBlockQueue (02), ... · reference: ...   (printed: parts_line(llm))
    >>> show_parts(llm)                                     # the same, as a table with each part's role

Every part is one of the engine's extension points (``mini_vllm/engine_parts.py``):
:func:`use_parts` turns the learner's parts into an ``EngineParts`` and
:func:`learner_engine` builds ``LLM(..., parts=...)`` with it. The engine hands
each part to the object that owns it (the block pool, the KV-cache manager,
the scheduler, the model runner, each request, the attention backend) as it
builds them, for this ``LLM`` only: nothing here patches the engine.

:func:`course_parts` maps every part of an engine to ``"yours"`` or
``"reference"`` (the dashboard, :func:`parts_line` and :func:`show_parts` read it).
"""

from __future__ import annotations

import functools
import random
from types import TracebackType
from typing import Any

from ..engine_parts import EngineParts
from ..llm import LLM
from ..scheduler import EngineStalled
from ._harness import _raised_in_learner_code, first_not_a, learners_frames
from .parts import PARTS, PARTS_BY_KEY, _is_learners, kept_parts, learner_parts, parts_dir

ENGINE_PARTS = [part.key for part in PARTS if part.in_engine]
"""The parts that go into the engine (``build_messages`` shapes the prompts a client sends instead)."""

KERNEL_PARTS = ("store_kv", "paged_decode")
"""Exercise 07's parts: the attention backend runs them in every layer of every step."""

HASHING_PARTS = ("hash_block_tokens", "hash_request_tokens")
"""Chapter 04's parts hash with SHA-256: an engine with another ``hash_algo`` keeps its own hashing."""


class LearnerLLM(LLM):
    """An ``LLM`` built by :func:`learner_engine`: the same engine, plus ``course_parts`` to read.

    The engine finishes a request whose forward pass raised with
    ``finish_reason="error"`` and goes on serving (a learner's ``store_kv``,
    ``paged_decode`` or ``slot_mapping`` runs inside the forward pass). So that
    a learner sees *their* error, as itself, ``generate`` (and ``chat``) raise
    the first exception one of the learner's parts raised during the call,
    after the engine has finished the call's requests and freed their blocks.
    A part the scheduler calls stops the step instead; its error is raised the
    same way, with the same note. An engine stalled by lost blocks
    (:class:`~mini_vllm.scheduler.EngineStalled`) gets a note naming the
    learner's parts that free, allocate or admit, and their checks. An error the
    engine's own code raises in a step (a block removed twice from the free
    queue, a block cached twice) gets a note naming every part of the learner's
    that ran, and only its innermost frames.
    """

    part_errors: list[tuple[str, BaseException]]  # (part key, exception), filled by the wrapped parts

    @property
    def course_parts(self) -> dict[str, str]:
        """Every part: ``"yours"`` or ``"reference"`` (:func:`course_parts`)."""
        return course_parts(self)

    def generate(self, *args: Any, **kwargs: Any) -> list:
        self.part_errors.clear()
        try:
            outputs = super().generate(*args, **kwargs)
        except EngineStalled as error:
            error.add_note(self._stall_note())
            raise error.with_traceback(None) from None  # the scheduler's frames: the message says it all
        except Exception as error:
            # A part the scheduler calls (a lookup, an allocation): its error stops the step, and
            # LLM.generate aborts the call's requests before it arrives here.
            if not any(error is raised for _, raised in self.part_errors):
                yours = [key for key, whose in self.course_parts.items() if whose == "yours"]
                if yours and _raised_in_a_step(error.__traceback__):
                    # The engine's own check fired on what a learner's part left behind, or a learner's
                    # class the engine calls directly (the free queue) raised: say whose parts ran, and show
                    # where it fired, not the ~10 frames of the step that led there.
                    in_yours = _raised_in_learner_code(error)
                    error.add_note(_engine_error_note(yours, in_yours))
                    tb = error.__traceback__
                    raise error.with_traceback(_from_the_learners_code(tb) if in_yours else _last_frames(tb, 2))
                raise
            self.part_errors[:] = [(key, raised) for key, raised in self.part_errors if raised is error]
        if self.part_errors:
            key, error = self.part_errors[0]
            self.part_errors.clear()
            error.add_note(part_error_note(key))
            # The engine's frames tell a learner nothing: from their own code on, or none at all for a wrong return.
            tb = None if isinstance(error, NotAListOfBlocks) else _from_the_learners_code(error.__traceback__)
            raise error.with_traceback(tb)
        return outputs

    def _stall_note(self) -> str:
        """Which of the learner's parts running here own the blocks and the admissions that stalled."""
        whose = self.course_parts
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


BLOCK_PARTS = ("free_queue", "free_blocks", "free_request_blocks", "get_new_blocks", "schedule_waiting")
"""The parts that can stall the engine (:class:`~mini_vllm.scheduler.EngineStalled`): they free, allocate or admit."""


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


def learner_engine(
    model: str | None = None,
    *,
    parts: dict[str, Any] | None = None,
    mine: dict[str, Any] | None = None,
    kernels: bool | None = None,
    quiet: bool = False,
    **llm_kwargs,
) -> LearnerLLM:
    """An ``LLM(model, parts=..., **llm_kwargs)`` running the learner's parts.

    ``parts``: part key -> implementation (default: every part kept in the
    parts folder, :func:`mini_vllm.course.parts.learner_parts`). ``{}`` gives
    the reference engine. ``mine``: parts from the notebook at hand that go in
    on top of ``parts`` — an exercise passes the part it just wrote, so that
    its run uses the learner's code even before the check kept it.
    ``kernels``: whether the kept kernel parts (exercise 07's ``store_kv`` and
    ``paged_decode``) run. Default: yes where Triton compiles them (a GPU); on
    a CPU, where Triton's interpreter makes every step about 20 times slower,
    no, with a line saying so (``kernels=True`` runs them anyway, as the
    comparison at the end of exercise 08 does). Parts in ``mine`` always run.

    Prints :func:`parts_line`: which parts of the engine built are yours and
    which are the reference's (``quiet=True``: not).
    """
    chosen = dict(learner_parts() if parts is None else parts)
    if parts is None and kernels is not True:
        left_out = [key for key in KERNEL_PARTS if key in chosen and key not in (mine or {})]
        if left_out and (kernels is False or _triton_interpreted()):
            for key in left_out:
                del chosen[key]
            if kernels is None:
                print(
                    f"  note: your {' and '.join(left_out)} stay out of this engine: Triton runs in its interpreter "
                    "on this machine, about 20 times slower (learner_engine(..., kernels=True) runs them)"
                )
    chosen.update(mine or {})
    kept = set(kept_parts()) if mine else set()  # only what is given as mine needs the folder's listing again
    for key, fn in (mine or {}).items():
        if key in ENGINE_PARTS and key not in kept and _is_learners(fn):
            print(
                f"  note: your {PARTS_BY_KEY[key].name} runs in this engine, but its check has not passed yet: "
                "it is not kept, and the engines of later chapters will not run it"
            )
    hash_algo = llm_kwargs.get("hash_algo") or getattr(llm_kwargs.get("config"), "hash_algo", "sha256")
    errors: list[tuple[str, BaseException]] = []
    llm = LearnerLLM(model, parts=use_parts(chosen, hash_algo=hash_algo, errors=errors), **llm_kwargs)
    llm.part_errors = errors
    if not quiet:
        print(parts_line(llm))
    return llm


def _triton_interpreted() -> bool:
    """True where Triton runs its kernels in its interpreter (no GPU): ``mini_vllm.kernels.TRITON_INTERPRETED``."""
    from mini_vllm import kernels  # first: sets TRITON_INTERPRET=1 on a machine without a GPU

    return kernels.TRITON_INTERPRETED


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


def _raising_into(errors: list, key: str, fn: Any) -> Any:
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


def scattered_free_queue(queue_class: type, seed: int = 0) -> type:
    """A subclass of ``queue_class`` whose queue starts with the pool's blocks shuffled (``random.Random(seed)``).

    A fresh pool hands out blocks 0, 1, 2, ... in order, which makes slots look
    like positions; chapters 03 and exercise 03 build their engine with this
    free queue (``mine={"free_queue": scattered_free_queue(FreeKVCacheBlockQueue)}``)
    so that block tables point all over the pool. ``queue_class`` is the
    reference's queue or the learner's.
    """

    class Scattered(queue_class):
        def __init__(self, blocks: list) -> None:
            blocks = list(blocks)
            random.Random(seed).shuffle(blocks)
            super().__init__(blocks)

    Scattered.__name__ = Scattered.__qualname__ = f"Scattered{queue_class.__name__}"
    return Scattered


def use_parts(parts: dict[str, Any], *, hash_algo: str = "sha256", errors: list | None = None) -> EngineParts:
    """The ``EngineParts`` of the learner's ``parts`` (part key -> implementation), for ``LLM(parts=...)``.

    Every key of :data:`ENGINE_PARTS` is a field of ``EngineParts`` of the same
    name and signature; a part that is not given stays the engine's own. The
    hashing parts are left out when ``hash_algo`` is not ``"sha256"`` (they
    hash with SHA-256, as chapter 04's exercise does). With ``errors`` (a
    list), every function part appends ``(key, exception)`` to it when it
    raises (:class:`LearnerLLM` raises the first after the call).
    """
    if isinstance(parts, LLM):
        raise TypeError(
            "use_parts(llm, parts) no longer changes a built LLM: the parts go in when the engine is built, "
            "LLM(..., parts=use_parts(parts)) or learner_engine(parts=parts)"
        )
    unknown = sorted(set(parts) - {part.key for part in PARTS})
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; the engine's parts are {ENGINE_PARTS}")
    given = {key: fn for key, fn in parts.items() if key in ENGINE_PARTS}
    if hash_algo != "sha256":
        given = {key: fn for key, fn in given.items() if key not in HASHING_PARTS}
    if errors is not None:  # the engine's own implementations stay as they are (and count as the reference)
        own = EngineParts()
        given = {key: fn if fn is getattr(own, key) else _raising_into(errors, key, fn) for key, fn in given.items()}
    return EngineParts(**given)


def course_parts(llm: Any) -> dict[str, str]:
    """Every part of ``llm``'s engine: ``"yours"`` where its ``EngineParts`` has one, else ``"reference"``.

    ``llm``: an ``LLM``, an ``LLMEngine``, or what holds one (an ``AsyncLLM``, a server's ``.engine``).
    """
    replaced = set(_engine_parts_of(llm).replaced())
    return {key: ("yours" if key in replaced else "reference") for key in ENGINE_PARTS}


def _engine_parts_of(engine_or_llm: Any) -> EngineParts:
    """The ``EngineParts`` of an ``LLMEngine``, or of the engine an ``LLM``, an ``AsyncLLM`` or a server holds."""
    held = engine_or_llm
    for _ in range(4):  # a server holds an AsyncLLM, which holds an LLM, which holds the LLMEngine
        if isinstance(getattr(held, "parts", None), EngineParts):
            return held.parts
        held = next((getattr(held, name) for name in ("llm_engine", "engine", "llm") if hasattr(held, name)), None)
    raise TypeError(f"{type(engine_or_llm).__name__} holds no engine: pass an LLM (learner_engine(...)) or an LLMEngine")


# -- showing and comparing ---------------------------------------------------------------
class PartsTable:
    """Which parts an engine runs: the learner's or the reference. Renders as HTML and as text."""

    def __init__(self, course_parts: dict[str, str]) -> None:
        self.course_parts = course_parts

    def rows(self) -> list[tuple[str, str, str, str]]:
        by_key = {part.key: part for part in PARTS}
        return [
            (by_key[key].chapter, by_key[key].name, by_key[key].role, who) for key, who in self.course_parts.items()
        ]

    def __repr__(self) -> str:
        lines = [f"{'ch':<3} {'part':<29} {'whose':<10} role"]
        lines += [f"{ch:<3} {name:<29} {who:<10} {role}" for ch, name, role, who in self.rows()]
        mine = sum(who == "yours" for *_, who in self.rows())
        lines.append(f"{mine} of {len(self.rows())} parts are yours")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        body = "".join(
            f"<tr><td>{ch}</td><td><code>{html.escape(name)}</code></td><td>{html.escape(role)}</td>"
            f"<td style='font-weight:bold;color:{'#1a7f37' if who == 'yours' else '#57606a'}'>{who}</td></tr>"
            for ch, name, role, who in self.rows()
        )
        mine = sum(who == "yours" for *_, who in self.rows())
        return (
            "<table><thead><tr><th>ch</th><th>part</th><th>role</th><th>whose</th></tr></thead>"
            f"<tbody>{body}</tbody></table><p>{mine} of {len(self.rows())} parts are yours</p>"
        )


class PartsLine(str):
    """The one line :func:`parts_line` returns: a ``str`` that a notebook shows as its text, unquoted."""

    def __repr__(self) -> str:
        return str(self)


def parts_line(engine_or_llm: Any = None) -> PartsLine:
    """One line: which parts of this engine run your code, and which run the reference's.

        >>> print(parts_line(llm))
        your parts: FreeKVCacheBlockQueue (02), hash_block_tokens, hash_request_tokens (04) · reference: ...

    "Yours" means your code: a part whose check passed in an exercise (kept in
    the parts folder), or one given to :func:`learner_engine` as ``mine``, that
    this engine runs (never benchmark results). ``engine_or_llm``: an ``LLM``,
    an ``LLMEngine`` or what wraps one (an ``AsyncLLM``, a server); without
    one, the engine :func:`learner_engine` would build now (every kept part).
    A part kept but not run by this engine (a reference engine beside yours,
    or the kernels on a CPU) is named as such.
    """
    kept = set(kept_parts())
    if engine_or_llm is None:
        whose = {key: ("yours" if key in kept else "reference") for key in ENGINE_PARTS}
    else:
        whose = course_parts(engine_or_llm)
    yours = [key for key in ENGINE_PARTS if whose[key] == "yours"]
    reference = [key for key in ENGINE_PARTS if whose[key] != "yours"]
    not_run = [key for key in reference if key in kept]
    line = f"your parts: {_by_chapter(yours) or 'none yet'} · reference: {_by_chapter(reference) or 'none'}"
    if not_run:
        line += f" · kept, not run by this engine: {_by_chapter(not_run)}"
    return PartsLine(line)


def _by_chapter(keys: list[str]) -> str:
    """``FreeKVCacheBlockQueue (02), hash_block_tokens, hash_request_tokens (04)``: each part by its exercise's
    name, those of one chapter together."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(PARTS_BY_KEY[key].chapter, []).append(PARTS_BY_KEY[key].name)
    return ", ".join(f"{', '.join(names)} ({chapter})" for chapter, names in groups.items())


def show_parts(llm: LLM | None = None) -> PartsTable:
    """The parts of ``llm`` (or, without one, of the engine :func:`learner_engine` would build now)."""
    if llm is not None:
        return PartsTable(course_parts(llm))
    kept = learner_parts()
    return PartsTable({key: ("yours" if key in kept else "reference") for key in ENGINE_PARTS})


def compare_with_reference(mine: LLM, reference: LLM, prompts: list, sampling_params: Any) -> dict[str, Any]:
    """Run the same workload on both engines; returns what must agree, side by side, and prints it.

    Both engines should be fresh (or reset) and built alike. Compares the
    generated tokens, each request's cached tokens and the prefix-cache counters.
    """
    got = mine.generate(prompts, sampling_params, use_tqdm=False)
    expected = reference.generate(prompts, sampling_params, use_tqdm=False)
    stats_mine = mine.llm_engine.kv_cache_manager.prefix_cache_stats
    stats_ref = reference.llm_engine.kv_cache_manager.prefix_cache_stats
    result = {
        "same tokens": [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(got, expected)],
        "cached tokens (yours)": [o.num_cached_tokens for o in got],
        "cached tokens (reference)": [o.num_cached_tokens for o in expected],
        "prefix cache (requests, queries, hits), yours": (stats_mine.requests, stats_mine.queries, stats_mine.hits),
        "prefix cache (requests, queries, hits), reference": (stats_ref.requests, stats_ref.queries, stats_ref.hits),
    }
    result["all equal"] = (
        all(result["same tokens"])
        and result["cached tokens (yours)"] == result["cached tokens (reference)"]
        and result["prefix cache (requests, queries, hits), yours"]
        == result["prefix cache (requests, queries, hits), reference"]
    )
    width = max(len(key) for key in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    return result


def run_against_reference(
    parts: dict[str, Any] | None = None,
    *,
    workloads: list[str] | None = None,
    block_size: int = 32,
    num_blocks: int | None = None,
    model: str | None = None,
    with_vllm: bool = False,
) -> dict[str, Any]:
    """The engine of the learner's parts on real workloads, next to the reference (and real vLLM).

    The workloads are :mod:`mini_vllm.tools.compare_vllm`'s (a shared system prompt,
    a multi-turn chat, n > 1, eviction and preemption, cache salts, ...), from
    a cold cache each. Both mini-vLLM engines run in this process, built
    alike. Prints one line per workload and returns ``{"parts", "reference",
    "vllm", "vllm_missing", ...}``: ``reference`` (and ``vllm``) hold
    :func:`mini_vllm.tools.compare_vllm.compare_workload` results. ``with_vllm``
    also runs :func:`against_vllm` (or call it later with the result).
    """
    from transformers import AutoTokenizer

    from ..tools import compare_vllm
    from ..model import default_model_path

    path = model or default_model_path()
    num_blocks = num_blocks or compare_vllm.DEFAULT_NUM_BLOCKS
    tokenizer = AutoTokenizer.from_pretrained(path)
    specs = compare_vllm.build_workloads(tokenizer, block_size, workloads)
    engine_args = dict(
        device="cpu",
        dtype="float32",
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=compare_vllm.MAX_NUM_SEQS,
        max_num_batched_tokens=compare_vllm.MAX_NUM_BATCHED_TOKENS,
        max_model_len=compare_vllm.engine_max_model_len(block_size, num_blocks),
    )
    print(
        f"running {len(specs)} workload(s) on your engine (your kept parts; the reference's where you have none) "
        "and on the reference (about 20 s each on a laptop CPU):"
    )
    mine_llm = learner_engine(model, parts=parts, kernels=True, **engine_args)  # every part, the kernels too
    reference_llm = LLM(model, **engine_args)
    mine_events, reference_events = _record_cache_events(mine_llm), _record_cache_events(reference_llm)
    mine, reference = [], []
    for index, spec in enumerate(specs, start=1):  # one workload at a time on both, so progress shows as it goes
        mine += compare_vllm.run_mini_workloads(mine_llm, [spec])
        reference += compare_vllm.run_mini_workloads(reference_llm, [spec])
        print(f"  [{index}/{len(specs)}] {spec['name']}: done on both", flush=True)
    result: dict[str, Any] = {
        "parts": course_parts(mine_llm),
        "vllm": None,
        "vllm_missing": None,
        "model_path": str(path),
        "block_size": block_size,
        "num_blocks": num_blocks,
        "specs": specs,
        "mine": mine,
    }
    result["reference"] = [compare_vllm.compare_workload(w, m, r) for w, m, r in zip(specs, mine, reference)]
    result["observables"] = compare_observables(
        mine, reference, mine_events, reference_events, _free_queue(mine_llm), _free_queue(reference_llm)
    )
    print(f"your engine vs the reference, block_size {block_size}, {num_blocks} blocks:")
    _print_comparison(result["reference"])
    _print_observables(result["observables"])
    if with_vllm:
        against_vllm(result)
    return result


# What the engine lets anyone observe besides tokens and hits: a learner's engine must agree on all of it.
CACHE_EVENTS = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "BlocksFreed", "RequestPreempted")


def _record_cache_events(llm: LLM) -> list[tuple]:
    """The KV-cache events the engine emits from now on, step by step: one sorted tuple of events per step.

    Within a step the order is not part of the contract (vLLM publishes a step's
    events as one batch), so each step's events are compared as a set; the steps
    themselves, and what each contains, must agree.
    """
    import dataclasses

    steps: list[tuple] = []
    current: list[tuple] = []

    def listen(event: Any) -> None:
        name = type(event).__name__
        if name in CACHE_EVENTS:
            current.append((name, *dataclasses.astuple(event)))
        elif name == "StepFinished" and current:
            steps.append(tuple(sorted(current, key=repr)))
            current.clear()

    llm.llm_engine.add_listener(listen)
    return steps


def _free_queue(llm: LLM) -> tuple[int, ...]:
    """The free queue's block ids, head (reused first) to tail, read through the widgets' snapshot."""
    from ..viz.state import StateSource

    return StateSource(llm).snapshot().free_queue


def compare_observables(
    mine: list[dict],
    reference: list[dict],
    mine_events: list[tuple],
    reference_events: list[tuple],  # per step, as _record_cache_events records them
    mine_free_queue: tuple[int, ...],
    reference_free_queue: tuple[int, ...],
) -> dict[str, Any]:
    """Evictions and preemptions per workload, the KV-cache event stream, and the free queue's final order.

    Returns ``{"equal": bool, "differences": [str, ...]}``; each difference names
    the first place the two engines part (a learner's pool that never counts an
    eviction, or frees blocks in another order, passes every token comparison).
    """
    differences = []
    for ours, theirs in zip(mine, reference):
        for key, label in (("num_evictions", "evictions"), ("num_preemptions", "preemptions")):
            if ours[key] != theirs[key]:
                differences.append(f"{ours['name']}: {ours[key]} {label}, the reference {theirs[key]}")
    if mine_events != reference_events:
        index = next(
            (i for i, (a, b) in enumerate(zip(mine_events, reference_events)) if a != b),
            min(len(mine_events), len(reference_events)),
        )
        yours = mine_events[index] if index < len(mine_events) else "no more events"
        theirs = reference_events[index] if index < len(reference_events) else "no more events"
        differences.append(
            f"KV-cache events, step {index} with any: yours {_short(yours)}, the reference {_short(theirs)}"
        )
    if mine_free_queue != reference_free_queue:
        index = next(
            (i for i, (a, b) in enumerate(zip(mine_free_queue, reference_free_queue)) if a != b),
            min(len(mine_free_queue), len(reference_free_queue)),
        )
        differences.append(
            f"free queue at the end: position {index} holds block "
            f"{mine_free_queue[index] if index < len(mine_free_queue) else '-'}, the reference's "
            f"{reference_free_queue[index] if index < len(reference_free_queue) else '-'}"
        )
    num_events = sum(len(step) for step in reference_events)
    return {"equal": not differences, "differences": differences, "num_events": num_events}


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _print_observables(observables: dict[str, Any]) -> None:
    if observables["equal"]:
        print(
            f"  evictions, preemptions, {observables['num_events']} KV-cache events and the free queue's order: "
            "the same as the reference's"
        )
        return
    print("  DIFFERENT from the reference (tokens and hits can agree while these do not):")
    for difference in observables["differences"]:
        print(f"    {difference}")


def against_vllm(result: dict[str, Any]) -> dict[str, Any]:
    """The same workloads through real vLLM (``make vllm``), next to what the learner's engine did.

    ``result``: what :func:`run_against_reference` returned; fills in its
    ``vllm`` (or ``vllm_missing``, when vLLM is not installed here) and prints.
    """
    from ..tools import compare_vllm

    if "yours" not in result["parts"].values():
        print(
            "real vLLM: skipped, none of the parts is yours yet (chapter 10's side-by-side compares the "
            "reference with vLLM)"
        )
        return result
    if compare_vllm.vllm_python() is None:
        result["vllm_missing"] = compare_vllm.vllm_missing_reason()
        print(f"real vLLM: {result['vllm_missing']}")
        return result
    specs = result["specs"]
    job = [{"block_size": result["block_size"], "num_blocks": result["num_blocks"], "workloads": specs}]
    theirs = compare_vllm.run_vllm(result["model_path"], job)["engines"][0]["workloads"]
    result["vllm"] = [compare_vllm.compare_workload(w, m, r) for w, m, r in zip(specs, result["mine"], theirs)]
    print("your engine vs real vLLM:")
    _print_comparison(result["vllm"])
    return result


def _print_comparison(compared: list[dict]) -> None:
    def yes(flag: bool) -> str:
        return "yes" if flag else "NO"

    print(f"  {'workload':<26} {'requests':>8}  {'same tokens':>11}  {'same cached tokens':>18}  {'same counters':>13}")
    for w in compared:
        print(
            f"  {w['name']:<26} {len(w['rows']):>8}  {yes(w['tokens_equal']):>11}  {yes(w['cached_equal']):>18}  "
            f"{yes(w['counters_equal']):>13}"
        )


__all__ = [
    "learner_engine",
    "scattered_free_queue",
    "use_parts",
    "course_parts",
    "show_parts",
    "parts_line",
    "compare_with_reference",
    "run_against_reference",
    "against_vllm",
    "compare_observables",
    "PartsTable",
    "LearnerLLM",
    "ENGINE_PARTS",
]
