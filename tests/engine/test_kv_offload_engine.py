"""The offloading tier in the engine (``LLM(kv_offloading_size=...)``): hits come back from it, tokens do not change.

Six 64-token prefixes, each followed by its own 5 tokens, are sent twice,
one at a time, to an engine whose pool (12 blocks of 16 tokens) holds about
one prompt: by the second round the pool has evicted every prefix, and only
the tier still has them. With the tier the second round's prompts hit their
4 prefix blocks there (64 cached tokens each, counted as external hits) and
greedy decoding gives the same tokens as without it; a tier whose loads fail
gives the same tokens too, by recomputing. That the comparison can fail: a
tier that "loads" without copying anything changes the tokens.
"""

from __future__ import annotations

import random

import pytest

from mini_vllm import LLM, SamplingParams
from mini_vllm.config import EngineConfig
from mini_vllm.kv_offload import make_offload_key
from mini_vllm.model import hybrid_model_path
from mini_vllm.request import Request

PREFIX, SUFFIX, NUM_PREFIXES = 64, 5, 6
BLOCK_SIZE = 16
rng = random.Random(0)
PROMPTS = [[rng.randrange(100, 1000) for _ in range(PREFIX + SUFFIX)] for _ in range(NUM_PREFIXES)]
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def make_llm(**settings) -> LLM:
    return LLM(num_blocks=12, block_size=BLOCK_SIZE, max_num_seqs=1, device="cpu", **settings)


def two_rounds(llm: LLM) -> list[tuple[list[int], int]]:
    """Every prompt, one at a time, twice: (greedy tokens, cached tokens) of each."""
    results = []
    for _ in range(2):
        for prompt in PROMPTS:
            output = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
            results.append((list(output.outputs[0].token_ids), output.num_cached_tokens))
    return results


@pytest.fixture(scope="module")
def without_tier():
    return two_rounds(make_llm())


def test_prefixes_evicted_from_the_pool_come_back_from_the_tier(without_tier):
    llm = make_llm(kv_offloading_size=0.01)
    with_tier = two_rounds(llm)
    assert [cached for _, cached in without_tier] == [0] * 12  # the pool alone forgot every prefix
    assert [cached for _, cached in with_tier] == [0] * 6 + [PREFIX] * 6
    assert [tokens for tokens, _ in with_tier] == [tokens for tokens, _ in without_tier]
    stats = llm.llm_engine.scheduler.make_stats()
    assert stats.prefix_cache_stats.hits == 0
    external = stats.connector_prefix_cache_stats
    assert (external.requests, external.queries, external.hits) == (12, 12 * (PREFIX + SUFFIX), 6 * PREFIX)
    # Only prompt blocks are offered (vLLM's offload_prompt_only): 4 full ones per prompt, none of the output.
    connector = llm.llm_engine.scheduler.connector
    resident = connector.manager.resident()
    assert len(resident) == NUM_PREFIXES * (PREFIX // BLOCK_SIZE)
    assert all(ref_cnt == 0 for _, ref_cnt in resident.values())  # every load done, every store complete


def test_a_prompt_the_tier_holds_whole_is_loaded_whole_and_its_last_token_computed_again():
    prompts = [prompt[:PREFIX] for prompt in PROMPTS]  # 4 full blocks, nothing after them
    results = {}
    for tier in (None, 0.01):
        llm = make_llm(kv_offloading_size=tier)
        outputs = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in prompts + prompts]
        results[tier] = [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outputs]
    assert [cached for _, cached in results[0.01]] == [0] * 6 + [PREFIX] * 6  # the pool's hit would be 48
    assert [tokens for tokens, _ in results[0.01]] == [tokens for tokens, _ in results[None]]
    external = llm.llm_engine.scheduler.make_stats().connector_prefix_cache_stats
    assert (external.queries, external.hits) == (12 * PREFIX, 6 * PREFIX)


def test_a_failed_load_is_recomputed(without_tier, monkeypatch):
    llm = make_llm(kv_offloading_size=0.01)
    connector = llm.llm_engine.scheduler.connector
    monkeypatch.setattr(connector, "copy_to_pool", lambda chunk_id, block_id: False)
    results = two_rounds(llm)
    assert [tokens for tokens, _ in results] == [tokens for tokens, _ in without_tier]
    assert [cached for _, cached in results] == [0] * 12  # nothing came from the tier after all
    assert all(ref_cnt == 0 for _, ref_cnt in connector.manager.resident().values())


def test_the_comparison_fails_on_a_tier_that_loads_nothing(without_tier, monkeypatch):
    llm = make_llm(kv_offloading_size=0.01)
    connector = llm.llm_engine.scheduler.connector
    monkeypatch.setattr(connector, "copy_to_pool", lambda chunk_id, block_id: True)  # claims a load it never made
    results = two_rounds(llm)
    assert [tokens for tokens, _ in results] != [tokens for tokens, _ in without_tier]


def test_the_tier_looks_up_along_the_hash_chain_past_the_pools_hit():
    llm = make_llm(kv_offloading_size=0.01)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    connector = engine.scheduler.connector

    def probe(request_id: str, tokens: list[int]) -> Request:
        return Request(request_id, tokens, BLOCK_SIZE, sampling_params=GREEDY, block_hasher=engine.block_hasher)

    same = probe("same", PROMPTS[0])
    assert set(connector.manager.resident()) == {make_offload_key(h, 0) for h in same.block_hashes[:4]}
    # From wherever the pool's hit ends, block by block, up to the last full block (4 of the 69 tokens' 5 blocks).
    assert connector.get_num_new_matched_tokens(same, 2 * BLOCK_SIZE) == 2 * BLOCK_SIZE
    assert connector.get_num_new_matched_tokens(same, 0) == PREFIX
    # One token changed in block 1: from there on every hash differs, although blocks 2 and 3 hold the same tokens.
    changed = probe("changed", PROMPTS[0][:20] + [7] + PROMPTS[0][21:])
    assert connector.get_num_new_matched_tokens(changed, 0) == BLOCK_SIZE
    connector.request_finished(same)
    connector.request_finished(changed)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"kv_offloading_backend": "lmcache"}, "kv_offloading_backend must be 'native'"),
        ({"kv_offloading_size": 0}, "kv_offloading_size must be positive and finite"),
        ({"kv_offloading_size": "1"}, "kv_offloading_size must be a number or None"),
    ],
)
def test_bad_offloading_settings_are_refused_by_name(settings, message):
    with pytest.raises((ValueError, TypeError), match=message):
        EngineConfig(**settings)


def test_a_request_finished_before_its_load_unpins_its_chunks():
    llm = make_llm(kv_offloading_size=0.01)
    engine = llm.llm_engine
    two_rounds(llm)  # every prefix in the tier, none in the pool
    engine.add_request("early", PROMPTS[0], GREEDY)
    engine.scheduler.schedule()  # admitted: its 4 tier blocks pinned, not loaded yet
    connector = engine.scheduler.connector
    assert sorted(ref_cnt for _, ref_cnt in connector.manager.resident().values())[-4:] == [1] * 4
    engine.abort_request("early")
    assert all(ref_cnt == 0 for _, ref_cnt in connector.manager.resident().values())


def test_a_hybrid_model_is_refused_a_tier():
    with pytest.raises(ValueError, match="one KV-cache group, not a hybrid model"):
        LLM(hybrid_model_path(), num_blocks=12, device="cpu", kv_offloading_size=0.01)


def test_a_tier_too_small_for_one_block_is_refused():
    with pytest.raises(ValueError, match="holds no block of this model"):
        make_llm(kv_offloading_size=1e-9)


def test_a_replaced_schedule_waiting_is_refused_a_tier():
    """The tier's lookup is in the engine's own ``schedule_waiting``: with another one (exercise 08's part), the
    engine would build, never read the tier, and recompute every prefix. It refuses instead, naming the part."""
    from mini_vllm.engine_parts import EngineParts
    from mini_vllm.scheduler import Scheduler

    def schedule_waiting(scheduler, token_budget, output):
        return Scheduler.schedule_waiting(scheduler, token_budget, output)

    parts = EngineParts(schedule_waiting=schedule_waiting)
    with pytest.raises(
        ValueError, match=r"kv_offloading_size: .*EngineParts.schedule_waiting \(.*own schedule_waiting"
    ):
        make_llm(kv_offloading_size=0.01, parts=parts)
    make_llm(parts=parts)  # the same part without a tier is fine
    assert make_llm(kv_offloading_size=0.01, parts=EngineParts()).llm_engine.scheduler.connector is not None


ARC = {"kv_connector_extra_config": {"eviction_policy": "arc"}}  # vLLM's spelling (its CPUOffloadingSpec reads it)


def scan_after_a_reuse(**settings) -> list[int]:
    """A prompt ``S`` stored, evicted from the pool, hit in the tier; then four one-off prompts (a scan) through a
    tier of 16 chunks; then ``S`` again: the cached tokens of each request."""
    rng = random.Random(1)
    s, a, b, c, x, y, z, w = ([rng.randrange(100, 1000) for _ in range(PREFIX + SUFFIX)] for _ in range(8))
    tier_of_16_chunks = 16.5 * 64 * 1024 / 2**30  # one chunk: a block of the bundled model, 64 KiB
    llm = make_llm(kv_offloading_size=tier_of_16_chunks, **settings)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    prompts = [s, a, b, c, s, x, y, z, w, s]
    return [llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].num_cached_tokens for p in prompts]


def test_arc_is_chosen_with_vllms_kv_connector_extra_config_and_survives_a_scan():
    from mini_vllm.kv_offload import ARCCachePolicy, LRUCachePolicy

    policy = make_llm(kv_offloading_size=0.01, kv_transfer_config=ARC).llm_engine.scheduler.connector.manager.policy
    assert isinstance(policy, ARCCachePolicy)
    assert isinstance(make_llm(kv_offloading_size=0.01).llm_engine.scheduler.connector.manager.policy, LRUCachePolicy)
    # S's tier hit moved it to ARC's frequency list: the scan evicts the one-off prompts, not S. LRU (the default)
    # evicts S, the least recently used, and the last request computes it again.
    lru = scan_after_a_reuse()
    assert lru == scan_after_a_reuse(kv_transfer_config={"kv_connector_extra_config": {"eviction_policy": "lru"}})
    assert lru == [0, 0, 0, 0, PREFIX, 0, 0, 0, 0, 0]
    assert scan_after_a_reuse(kv_transfer_config=ARC) == [0, 0, 0, 0, PREFIX, 0, 0, 0, 0, PREFIX]


@pytest.mark.parametrize(
    "kv_transfer_config, message",
    [
        ({"kv_connector_extra_config": {"eviction_policy": "lfu"}}, "eviction_policy must be 'lru' or 'arc'"),
        ({"kv_connector_extra_config": {"store_threshold": 2}}, r"key\(s\) \['store_threshold'\] not built here"),
        ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "kv_connector must be 'OffloadingConnector'"),
        ({"kv_port": 14579}, r"\['kv_port'\] not built here"),
        (
            {"kv_load_failure_policy": "fail"},
            r"kv_load_failure_policy must be 'recompute' \(a failed load is recomputed",
        ),
        ({"kv_connector_extra_config": ["arc"]}, "kv_connector_extra_config must be a dict"),
        ('{"kv_connector_extra_config": {}}', "kv_transfer_config must be a dict"),
    ],
)
def test_a_kv_transfer_config_the_tier_cannot_follow_is_refused_by_name(kv_transfer_config, message):
    with pytest.raises((ValueError, TypeError), match=message):
        EngineConfig(kv_offloading_size=0.01, kv_transfer_config=kv_transfer_config)


def test_a_kv_transfer_config_needs_the_tier_and_arc_refuses_a_replaced_lru_evict():
    from mini_vllm.engine_parts import EngineParts
    from mini_vllm.kv_offload.lru import lru_evict

    with pytest.raises(ValueError, match="give kv_offloading_size too"):
        EngineConfig(kv_transfer_config=ARC)
    EngineConfig(
        kv_offloading_size=0.01, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    )
    EngineConfig(kv_offloading_size=0.01, kv_transfer_config={"kv_load_failure_policy": "recompute"})

    def mine(policy, n, protected):
        return lru_evict(policy, n, protected)

    with pytest.raises(ValueError, match=r"replace EngineParts.lru_evict \(the 'arc' policy never calls it"):
        make_llm(kv_offloading_size=0.01, kv_transfer_config=ARC, parts=EngineParts(lru_evict=mine))
    make_llm(kv_offloading_size=0.01, parts=EngineParts(lru_evict=mine))  # LRU runs it
