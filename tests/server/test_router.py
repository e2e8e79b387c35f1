"""Routing across replicas: each router does what it says, the cache-aware router's mirror of
the replicas' caches stays exact, and prefix-aware routing beats round-robin under memory pressure.
(mini_vllm/companions/router.py, chapter 09b.)"""

from __future__ import annotations

import random

import httpx
import pytest

from mini_vllm.companions.router import CacheAwareRouter, CacheReplica, PrefixHashRouter, RoundRobinRouter, run_workload


def workload(num_systems=5, num_requests=60, system_len=200, seed=0):
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(system_len)] for _ in range(num_systems)]
    return [systems[rng.randrange(num_systems)] + [rng.randrange(1000) for _ in range(30)] for _ in range(num_requests)]


def replicas(n=4, num_blocks=40):
    return [CacheReplica(num_blocks, 16, name=f"r{i}") for i in range(n)]


def test_round_robin_cycles_through_the_replicas():
    result = run_workload(RoundRobinRouter(3), replicas(3), workload(num_requests=7))
    assert result.replica == [0, 1, 2, 0, 1, 2, 0]


def test_prefix_hash_sends_equal_first_blocks_to_the_same_replica():
    router = PrefixHashRouter(4, block_size=16)
    base = list(range(16))
    assert len({router.route(base + [i] * 20) for i in range(10)}) == 1
    assert router.route(base, "tenant-a") == router.route(base + [1, 2], "tenant-a")


def test_the_cache_aware_router_mirrors_exactly_what_each_replica_caches():
    reps = replicas(num_blocks=30)  # small pools: plenty of evictions
    router = CacheAwareRouter(4)
    run_workload(router, reps, workload())
    assert sum(r.manager.block_pool.num_evictions for r in reps) > 0
    for mirror, replica in zip(router.cached, reps):
        assert set(mirror) == {h for h, _ in replica.manager.block_pool.cached_block_hash_to_block.items()}


def test_the_cache_aware_router_picks_the_replica_holding_the_longest_prefix():
    reps = replicas(2)
    router = CacheAwareRouter(2)
    prompt = list(range(64))
    first = run_workload(router, reps, [prompt]).replica[0]
    again = run_workload(router, reps, [prompt[:48] + [7] * 16]).replica[0]
    assert again == first
    assert router.cached_prefix_blocks(prompt)[first] == 4


def test_prefix_aware_routing_beats_round_robin_under_memory_pressure():
    work = workload()
    rr = run_workload(RoundRobinRouter(4), replicas(), work)
    hashed = run_workload(PrefixHashRouter(4), replicas(), work)
    aware = run_workload(CacheAwareRouter(4), replicas(), work)
    assert hashed.hit_rate > rr.hit_rate + 0.2
    assert aware.hit_rate > rr.hit_rate + 0.2
    assert sum(rr.requests_per_replica) == sum(aware.requests_per_replica) == len(work)
    assert aware.cumulative_hit_rate[-1] == aware.hit_rate


def test_salted_requests_are_routed_and_cached_per_tenant():
    prompt = list(range(64))
    reps = replicas(1)
    result = run_workload(RoundRobinRouter(1), reps, [(prompt, "a"), (prompt, "b"), (prompt, "a")])
    assert result.num_cached_tokens == [0, 0, 48]


def _router_learns_of_a_reset(replica):
    router = CacheAwareRouter(1, block_size=16)
    prompt = list(range(100, 164))
    replica.serve(prompt)
    router.observe(0, replica.take_events())
    assert router.cached_prefix_blocks(prompt) == [4]  # all four full blocks are cached
    assert replica.reset_prefix_cache() is True
    router.observe(0, replica.take_events())
    return router.cached_prefix_blocks(prompt)


def test_the_router_learns_of_a_reset_from_a_cache_replica():
    assert _router_learns_of_a_reset(CacheReplica(8, 16)) == [0]


def test_the_router_learns_of_a_reset_from_a_real_engine():
    from mini_vllm import LLM
    from mini_vllm.companions.router import LLMReplica

    assert _router_learns_of_a_reset(LLMReplica(LLM(num_blocks=16, device="cpu"))) == [0]


def test_a_router_that_misses_the_reset_is_caught():
    # The known-wrong variant: a replica whose reset event never reaches the router
    # (what the engine did before): the router still believes the prefix is cached.
    class SilentReset(CacheReplica):
        def reset_prefix_cache(self):
            reset = super().reset_prefix_cache()
            self.take_events()  # the AllBlocksCleared is swallowed
            return reset

    assert _router_learns_of_a_reset(SilentReset(8, 16)) != [0]


def test_http_replicas_report_what_the_bookkeeping_replicas_do():
    """Two mini-vLLM servers behind a prefix-hash router: the same cached tokens, request by request, over HTTP."""
    from mini_vllm import LLM
    from mini_vllm.entrypoints.openai.api_server import BackgroundServer
    from mini_vllm.companions.router import HTTPReplica

    tokens = [[*range(5, 5 + 40)], [*range(5, 5 + 40), 99, 98], [*range(300, 340)], [*range(5, 5 + 33)]]
    workload = tokens + [tokens[0]] + [(tokens[1], "tenant")]
    servers = [BackgroundServer(LLM(device="cpu", num_blocks=40), served_model_name="m") for _ in range(2)]
    try:
        replicas = [HTTPReplica(server.url, "m", name=f"s{i}") for i, server in enumerate(servers)]
        over_http = run_workload(PrefixHashRouter(2, 16), replicas, workload)
        bookkeeping = run_workload(PrefixHashRouter(2, 16), [CacheReplica(40, 16) for _ in range(2)], workload)
        assert over_http.num_cached_tokens == bookkeeping.num_cached_tokens
        assert over_http.replica == bookkeeping.replica
        assert sum(over_http.num_cached_tokens) > 0
        assert all(replica.reset_prefix_cache() for replica in replicas)
        assert replicas[0].take_events() == []
        with pytest.raises(httpx.HTTPStatusError):
            HTTPReplica(servers[0].url, "no-such-model").serve([1, 2, 3])  # a 404 is an error, not 0 cached tokens
    finally:
        for server in servers:
            server.stop()


def test_a_router_with_the_replicas_hash_seed_hashes_as_they_do():
    """Replicas started with ``PYTHONHASHSEED=7`` chain their first block to that seed's ``NONE_HASH``: a
    router told the seed finds their blocks (salted or not); one hashing with its own ``NONE_HASH`` finds none."""
    from mini_vllm.events import BlockStored
    from mini_vllm.hashing import hash_request_tokens, none_hash_for

    prompt = list(range(200, 250))
    for salt in (None, "tenant-a"):
        theirs = hash_request_tokens(prompt, 16, salt, none_hash=none_hash_for("7"))
        stored = BlockStored(block_hashes=tuple(theirs), parent_block_hash=None, token_ids=(), block_size=16)
        told, blind = CacheAwareRouter(1, 16, hash_seed="7"), CacheAwareRouter(1, 16)
        for router in (told, blind):
            router.observe(0, [stored])
        assert told.cached_prefix_blocks(prompt, salt) == [3]
        assert blind.cached_prefix_blocks(prompt, salt) == [0]
        assert told.cached_prefix_blocks(prompt[:15], salt) == [0]  # no full block: nothing to look up
