"""mini-vLLM's side of a comparison: the workloads through an ``LLM`` in this process.

It resolves each call's prompts with the very code vLLM's side runs
(``vllm_side/run_vllm.py``'s ``call_prompts``), and reads the prefix-cache
counters from ``LLMEngine.get_stats()`` before and after each workload, as
vLLM's side reads ``vllm:prefix_cache_queries`` / ``_hits``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..vllm_side.run_vllm import call_prompts, resolve_prompt
from .workloads import CACHE_SETTINGS, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, engine_max_model_len

if TYPE_CHECKING:  # torch and the engine load only when mini-vLLM runs
    from ...llm import LLM

_resolve_prompt = resolve_prompt  # the rule for a chat turn: one definition, shared with vLLM's side


def run_mini_workloads(llm, workloads: list[dict]) -> list[dict]:
    """Run every workload on one mini-vLLM ``LLM``, each from a cold prefix cache."""
    from ...sampling_params import SamplingParams

    engine = llm.llm_engine
    results = []
    for workload in workloads:
        if not llm.reset_prefix_cache():
            raise RuntimeError("mini-vLLM refused to reset its prefix cache")
        before = engine.get_stats()
        requests, elapsed, previous, generated = [], 0.0, None, 0
        for call_index, call in enumerate(workload["calls"]):
            params = SamplingParams(**call["sampling"])
            prompts = call_prompts(call, previous)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            elapsed += time.perf_counter() - start
            previous = (list(outputs[-1].prompt_token_ids), list(outputs[-1].outputs[0].token_ids))
            for index, output in enumerate(outputs):
                generated += sum(len(c.token_ids) for c in output.outputs)
                request = {
                    "call": call_index,
                    "index": index,
                    "num_prompt_tokens": len(output.prompt_token_ids),
                    "num_cached_tokens": output.num_cached_tokens,
                    "token_ids": [list(c.token_ids) for c in output.outputs],
                    "ttft_s": output.metrics.time_to_first_token if output.metrics else None,
                }
                if params.logprobs is not None:  # each generated token's, as run_vllm.py reports vLLM's
                    request["logprobs"] = [
                        [position[token].logprob for token, position in zip(c.token_ids, c.logprobs)]
                        for c in output.outputs
                    ]
                requests.append(request)
        after = engine.get_stats()
        results.append(
            {
                "name": workload["name"],
                "requests": requests,
                "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
                "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
                "num_preemptions": after.num_preemptions - before.num_preemptions,
                "num_evictions": after.num_evictions - before.num_evictions,
                "num_generated_tokens": generated,
                "elapsed_s": elapsed,
            }
        )
    return results


def run_mini(
    model_path: str | None,
    engines: list[dict],
    dtype: str = "float32",
    threads: int = 1,
    attention_backend: str = "auto",
    engine: Callable[..., LLM] | None = None,
) -> list[dict]:
    """mini-vLLM's side: one engine per spec (``block_size``, ``num_blocks``, ``workloads``), built by
    ``engine``: ``LLM`` (None), or anything called like it (``mini_vllm.course.learner_engine``)."""
    import torch

    from ...llm import LLM

    engine = engine or LLM

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for spec in engines:
            llm = engine(
                spec.get("model", model_path),
                device="cpu",
                dtype=dtype,
                block_size=spec["block_size"],
                num_blocks=spec["num_blocks"],
                max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                max_model_len=spec.get("max_model_len") or engine_max_model_len(spec["block_size"], spec["num_blocks"]),
                attention_backend=attention_backend,
                **{name: spec[name] for name in CACHE_SETTINGS if name in spec},
            )
            results.append(
                {
                    "block_size": spec["block_size"],
                    "num_blocks": spec["num_blocks"],
                    "workloads": run_mini_workloads(llm, spec["workloads"]),
                }
            )
        return results
    finally:
        torch.set_num_threads(saved_threads)
