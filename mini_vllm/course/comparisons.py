"""The learner's engine next to the reference's, and next to real vLLM: what must agree, side by side.

    >>> from mini_vllm.course import run_against_reference, against_vllm
    >>> result = run_against_reference()   # the workloads of mini_vllm.tools.compare_vllm, on both engines
    >>> against_vllm(result)                # the same workloads through real vLLM (make vllm)

:func:`compare_with_reference` runs one workload of the caller's on two
engines built alike; :func:`run_against_reference` runs the comparison
workloads (a shared system prompt, a multi-turn chat, n > 1, eviction and
preemption, cache salts, ...) and also compares what the engine lets anyone
observe besides tokens and hits (:func:`compare_observables`: evictions,
preemptions, the KV-cache event stream, the free queue's final order);
:func:`against_vllm` adds real vLLM. vLLM's counterpart is its own test
suite's comparisons between engine configurations (``tests/v1/e2e``).
"""

from __future__ import annotations

import time
from typing import Any

from ..llm import LLM
from ._harness import _short
from .learner_engine import course_parts, learner_engine


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
        "and on the reference, one at a time (each one's time shows as it goes):"
    )
    mine_llm = learner_engine(model, parts=parts, kernels=True, **engine_args)  # every part, the kernels too
    reference_llm = LLM(model, **engine_args)
    mine_events, reference_events = _record_cache_events(mine_llm), _record_cache_events(reference_llm)
    mine, reference = [], []
    for index, spec in enumerate(specs, start=1):  # one workload at a time on both, so progress shows as it goes
        start = time.perf_counter()
        mine += compare_vllm.run_mini_workloads(mine_llm, [spec])
        reference += compare_vllm.run_mini_workloads(reference_llm, [spec])
        took = time.perf_counter() - start
        print(f"  [{index}/{len(specs)}] {spec['name']}: done on both in {took:.1f} s", flush=True)
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
