"""The radix-tree prefix cache of chapter 06b (SGLang's design) against oracles and vLLM's hash map."""

import random

import pytest

from mini_vllm.kv_cache_manager import KVCacheManager
from mini_vllm.companions.profiler import common_prefix_length
from mini_vllm.companions.radix_cache import RadixCache, serve_with_hash_map, serve_with_radix_cache


def random_prompts(rng, num_prompts, num_prefixes=3, vocab=4):
    """Prompts that share a few prefixes, with small vocabularies so that edges split often."""
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in range(num_prefixes)]
    prompts = []
    for _ in range(num_prompts):
        prefix = list(rng.choice(prefixes))
        if prompts and rng.random() < 0.3:
            prefix = list(rng.choice(prompts))  # a repeat, or a later turn of an earlier prompt
        prompts.append(prefix + [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))])
    return prompts


def match_length(cache, prompt):
    return cache.match_prefix(prompt)[0]


def whole_edges_only(cache, prompt):
    """A known-wrong lookup: it counts whole edges only, never a part of one."""
    node, num_matched = cache.root, 0
    while True:
        child = node.children.get(tuple(prompt[num_matched : num_matched + cache.page_size]))
        if child is None or tuple(prompt[num_matched : num_matched + len(child.key)]) != child.key:
            return num_matched
        num_matched += len(child.key)
        node = child


def oracle_mismatches(lookup, page_size, seed):
    """Lookups whose answer differs from the brute-force longest common prefix (no eviction)."""
    rng = random.Random(seed)
    cache = RadixCache(10_000, page_size)
    inserted, mismatches = [], 0
    for prompt in random_prompts(rng, 40):
        expected = max((common_prefix_length(prompt, old) for old in inserted), default=0)
        expected -= expected % page_size
        if lookup(cache, prompt) != expected:
            mismatches += 1
        cache.insert(prompt)
        inserted.append(prompt[: len(prompt) - len(prompt) % page_size])
        cache.check_invariants()
    return mismatches


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(5))
def test_match_prefix_equals_the_longest_common_prefix_with_any_cached_prompt(page_size, seed):
    assert oracle_mismatches(match_length, page_size, seed) == 0


def test_the_oracle_rejects_a_lookup_that_ignores_partial_edges():
    assert sum(oracle_mismatches(whole_edges_only, 1, seed) for seed in range(5)) > 0


def test_matching_is_token_granular_with_pages_of_one_and_page_granular_otherwise():
    shared = list(range(30))
    for page_size, expected in [(1, 30), (16, 16)]:
        cache = RadixCache(capacity_tokens=1000, page_size=page_size)
        cache.insert(shared + [100] * 10)
        assert cache.match_prefix(shared + [200] * 10)[0] == expected


def test_a_partial_match_splits_the_edge_and_a_new_branch_shares_it():
    cache = RadixCache(capacity_tokens=1000)
    cache.insert([1, 2, 3, 4, 5, 6])
    num_matched, node = cache.match_prefix([1, 2, 3, 9])
    assert num_matched == 3 and node.key == (1, 2, 3)
    assert cache.insert([1, 2, 3, 9, 9]) == 2  # only the new branch is stored
    assert cache.cached_sequences() == [(1, 2, 3, 4, 5, 6), (1, 2, 3, 9, 9)]
    assert cache.num_cached_tokens == 8
    cache.check_invariants()


def test_eviction_takes_the_least_recently_used_leaf_and_keeps_the_shared_prefix():
    system = list(range(20))
    cache = RadixCache(capacity_tokens=40)
    cache.insert(system + [100] * 5)  # A
    cache.insert(system + [200] * 5)  # B
    cache.match_prefix(system + [100] * 5)  # A is used again: B is now the oldest
    cache.insert(system + [300] * 10)  # needs 10 tokens, 10 are free
    cache.insert([7] * 5)  # needs 5 more: B's leaf goes
    assert cache.cached_sequences() == sorted([tuple(system + [100] * 5), tuple(system + [300] * 10), (7,) * 5])
    assert cache.num_evicted_tokens == 5
    cache.check_invariants()


def test_a_locked_prefix_is_never_evicted():
    cache = RadixCache(capacity_tokens=20)
    cache.insert([1] * 10)
    _, node = cache.match_prefix([1] * 10)
    cache.inc_lock_ref(node)
    assert cache.insert([2] * 15) == 10  # only the free 10 tokens can be used
    assert (1,) * 10 in cache.cached_sequences()
    cache.dec_lock_ref(node)
    assert cache.insert([3] * 15) == 15  # now everything unlocked may go
    cache.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_under_pressure_keep_the_invariants(seed):
    rng = random.Random(seed)
    cache = RadixCache(capacity_tokens=60, page_size=rng.choice([1, 2, 4]))
    locked = []
    for prompt in random_prompts(rng, 80, vocab=3):
        if locked and rng.random() < 0.5:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        num_matched, node = cache.match_prefix(prompt)
        if rng.random() < 0.3 and len(locked) < 2:
            cache.inc_lock_ref(node)
            locked.append(node)
        cache.insert(prompt)
        cache.check_invariants()
        for sequence in cache.cached_sequences():  # every cached token is reachable and was inserted
            assert cache.match_prefix(list(sequence))[0] == len(sequence)


def test_with_pages_of_16_the_tree_reuses_exactly_what_vllms_hash_map_reuses():
    rng = random.Random(0)
    prompts = random_prompts(rng, 60, vocab=5)
    prompts += [prompts[0], prompts[1]]  # repeated prompts: the last-token rule matters
    tree = RadixCache(capacity_tokens=100_000, page_size=16)
    manager = KVCacheManager(num_blocks=1000, block_size=16)
    tree_hits = [serve_with_radix_cache(tree, p) for p in prompts]
    map_hits = [serve_with_hash_map(manager, p, f"r{i}") for i, p in enumerate(prompts)]
    assert tree_hits == map_hits
    assert sum(map_hits) > 0

    # The same comparison catches a lookup that forgets to leave the last token uncached.
    naive = RadixCache(capacity_tokens=100_000, page_size=16)
    naive_hits = []
    for prompt in prompts:
        naive_hits.append(naive.match_prefix(prompt)[0])
        naive.insert(prompt)
    assert naive_hits != map_hits


def test_with_pages_of_one_the_tree_reuses_at_least_as_much_as_the_hash_map():
    rng = random.Random(1)
    prompts = random_prompts(rng, 60, vocab=5)
    tree = RadixCache(capacity_tokens=100_000, page_size=1)
    manager = KVCacheManager(num_blocks=1000, block_size=16)
    tree_hits = [serve_with_radix_cache(tree, p) for p in prompts]
    map_hits = [serve_with_hash_map(manager, p, f"r{i}") for i, p in enumerate(prompts)]
    assert all(t >= m for t, m in zip(tree_hits, map_hits))
    assert sum(tree_hits) > sum(map_hits)  # the partial blocks the map can never share
    assert all(t - m < 16 + 16 for t, m in zip(tree_hits, map_hits))  # at most a partial block + the last block


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"capacity_tokens": 0}, "capacity_tokens"),
        ({"capacity_tokens": 8, "page_size": 0}, "page_size"),
        ({"capacity_tokens": 8, "page_size": True}, "page_size"),
        ({"capacity_tokens": 2.5}, "capacity_tokens"),
    ],
)
def test_bad_sizes_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RadixCache(**kwargs)


@pytest.mark.parametrize("bad", ["abc", [1, "2"], [1, 2.0], 5])
def test_bad_token_ids_raise_type_error(bad):
    cache = RadixCache(capacity_tokens=8)
    with pytest.raises(TypeError, match="token_ids"):
        cache.match_prefix(bad)
    with pytest.raises(TypeError, match="token_ids"):
        cache.insert(bad)


def test_unlocking_an_unlocked_node_is_an_error():
    cache = RadixCache(capacity_tokens=8)
    cache.insert([1, 2])
    _, node = cache.match_prefix([1, 2])
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_lock_ref(node)
