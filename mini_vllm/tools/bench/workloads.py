"""What the benchmarks send: the prompts of the bundled prompt set, random prompts, vs-vLLM's calls.

Every workload is token ids, so that each engine (mini-vLLM, transformers,
real vLLM) gets the same ones. vLLM's counterpart is ``benchmarks/benchmark_dataset.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ...companions.profiler import common_prefix_length
from ...kv_cache_manager import max_cache_hit_blocks
from ...llm import LLM
from ...model import default_model_path


def _prompt_data() -> dict:
    return json.loads((Path(default_model_path()) / "prompts.json").read_text())


def _chat_ids(llm: LLM, system: str | None, user: str) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return llm.apply_chat_template(messages)


def _random_prompt(rng: random.Random, vocab_size: int, num_tokens: int) -> list[int]:
    """Token ids that share no block with any chat prompt (and, with high odds, with each other)."""
    low = min(100, vocab_size // 10)  # skip the special tokens at the start of most vocabularies
    return [rng.randrange(low, vocab_size) for _ in range(num_tokens)]


# -- benchmark 7, vs real vLLM: the same token ids through both engines --------------------
VS_VLLM_BLOCK_SIZE = 32  # the block size mini_vllm.tools.compare_vllm uses with vLLM on a CPU
VS_VLLM_NUM_BLOCKS = 128


# What each call of a ``ttft`` workload is: a warm-up, one cold request, then warm and fresh in turn.
TTFT_CALLS = ("warm-up", "cold", "warm", "fresh", "warm", "fresh", "warm", "fresh")


def _uncached_tokens(prompt: list[int], earlier: list[list[int]], block_size: int) -> int:
    """How many of ``prompt``'s tokens a prefix cache holding ``earlier`` prompts leaves to compute:
    its longest shared prefix in whole blocks, capped by the last-block rule."""
    shared = max((common_prefix_length(prompt, e) for e in earlier), default=0)
    hit_blocks = min(shared // block_size, max_cache_hit_blocks(len(prompt), block_size))
    return len(prompt) - hit_blocks * block_size


def _vs_vllm_workloads(llm: LLM, rounds: int, max_tokens: int) -> list[dict]:
    """Per round two workloads (each starts from an empty prefix cache, in both engines).

    ``ttft`` (calls named by ``TTFT_CALLS``): a throw-away random prompt, then 4
    requests one by one that share a system prompt: the first is cold (computes
    everything), the next 3 are warm; after each warm one, a *fresh* prompt of
    random tokens exactly as long as what the warm one computes (the cost of
    caching, ``warm / fresh``, as in ``bench_shared_prefix``).
    ``throughput``: 5 requests with that system prompt in one call,
    ``max_tokens`` each (``ignore_eos``): prefill with same-step hits, then a batch of 5 decoding.
    """
    data = _prompt_data()
    system = data["system_prompts"][0]
    vocab_size = llm.llm_engine.model_config.vocab_size
    one_by_one = [_chat_ids(llm, system, user) for user in data["user_requests"][:4]]
    uncached = [_uncached_tokens(p, one_by_one[:i], VS_VLLM_BLOCK_SIZE) for i, p in enumerate(one_by_one)]
    batch = [_chat_ids(llm, system, user) for user in data["user_requests"][6:11]]
    rng = random.Random(3)
    workloads = []
    for r in range(rounds):

        def call(prompts, tokens):
            return {
                "prompts": [{"prompt_token_ids": p} for p in prompts],
                "sampling": {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True},
            }

        warm_up = call([_random_prompt(rng, vocab_size, 64)], 2)
        ttft_calls = [warm_up, call(one_by_one[:1], 8)]
        for prompt, num_new in zip(one_by_one[1:], uncached[1:]):
            ttft_calls += [call([prompt], 8), call([_random_prompt(rng, vocab_size, num_new)], 8)]
        workloads.append({"name": f"ttft_{r}", "calls": ttft_calls})
        workloads.append({"name": f"throughput_{r}", "calls": [warm_up, call(batch, max_tokens)]})
    return workloads
