"""KV-cache offloading measured: the hit rate against pool size with and without the tier, and a tier hit's cost.

Two measurements, each on engines built side by side in one run:

* ``hit_rates``: a workload whose prefixes do not fit the pool (``num_prefixes``
  prompts, each a prefix of its own and a few tokens after it, sent round
  after round, one at a time). For each pool size, the share of prompt tokens
  that were not computed: the pool's hits alone, and with a tier the pool's
  plus the tier's (``connector_prefix_cache_stats``). Counts, no timing: the
  same on every machine.
* ``load_vs_recompute``: the cost of one request whose prefix the pool has
  evicted, timed three ways in each round on the same tokens: a *miss*
  (no tier: the prefix is computed again), a *tier hit* (its blocks copied
  back into the pool before the forward pass) and, for scale, a *pool hit*
  (the same request once more on the engine without a tier, its prefix in
  the pool since the miss). The engines
  take turns going first; each round gives ratios, reported as the median
  over rounds with their range.

``benchmarks/kv_offloading.py`` runs both and writes a JSON file; chapter
06c runs them live at a small size.

vLLM equivalent: none in vLLM's tree; vLLM's ``benchmarks/`` measure its
offloading with ``benchmark_serving`` against a GPU.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..llm import LLM
from ..sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def prefix_workload(num_prefixes: int, prefix_len: int, suffix_len: int, num_rounds: int, seed: int = 0):
    """``num_rounds`` rounds of ``num_prefixes`` prompts: each a prefix of its own, then fresh tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 1000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        prefix + [rng.randrange(100, 1000) for _ in range(suffix_len)] for _ in range(num_rounds) for prefix in prefixes
    ]


@dataclass(frozen=True)
class HitRateRow:
    """One pool size: the share of prompt tokens not computed, without and with the tier."""

    num_blocks: int
    hit_rate_pool: float  # no tier: the pool's hits / prompt tokens
    hit_rate_with_tier: float  # with a tier: (the pool's hits + the tier's) / prompt tokens
    tier_share: float  # with a tier: the tier's hits / prompt tokens


def _run_one_at_a_time(llm: LLM, prompts: Sequence[Sequence[int]]) -> None:
    for prompt in prompts:
        llm.generate([{"prompt_token_ids": list(prompt)}], ONE_TOKEN, use_tqdm=False)


def hit_rates(
    prompts: Sequence[Sequence[int]],
    pool_sizes: Sequence[int],
    block_size: int = 16,
    kv_offloading_size: float = 0.01,
    **settings,
) -> list[HitRateRow]:
    """For each pool size, ``prompts`` one at a time through an engine without a tier and one with."""
    rows = []
    for num_blocks in pool_sizes:
        rates = []
        for tier in (None, kv_offloading_size):
            llm = LLM(num_blocks=num_blocks, block_size=block_size, kv_offloading_size=tier, **settings)
            _run_one_at_a_time(llm, prompts)
            stats = llm.llm_engine.scheduler.make_stats()
            external = stats.connector_prefix_cache_stats
            tier_hits = external.hits if external is not None else 0
            queries = stats.prefix_cache_stats.queries
            rates.append(((stats.prefix_cache_stats.hits + tier_hits) / queries, tier_hits / queries))
        rows.append(HitRateRow(num_blocks, rates[0][0], rates[1][0], rates[1][1]))
    return rows


def _timed(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    output = llm.generate([{"prompt_token_ids": prompt}], ONE_TOKEN, use_tqdm=False)[0]
    return time.perf_counter() - start, output.num_cached_tokens


def load_vs_recompute(
    prefix_len: int = 512,
    suffix_len: int = 16,
    num_rounds: int = 7,
    block_size: int = 16,
    seed: int = 0,
    **settings,
) -> dict:
    """Per round, a new prefix: stored, evicted from the pool by a filler, then timed as a miss (no tier), a tier hit,
    and a pool hit. Ratios per round (miss / tier hit, tier hit / pool hit), their median and range."""
    # A pool a little larger than one prompt, and a filler as large as the pool: it takes every block the prompt
    # had cached.
    num_blocks = -(-(prefix_len + suffix_len) // block_size) + 2
    filler_len = num_blocks * block_size - block_size // 2
    engines = {
        "miss": LLM(num_blocks=num_blocks, block_size=block_size, **settings),
        "tier": LLM(num_blocks=num_blocks, block_size=block_size, kv_offloading_size=0.05, **settings),
    }
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(n)]

    warm = tokens(prefix_len + suffix_len)
    for llm in engines.values():  # the first forward passes of an engine are slower: not timed
        _run_one_at_a_time(llm, [warm, warm])
    rounds = []
    for index in range(num_rounds):
        prompt, filler = tokens(prefix_len + suffix_len), tokens(filler_len)
        times, cached = {}, {}
        order = ("miss", "tier") if index % 2 == 0 else ("tier", "miss")
        for name in order:
            llm = engines[name]
            _run_one_at_a_time(llm, [prompt, filler])  # stored (in the tier, if any), then evicted from the pool
            times[name], cached[name] = _timed(llm, prompt)
        times["pool"], cached["pool"] = _timed(engines["miss"], prompt)  # computed just now: in the pool
        rounds.append({"times_s": times, "cached_tokens": cached})
    miss_over_tier = [r["times_s"]["miss"] / r["times_s"]["tier"] for r in rounds]
    tier_over_pool = [r["times_s"]["tier"] / r["times_s"]["pool"] for r in rounds]
    return {
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "num_rounds": num_rounds,
        "cached_tokens": rounds[0]["cached_tokens"],  # the same in every round
        "miss_over_tier_hit": statistics.median(miss_over_tier),
        "miss_over_tier_hit_range": (min(miss_over_tier), max(miss_over_tier)),
        "tier_hit_over_pool_hit": statistics.median(tier_over_pool),
        "tier_hit_over_pool_hit_range": (min(tier_over_pool), max(tier_over_pool)),
        "rounds": rounds,
    }
