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
What a learner reads when a part fails in the engine is
:mod:`mini_vllm.course.learner_errors`'s; the comparisons with the reference
and with real vLLM are :mod:`mini_vllm.course.comparisons`. vLLM has no
counterpart: its engine takes no replacement parts.
"""

from __future__ import annotations

import random
from typing import Any

from ..engine_parts import EngineParts
from ..llm import LLM
from .learner_errors import explained, is_a_part_error, part_error, recording_errors
from .parts import PARTS, PARTS_BY_KEY, _is_learners, kept_parts, learner_parts

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
    same way, with the same note. An engine stalled by lost blocks, or an error
    of the engine's own code in a step that ran the learner's parts, gets a note
    naming those parts and their checks (:mod:`mini_vllm.course.learner_errors`).
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
        except Exception as error:
            # A part the scheduler calls (a lookup, an allocation) stops the step: LLM.generate aborts the
            # call's requests before its error arrives here. Any other error: explained, or as it is.
            if not is_a_part_error(error, self.part_errors):
                noted = explained(error, self.course_parts)
                if noted is None:
                    raise
                raise noted
        if self.part_errors:
            raise part_error(self.part_errors)
        return outputs


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
    if parts is None:
        _leave_out_what_the_tier_replaces(chosen, mine or {}, llm_kwargs)
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


def _leave_out_what_the_tier_replaces(chosen: dict[str, Any], mine: dict[str, Any], llm_kwargs: dict) -> None:
    """Drop the kept parts an engine with an offloading tier cannot run (``EngineParts.unusable_with_offloading``:
    ``LLMEngine`` refuses them), with a line saying so, unless the notebook at hand gives them as ``mine``."""
    config = llm_kwargs.get("config")
    size = llm_kwargs.get("kv_offloading_size", getattr(config, "kv_offloading_size", None))
    if not size:
        return
    from ..kv_offload.spec import eviction_policy

    transfer = llm_kwargs.get("kv_transfer_config", getattr(config, "kv_transfer_config", None))
    kept = EngineParts(**{key: fn for key, fn in chosen.items() if key not in mine and key in ENGINE_PARTS})
    for key, why in kept.unusable_with_offloading(eviction_policy(transfer)).items():
        del chosen[key]
        print(f"  note: your {PARTS_BY_KEY[key].name} stays out of this engine with an offloading tier: {why}")


def _triton_interpreted() -> bool:
    """True where Triton runs its kernels in its interpreter (no GPU): ``mini_vllm.kernels.TRITON_INTERPRETED``."""
    from mini_vllm import kernels  # first: sets TRITON_INTERPRET=1 on a machine without a GPU

    return kernels.TRITON_INTERPRETED


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
        given = {key: fn if fn is getattr(own, key) else recording_errors(errors, key, fn) for key, fn in given.items()}
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
    raise TypeError(
        f"{type(engine_or_llm).__name__} holds no engine: pass an LLM (learner_engine(...)) or an LLMEngine"
    )


# -- showing the parts -----------------------------------------------------------------
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
