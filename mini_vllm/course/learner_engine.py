"""The learner's own engine: an ``LLM`` made of the learner's passing parts, the reference elsewhere.

    >>> from mini_vllm.course import learner_engine, show_parts
    >>> llm = learner_engine(device="cpu", num_blocks=64)   # every part you have kept so far
    >>> show_parts(llm)                                     # which parts are yours

The engine core knows nothing of the course: each part goes in through a
seam the engine already has, on this one ``LLM`` only —

* objects the engine owns are replaced or given an instance attribute:
  ``block_pool.free_block_queue`` (chapter 02), ``kv_cache_manager.find_longest_cache_hit``
  (05), ``block_pool.free_blocks`` / ``get_new_blocks`` and ``kv_cache_manager.free`` (06),
  the attention backend of every layer (07), ``scheduler.schedule_waiting`` (08, the method
  the exercise writes);
* two module-level functions (``model_runner.compute_slot_mapping``, 03, and
  ``request.hash_new_full_blocks``, 04) are swapped only while this engine
  runs (its ``add_request``/``step`` and the ``LLM`` calls around them), then
  restored, so a reference ``LLM`` in the same process is untouched.

``llm.course_parts`` maps every part to ``"yours"`` or ``"reference"`` (the
dashboard and :func:`show_parts` read it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from ..llm import LLM
from .parts import PARTS, learner_parts

ENGINE_PARTS = [part.key for part in PARTS if part.in_engine]
"""The parts that go into the engine (``build_messages`` shapes the prompts a client sends instead)."""


def learner_engine(model: str | None = None, *, parts: dict[str, Any] | None = None, **llm_kwargs) -> LLM:
    """An ``LLM(model, **llm_kwargs)`` running the learner's parts.

    ``parts``: part key -> implementation (default: every part kept in the
    parts folder, :func:`mini_vllm.course.parts.learner_parts`). ``{}`` gives
    the reference engine, marked as such.
    """
    llm = LLM(model, **llm_kwargs)
    use_parts(llm, learner_parts() if parts is None else parts)
    return llm


def use_parts(llm: LLM, parts: dict[str, Any]) -> dict[str, str]:
    """Plug ``parts`` into a fresh ``llm`` (before any request); returns and sets ``llm.course_parts``."""
    unknown = sorted(set(parts) - {part.key for part in PARTS})
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; the engine's parts are {ENGINE_PARTS}")
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise ValueError("use_parts needs an engine with no request in flight")
    manager = engine.kv_cache_manager
    pool = manager.block_pool
    scheduler = engine.scheduler

    if "free_queue" in parts:
        queue = parts["free_queue"](list(pool.free_block_queue.get_all_free_blocks()))
        pool.free_block_queue = queue if _has_batch_operations(queue) else _BatchOperations(queue)
    if "find_longest_cache_hit" in parts:
        lookup = parts["find_longest_cache_hit"]
        manager.find_longest_cache_hit = lambda block_hashes, max_num_blocks: lookup(pool, block_hashes, max_num_blocks)
    if "free_blocks" in parts:
        free_blocks = parts["free_blocks"]
        pool.free_blocks = lambda ordered_blocks: free_blocks(pool, ordered_blocks)
    if "free_request_blocks" in parts:
        manager.free = _free_with(manager, parts["free_request_blocks"])
    if "get_new_blocks" in parts:
        get_new_blocks = parts["get_new_blocks"]
        pool.get_new_blocks = lambda num_blocks: get_new_blocks(pool, num_blocks)
    if "store_kv" in parts or "paged_decode" in parts:
        from .kernel_checks import use_attention_backend

        use_attention_backend(llm, _learner_backend(parts.get("store_kv"), parts.get("paged_decode")))
    if "schedule_waiting" in parts:
        scheduler.schedule_waiting = functools.partial(parts["schedule_waiting"], scheduler)
    swapped = _module_swaps(parts, engine.config.hash_algo)
    if swapped:
        _run_with_swaps(llm, swapped)
    llm.course_parts = {key: ("yours" if key in parts else "reference") for key in ENGINE_PARTS}
    return llm.course_parts


_BATCH_OPERATIONS = ("popleft_n", "append_n", "prepend_n", "__len__")


def _has_batch_operations(queue: Any) -> bool:
    return all(hasattr(queue, name) for name in _BATCH_OPERATIONS)


class _BatchOperations:
    """The learner's queue plus the batch operations ``BlockPool`` calls, built on the learner's methods.

    (The chapter 02 exercise gives these; a queue written without them still runs.)
    """

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)

    @property
    def num_free_blocks(self) -> int:
        return self.queue.num_free_blocks

    def popleft_n(self, n: int) -> list:
        if n > self.queue.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.queue.num_free_blocks} are free")
        return [self.queue.popleft() for _ in range(n)]

    def append_n(self, blocks) -> None:
        for block in blocks:
            self.queue.append(block)

    def prepend_n(self, blocks) -> None:  # blocks[0] becomes the head
        for block in reversed(list(blocks)):
            self.queue.appendleft(block)

    def __len__(self) -> int:
        return self.queue.num_free_blocks


def _free_with(manager: Any, free_request_blocks: Callable) -> Callable:
    """``KVCacheManager.free`` with the learner's ``free_request_blocks`` at its heart (as in chapter 06)."""

    def free(request) -> None:
        req_blocks = manager.req_to_blocks.pop(request.request_id, [])
        manager.num_cached_block.pop(request.request_id, None)
        free_request_blocks(manager.block_pool, req_blocks)

    return free


def _learner_backend(store_kv: Callable | None, paged_decode: Callable | None):
    """The torch reference backend with the learner's kernel and decode loop where given (chapter 07)."""
    from ..attention import TorchAttentionBackend

    yours = [label for label, fn in (("store_kv", store_kv), ("paged_decode", paged_decode)) if fn is not None]

    class LearnerBackend(TorchAttentionBackend):
        name = "torch, with your " + " and ".join(yours)

        def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
            if store_kv is None:
                return super().store_kv(key, value, k_cache, v_cache, slot_mapping)
            store_kv(key, value, k_cache, v_cache, slot_mapping)

        def attention(self, query, k_cache, v_cache, metadata, scale):
            if paged_decode is None or metadata.max_query_len > 1:  # prefill: the reference
                return super().attention(query, k_cache, v_cache, metadata, scale)
            import torch

            outputs = [
                paged_decode(query[s], k_cache, v_cache, metadata.block_tables[s], int(metadata.seq_lens[s]), scale)
                for s in range(metadata.num_seqs)
            ]
            return torch.stack(outputs)

    return LearnerBackend()


def _module_swaps(parts: dict[str, Any], hash_algo: str) -> list[tuple[Any, str, Any]]:
    """(module, name, replacement) for the parts that enter through a module-level function."""
    from .. import model_runner, request

    swaps = []
    if "slot_mapping" in parts:
        swaps.append((model_runner, "compute_slot_mapping", parts["slot_mapping"]))
    hashing_part = parts.get("hash_request_tokens") or parts.get("hash_block_tokens")
    if hashing_part is not None and hash_algo == "sha256":  # the exercise writes SHA-256 hashes
        swaps.append((request, "hash_new_full_blocks", _hash_new_full_blocks_with(parts)))
    return swaps


def _hash_new_full_blocks_with(parts: dict[str, Any]) -> Callable:
    """``hashing.hash_new_full_blocks`` computed with the learner's hash functions."""
    from ..hashing import block_extra_keys

    hash_request_tokens = parts.get("hash_request_tokens")
    hash_block_tokens = parts.get("hash_block_tokens")

    def hash_new_full_blocks(
        token_ids, block_size, block_hashes, cache_salt=None, lora_name=None, hash_fn=None, lora_path=None
    ):
        if hash_request_tokens is not None and lora_path is None:
            return list(hash_request_tokens(list(token_ids), block_size, cache_salt, lora_name))[len(block_hashes) :]
        parent = block_hashes[-1] if block_hashes else None
        new = []
        for index in range(len(block_hashes), len(token_ids) // block_size):
            block = list(token_ids[index * block_size : (index + 1) * block_size])
            parent = hash_block_tokens(parent, block, block_extra_keys(index, cache_salt, lora_name, lora_path))
            new.append(parent)
        return new

    return hash_new_full_blocks


def _run_with_swaps(llm: LLM, swaps: list[tuple[Any, str, Any]]) -> None:
    """Wrap this engine's entry points so the module-level swaps hold only while it runs."""
    depth = [0]
    originals: list[Any] = []

    @contextlib.contextmanager
    def swapped():
        if depth[0] == 0:
            originals[:] = [getattr(module, name) for module, name, _ in swaps]
            for module, name, replacement in swaps:
                setattr(module, name, replacement)
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                for (module, name, _), original in zip(swaps, originals):
                    setattr(module, name, original)

    def wrap(owner: Any, method_name: str) -> None:
        method = getattr(owner, method_name, None)
        if method is None:
            return

        @functools.wraps(method)
        def run(*args, **kwargs):
            with swapped():
                return method(*args, **kwargs)

        setattr(owner, method_name, run)

    for method_name in ("add_request", "add_validated_request", "step", "abort_request"):
        wrap(llm.llm_engine, method_name)
    for method_name in ("generate", "chat"):
        wrap(llm, method_name)


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
        lines = [f"{'ch':<3} {'part':<24} {'whose':<10} role"]
        lines += [f"{ch:<3} {name:<24} {who:<10} {role}" for ch, name, role, who in self.rows()]
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


def show_parts(llm: LLM | None = None) -> PartsTable:
    """The parts of ``llm`` (or, without one, of the engine :func:`learner_engine` would build now)."""
    if llm is not None and hasattr(llm, "course_parts"):
        return PartsTable(llm.course_parts)
    kept = learner_parts() if llm is None else {}
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

    The workloads are :mod:`mini_vllm.compare_vllm`'s (a shared system prompt,
    a multi-turn chat, n > 1, eviction and preemption, cache salts, ...), from
    a cold cache each. Both mini-vLLM engines run in this process, built
    alike. Prints one line per workload and returns ``{"parts", "reference",
    "vllm", "vllm_missing", ...}``: ``reference`` (and ``vllm``) hold
    :func:`mini_vllm.compare_vllm.compare_workload` results. ``with_vllm``
    also runs :func:`against_vllm` (or call it later with the result).
    """
    from transformers import AutoTokenizer

    from .. import compare_vllm
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
        f"running {len(specs)} workload(s) on your engine, then on the reference (about 10 s each on a laptop CPU) ..."
    )
    mine_llm = learner_engine(model, parts=parts, **engine_args)
    reference_llm = LLM(model, **engine_args)
    mine_events, reference_events = _record_cache_events(mine_llm), _record_cache_events(reference_llm)
    mine = compare_vllm.run_mini_workloads(mine_llm, specs)
    reference = compare_vllm.run_mini_workloads(reference_llm, specs)
    result: dict[str, Any] = {
        "parts": dict(mine_llm.course_parts),
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
    from .. import compare_vllm

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
    "use_parts",
    "show_parts",
    "compare_with_reference",
    "run_against_reference",
    "against_vllm",
    "compare_observables",
    "PartsTable",
    "ENGINE_PARTS",
]
