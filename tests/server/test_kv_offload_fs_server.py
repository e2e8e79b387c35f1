"""``/metrics`` and ``usage`` with a file-system tier: a new engine's disk hits are external hits, as in vLLM.

One engine writes three prompts through its CPU tier to disk; a second
engine on the same ``root_dir`` (a new CPU tier, an empty pool) is served.
Each reply reports its 64 prefix tokens as ``cached_tokens``, and ``/metrics``
counts them in ``vllm:external_prefix_cache_hits`` (vLLM: a disk hit is
promoted into the CPU tier, then loaded from there as any external hit), not
in the pool's ``vllm:prefix_cache_hits``.
"""

from __future__ import annotations

import random

from openai import OpenAI

from mini_vllm import LLM
from mini_vllm.entrypoints.openai.api_server import BackgroundServer
from test_kv_offloading_server import metric_values

MODEL = "mini-vllm"
PREFIX, SUFFIX, BLOCK_SIZE = 64, 5, 16
rng = random.Random(2)
PROMPTS = [[rng.randrange(100, 1000) for _ in range(PREFIX + SUFFIX)] for _ in range(3)]


def make_llm(root_dir) -> LLM:
    tiers = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [{"type": "fs", "root_dir": str(root_dir)}]}
    return LLM(
        num_blocks=12,
        block_size=BLOCK_SIZE,
        max_num_seqs=1,
        device="cpu",
        kv_offloading_size=0.01,
        kv_transfer_config={"kv_connector_extra_config": tiers},
    )


def test_disk_hits_are_cached_tokens_and_external_hits_in_metrics(tmp_path):
    writer = make_llm(tmp_path)
    for prompt in PROMPTS:
        writer.generate([{"prompt_token_ids": prompt}], use_tqdm=False)
    with BackgroundServer(make_llm(tmp_path), served_model_name=MODEL) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        cached = [
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=2, temperature=0
            ).usage.prompt_tokens_details.cached_tokens
            for prompt in PROMPTS
        ]
        metrics = metric_values(server.url)
    assert cached == [PREFIX] * 3
    assert metrics["vllm:external_prefix_cache_queries_total"] == 3 * (PREFIX + SUFFIX)
    assert metrics["vllm:external_prefix_cache_hits_total"] == 3 * PREFIX
    assert metrics["vllm:prefix_cache_hits_total"] == 0
