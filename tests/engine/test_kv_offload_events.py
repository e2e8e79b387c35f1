"""The offloading tier's events reach the engine's listeners, with their medium, as vLLM's OffloadingConnector's.

The pool's ``BlockStored`` / ``BlockRemoved`` say ``medium="GPU"``; the
tier's say ``"CPU"``, in vLLM's default payload (one hash per stored block,
no tokens; one removal per eviction). Four 69-token prompts (4 full blocks
each) are sent one at a time to a pool of 12 blocks over a tier of 8 chunks:
the tier stores each prompt's 4 blocks after the pool has cached them, and
from the third prompt on evicts the oldest prompt's 4 to make room.
"""

from __future__ import annotations

import random

import pytest

from mini_vllm import LLM, SamplingParams
from mini_vllm.events import BlockRemoved, BlockStored
from mini_vllm.hashing import hash_request_tokens

BLOCK_SIZE, NUM_BLOCKS_PER_PROMPT = 16, 4
rng = random.Random(1)
PROMPTS = [[rng.randrange(100, 1000) for _ in range(NUM_BLOCKS_PER_PROMPT * BLOCK_SIZE + 5)] for _ in range(4)]
GREEDY = SamplingParams(max_tokens=2, temperature=0)
EIGHT_CHUNKS = 8 * 2**16 / 2**30  # GiB: one chunk holds one block of the bundled model, 64 KiB


def run(prompts, kv_offloading_size: float = EIGHT_CHUNKS, listen: bool = True):
    llm = LLM(num_blocks=12, block_size=BLOCK_SIZE, max_num_seqs=1, device="cpu", kv_offloading_size=kv_offloading_size)
    events = []
    if listen:
        llm.llm_engine.add_listener(events.append)
    outputs = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in prompts]
    return llm, [e for e in events if isinstance(e, (BlockStored, BlockRemoved))], outputs


def hashes(events, kind, medium):
    return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


def test_the_tier_stores_what_the_pool_cached_and_evicts_its_oldest_with_medium_cpu():
    llm, events, _ = run(PROMPTS)
    assert llm.llm_engine.scheduler.connector.manager.num_chunks == 8
    prompt_hashes = [list(hash_request_tokens(p, BLOCK_SIZE)) for p in PROMPTS]
    assert hashes(events, BlockStored, "CPU") == [h for hs in prompt_hashes for h in hs]
    # vLLM's default payload: one hash, no tokens, no parent, no pool block ids.
    stored_cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert all((e.token_ids, e.block_size, e.parent_block_hash, e.block_ids) == ((), 0, None, ()) for e in stored_cpu)
    assert all(len(e.block_hashes) == 1 for e in stored_cpu)
    # 8 chunks: the third prompt evicts the first's 4 blocks, the fourth the second's, one event each,
    # the tail of a prefix first (as the pool evicts: a prefix's head is worth more than its tail).
    removed_cpu = [list(e.block_hashes) for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert removed_cpu == [prompt_hashes[0][::-1], prompt_hashes[1][::-1]]
    # Each block reaches the tier after the pool cached it.
    for block_hash in hashes(events, BlockStored, "CPU"):
        gpu_at = next(i for i, e in enumerate(events) if e.medium == "GPU" and block_hash in e.block_hashes)
        cpu_at = next(i for i, e in enumerate(events) if e.medium == "CPU" and block_hash in e.block_hashes)
        assert gpu_at < cpu_at
    assert all(e.medium in ("GPU", "CPU") for e in events)


def test_a_block_goes_down_to_the_tier_and_comes_back_to_the_pool():
    """Prompt 0 again after three others: the pool evicted it (GPU removals), the tier kept it; its load caches it in the pool again
    (GPU stores of the same hashes), and the tier announces nothing new (it still holds those blocks)."""
    llm, events, outputs = run(PROMPTS + PROMPTS[:1], kv_offloading_size=0.01)
    first = list(hash_request_tokens(PROMPTS[0], BLOCK_SIZE))
    assert outputs[-1].num_cached_tokens == NUM_BLOCKS_PER_PROMPT * BLOCK_SIZE
    assert hashes(events, BlockStored, "CPU").count(first[0]) == 1
    assert [h for h in hashes(events, BlockRemoved, "GPU") if h in first] == first[::-1]  # gone from the pool
    assert [h for h in hashes(events, BlockStored, "GPU") if h in first] == first + first  # and back
    assert hashes(events, BlockRemoved, "CPU") == []


@pytest.mark.parametrize("listen", [False, True])
def test_the_tier_records_events_only_while_someone_listens(listen):
    llm, _, _ = run(PROMPTS[:1], listen=listen)
    manager = llm.llm_engine.scheduler.connector.manager
    assert (manager.events is not None) == listen
    if listen:
        assert manager.events == []  # every one was passed on at the end of its step
