"""A random, invariant-checked soak of the engine: thousands of requests through a tight
pool, with shared prefixes, two tenants, n > 1 with seeds, aborts, failed and interrupted steps.

The model step is replaced by a cheap fake that keeps the *contents* of the
KV cache as (cache_salt, position, token id) per slot, written the way the
real forward pass writes K/V. Every prefix-cache hit is checked against it: a
hit block must hold exactly the hitting request's tokens, of its tenant. A
failing step writes only part of its slots before it raises, as a forward
pass that dies in a middle layer would. After every step the KV-cache
manager's and the scheduler's invariants are checked; at the end nothing may
be left allocated.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_invariants import assert_nothing_leaked

from mini_vllm import LLM, SamplingParams
from mini_vllm.events import ComputedBlocksFound
from mini_vllm.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 16


class FakeModelStep:
    """Stands in for ``ModelRunner.execute_model``: writes the simulated K/V, returns random logits."""

    def __init__(self, engine, seed: int):
        self.engine = engine
        self.vocab_size = engine.model_config.vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.memory: dict[int, tuple] = {}  # slot -> (cache_salt, position, token id)
        self.pending_hits: list[tuple[str, tuple[int, ...]]] = []
        self.fail_next: BaseException | None = None
        self.num_hits_checked = 0
        self.violations: list[str] = []  # recorded, not raised: the engine would catch an exception here
        engine.add_listener(self.listen)

    def listen(self, event) -> None:
        if isinstance(event, ComputedBlocksFound) and event.block_ids:
            self.pending_hits.append((event.request_id, event.block_ids))

    def execute_model(self, scheduler_output):
        hits, self.pending_hits = self.pending_hits, []  # the hits made while scheduling this step
        writes = []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            for position in range(
                scheduled.num_computed_tokens, scheduled.num_computed_tokens + scheduled.num_new_tokens
            ):
                block_id = scheduled.block_ids[0][position // BLOCK_SIZE]
                slot = block_id * BLOCK_SIZE + position % BLOCK_SIZE
                writes.append((slot, (request.cache_salt, position, request.all_token_ids[position])))
        error, self.fail_next = self.fail_next, None
        if error is not None:
            for slot, content in writes[: self.rng.randrange(len(writes) + 1)]:  # a partial write
                self.memory[slot] = content
            raise error
        for slot, content in writes:
            self.memory[slot] = content
        # Attention reads the hit blocks after every new K/V of the step is written (same-step hits too).
        for request_id, block_ids in hits:
            request = self.engine.requests[request_id]
            for index, block_id in enumerate(block_ids):
                for offset in range(BLOCK_SIZE):
                    position = index * BLOCK_SIZE + offset
                    expected = (request.cache_salt, position, request.all_token_ids[position])
                    found = self.memory.get(block_id * BLOCK_SIZE + offset)
                    if found != expected:
                        self.violations.append(
                            f"{request_id} hit block {block_id}, whose slot {offset} holds {found}, not {expected}"
                        )
                self.num_hits_checked += 1
        return torch.randn(len(scheduler_output.scheduled), self.vocab_size, generator=self.generator)


def check_scheduler_invariants(engine) -> None:
    scheduler, manager = engine.scheduler, engine.kv_cache_manager
    waiting = [r.request_id for r in scheduler.waiting]
    running = [r.request_id for r in scheduler.running]
    assert len(set(waiting)) == len(waiting) and len(set(running)) == len(running)
    assert not set(waiting) & set(running)
    assert set(waiting) | set(running) == set(engine.requests)
    assert all(r.metrics is not None and r.generator is not None for r in engine.requests.values())
    for request in scheduler.waiting:
        assert request.request_id not in manager.req_to_blocks, f"waiting {request.request_id} holds blocks"
    for request in scheduler.running:
        assert 0 < request.num_computed_tokens <= request.num_tokens
        assert len(manager.req_to_blocks[request.request_id]) * BLOCK_SIZE >= request.num_computed_tokens


def run_soak(seed: int, num_requests: int, monkeypatch_target=None) -> dict:
    rng = random.Random(seed)
    llm = LLM(num_blocks=20, device="cpu", max_num_seqs=8, max_num_batched_tokens=96)
    engine = llm.llm_engine
    fake = FakeModelStep(engine, seed)
    engine.model_runner.execute_model = fake.execute_model
    vocab = engine.model_config.vocab_size
    prefixes = [[rng.randrange(1, vocab) for _ in range(length)] for length in (40, 64, 100)]
    counts = {"added": 0, "refused": 0, "aborted": 0, "interrupted_steps": 0, "errors": 0}

    def random_request():
        prefix = rng.choice(prefixes)[: rng.randrange(1, 101)]
        suffix = [rng.randrange(1, vocab) for _ in range(rng.randrange(0, 40))]
        prompt = {"prompt_token_ids": prefix + suffix}
        salt = rng.choice([None, "tenant-A", "tenant-B"])
        if salt is not None:
            prompt["cache_salt"] = salt
        n, temperature = rng.choice([1, 1, 2, 3]), rng.choice([0, 1.0])
        params = SamplingParams(
            n=n if temperature else 1,  # n > 1 greedy completions are refused (as vLLM)
            temperature=temperature,
            max_tokens=rng.randrange(1, 12),
            seed=rng.choice([None, rng.randrange(1000)]),
        )
        return prompt, params

    while counts["added"] < num_requests or engine.has_unfinished_requests():
        if counts["added"] < num_requests and len(engine.requests) < 24:
            for _ in range(rng.randrange(1, 4)):
                prompt, params = random_request()
                if rng.random() < 0.03:
                    prompt = {"prompt_token_ids": prompt["prompt_token_ids"] + [vocab]}  # a bad id: refused
                try:
                    counts["added"] += sum(map(len, engine.add_requests([prompt], params).values()))
                except ValueError:
                    counts["refused"] += 1
        if engine.requests and rng.random() < 0.08:
            engine.abort_request(rng.choice(sorted(engine.requests)))
            counts["aborted"] += 1
        if counts["added"] < num_requests and rng.random() < 0.04:
            fake.fail_next = rng.choice([RuntimeError("injected"), KeyboardInterrupt()])
        try:
            for output in engine.step():
                counts["errors"] += output.outputs[0].finish_reason == "error"
        except KeyboardInterrupt:
            counts["interrupted_steps"] += 1
        assert not fake.violations, fake.violations[:3]
        engine.kv_cache_manager.check_invariants()
        check_scheduler_invariants(engine)
    counts["hits_checked"] = fake.num_hits_checked
    counts["preemptions"] = engine.get_stats().num_preemptions

    assert_nothing_leaked(engine)
    return counts


def test_random_soak_leaks_nothing_and_every_hit_holds_its_own_tokens():
    counts = run_soak(seed=2026, num_requests=2500)
    assert counts["added"] >= 2500 and counts["refused"] > 0 and counts["aborted"] > 50
    assert counts["interrupted_steps"] > 5 and counts["errors"] > 5  # injected failures happened
    assert counts["preemptions"] > 10 and counts["hits_checked"] > 1000  # the pool was tight, the cache used


def test_the_soak_catches_an_engine_that_forgets_to_uncache(monkeypatch):
    """The known-wrong engine: a failed step's blocks stay cached; the content check fires."""
    monkeypatch.setattr(KVCacheManager, "uncache_blocks", lambda self, blocks: None)
    with pytest.raises(AssertionError, match="hit block"):
        run_soak(seed=2026, num_requests=2500)
