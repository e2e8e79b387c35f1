"""Random schedules against the KV-cache manager (hypothesis stateful testing).

The machine admits requests with prefix lookup (whole or chunked prefill),
decodes, finishes, preempts (free + re-admit later) and resets the cache, over
prompts drawn from a few shared prefixes, with and without cache salts, on
pools of several sizes. After every step ``check_invariants()`` must hold, and
two oracles are checked:

* the lookup: each returned block's hash equals the request's hash at that
  index, and when the hit is shorter than the cap, the next hash is not cached;
* the *contents*: the test simulates what the model writes into each slot (the
  salt and every token up to that position, which is what a causal model's K/V
  depend on); every block a request hits must hold exactly what the request
  itself would have written there.
"""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_vllm.kv_cache_manager import KVCacheManager
from mini_vllm.request import Request
from mini_vllm.scheduler import schedule_whole_prompt

BLOCK_SIZE = 4
PREFIXES = [[1] * 12, [2, 3] * 6 + [4] * 8, list(range(30, 50))]


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.sampled_from([3, 6, 12, 40]))
    def setup(self, num_blocks):
        self.manager = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.slot_contents: dict[tuple[int, int], tuple] = {}  # (block_id, offset) -> what was written
        self.next_id = 0

    # -- helpers ----------------------------------------------------------------
    def _expected_content(self, request: Request, position: int) -> tuple:
        return (request.cache_salt, tuple(request.all_token_ids[: position + 1]))

    def _compute(self, request: Request, num_tokens: int) -> None:
        """Simulate the model: write the K/V of the next num_tokens tokens into their slots."""
        table = self.manager.req_to_blocks[request.request_id]
        for position in range(request.num_computed_tokens, request.num_computed_tokens + num_tokens):
            block = table[position // BLOCK_SIZE]
            self.slot_contents[(block.block_id, position % BLOCK_SIZE)] = self._expected_content(request, position)
        request.num_computed_tokens += num_tokens

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.running.remove(request)
        self.waiting.insert(0, request)

    # -- rules ------------------------------------------------------------------
    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.integers(0, 20),
        suffix=st.lists(st.integers(100, 104), max_size=9),
        salt=st.sampled_from([None, None, "tenant-a", "tenant-b"]),
    )
    def add_request(self, prefix, prefix_len, suffix, salt):
        tokens = PREFIXES[prefix][:prefix_len] + suffix
        if not tokens:
            tokens = [7]
        # A request must fit the pool on its own, as the engine guarantees.
        if len(tokens) + 4 > self.manager.num_blocks * BLOCK_SIZE:
            tokens = tokens[: self.manager.num_blocks * BLOCK_SIZE - 4]
        self.waiting.append(Request(f"r{self.next_id}", tokens, block_size=BLOCK_SIZE, cache_salt=salt))
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(chunk=st.integers(1, 40))
    def admit(self, chunk):
        request = self.waiting[0]
        computed_blocks, num_hit_tokens = self.manager.get_computed_blocks(request)
        (hits,) = computed_blocks.blocks  # the one KV-cache group's
        # Oracle 1: the lookup.
        cap = (request.num_tokens - 1) // BLOCK_SIZE
        assert len(hits) <= cap and num_hit_tokens == len(hits) * BLOCK_SIZE
        for index, block in enumerate(hits):
            assert block.block_hash == request.block_hashes[index]
        if len(hits) < cap:
            assert self.manager.block_pool.get_cached_block(request.block_hashes[len(hits)]) is None
        # Oracle 2: the hit blocks hold exactly this request's K/V.
        for index, block in enumerate(hits):
            for offset in range(BLOCK_SIZE):
                expected = self._expected_content(request, index * BLOCK_SIZE + offset)
                assert self.slot_contents[(block.block_id, offset)] == expected
        num_new = min(chunk, request.num_tokens - num_hit_tokens)
        if self.manager.allocate_slots(request, num_new, num_hit_tokens, computed_blocks) is None:
            return
        self.waiting.pop(0)
        request.num_computed_tokens = num_hit_tokens
        self._compute(request, num_new)
        self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100), chunk=st.integers(1, 40), token=st.integers(100, 104))
    def step_running(self, pick, chunk, token):
        """Continue a prefill chunk, or decode one token; preempt the newest on failure."""
        request = self.running[pick % len(self.running)]
        if request.num_computed_tokens < request.num_tokens:
            num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        else:
            request.append_output_token_ids(token)
            num_new = 1
        while self.manager.allocate_slots(request, num_new) is None:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return
        self._compute(request, num_new)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick):
        request = self.running.pop(pick % len(self.running))
        self.manager.free(request)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def preempt(self, pick):
        self._preempt(self.running[pick % len(self.running)])

    @rule()
    def reset(self):
        all_free = self.manager.get_num_free_blocks() == self.manager.num_blocks
        assert self.manager.reset_prefix_cache() == all_free

    # -- invariants -------------------------------------------------------------
    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        assert set(self.manager.req_to_blocks) == {r.request_id for r in self.running}
        for request in self.running:
            table = self.manager.req_to_blocks[request.request_id]
            assert len(table) * BLOCK_SIZE >= request.num_computed_tokens

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for request in list(self.running):
            self.manager.free(request)
        assert self.manager.get_num_free_blocks() == self.manager.num_blocks
        self.manager.check_invariants()


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_kv_cache_manager_random_schedules = KVCacheMachine.TestCase


def test_lookup_oracle_on_random_prompts():
    """find_longest_cache_hit agrees with a brute-force prefix search."""
    rng = random.Random(0)
    # A pool large enough never to evict, so every prompt seen so far stays cached.
    manager = KVCacheManager(num_blocks=2000, block_size=BLOCK_SIZE)
    seen: list[list[int]] = []
    for i in range(200):
        base = rng.choice(PREFIXES)
        tokens = base[: rng.randint(0, len(base))] + [rng.randint(100, 102) for _ in range(rng.randint(1, 8))]
        request = Request(f"q{i}", tokens, block_size=BLOCK_SIZE)
        (hits,) = manager.get_computed_blocks(request)[0].blocks
        # Brute force: the longest block-aligned prefix shared with any prompt seen before.
        best = 0
        cap = (len(tokens) - 1) // BLOCK_SIZE
        for other in seen:
            n = 0
            while (
                n < cap
                and other[: (n + 1) * BLOCK_SIZE] == tokens[: (n + 1) * BLOCK_SIZE]
                and len(other) >= (n + 1) * BLOCK_SIZE
            ):
                n += 1
            best = max(best, n)
        assert len(hits) == best, (tokens, best, len(hits))
        if schedule_whole_prompt(manager, request) is None:
            continue
        manager.free(request)
        seen.append(tokens)
    assert manager.block_pool.num_evictions == 0
    assert manager.prefix_cache_stats.hits > 0  # the workload really shares prefixes
