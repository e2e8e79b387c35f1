"""The KV-cache manager with two KV-cache groups (full attention + sliding window), scenario by scenario.

The call-for-call comparison with vLLM 0.33's own manager is
``tests/vs_vllm/test_vs_vllm_hybrid_kv_cache_manager.py``; these tests pin the
behaviour a reader of chapter 08b is told about, with small numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mini_vllm.block_pool import NULL_BLOCK_ID
from mini_vllm.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
    max_blocks_per_request,
)
from mini_vllm.kv_cache_manager import KVCacheBlocks, KVCacheManager
from mini_vllm.request import Request
from mini_vllm.single_type_kv_cache_manager import find_sliding_window_cache_hit, sliding_window_contiguous_blocks

BLOCK = 4
WINDOW = 9  # a hit needs cdiv(8, 4) = 2 cached blocks in a row
NULL = NULL_BLOCK_ID


def hybrid_manager(num_blocks: int = 40, window: int = WINDOW, **kwargs) -> KVCacheManager:
    config = make_kv_cache_config([window, None, window, None], BLOCK, num_blocks)
    return KVCacheManager(num_blocks, BLOCK, kv_cache_config=config, **kwargs)


def admit(manager: KVCacheManager, request: Request, max_new_tokens: int | None = None):
    """Look up and allocate; returns the hit's blocks per group (``KVCacheBlocks.blocks``), its tokens, the new blocks."""
    computed_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens
    if max_new_tokens is not None:
        num_new = min(num_new, max_new_tokens)
    new_blocks = manager.allocate_slots(request, num_new, num_hit_tokens, computed_blocks)
    if new_blocks is not None:
        request.num_computed_tokens = num_hit_tokens + num_new
    manager.check_invariants()
    return computed_blocks.blocks, num_hit_tokens, new_blocks


def decode(manager: KVCacheManager, request: Request, token: int = 7) -> None:
    request.append_output_token_ids(token)
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1
    manager.check_invariants()


def test_groups_come_full_attention_first_with_equal_layer_counts():
    config = make_kv_cache_config([64, None, 64, None], 16, 10)
    assert [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups] == [
        "FullAttentionSpec",
        "SlidingWindowSpec",
    ]
    assert config.kv_cache_groups[0].layer_ids == (1, 3) and config.kv_cache_groups[1].layer_ids == (0, 2)
    assert config.num_layers_per_block == 2 and len(config.kv_cache_groups) == 2
    single = make_kv_cache_config([None] * 4, 16, 10)
    assert len(single.kv_cache_groups) == 1 and single.num_layers_per_block == 4


def _layout(pattern: str, repeats: int) -> list[int | None]:
    return [64 if kind == "s" else None for kind in pattern * repeats]


def _groups(config) -> list[tuple[str, tuple[int, ...]]]:
    return [(type(g.kv_cache_spec).__name__[0], g.layer_ids) for g in config.kv_cache_groups]


def test_layers_are_grouped_as_vllm_0_33_groups_them():
    # 2 sliding : 1 full, 30 layers: groups of 10, the sliding bucket split in two, layers[i::2].
    config = make_kv_cache_config(_layout("ssf", 10), 16, 10)
    full, sliding = tuple(range(2, 30, 3)), [i for i in range(30) if i % 3 != 2]
    assert _groups(config) == [("F", full), ("S", tuple(sliding[0::2])), ("S", tuple(sliding[1::2]))]
    assert config.num_layers_per_block == 10
    # Gemma 3's 5:1: one full-attention group and five sliding-window groups of 5.
    gemma = make_kv_cache_config(_layout("sssssf", 5), 16, 10)
    assert [kind for kind, _ in _groups(gemma)] == ["F"] + ["S"] * 5
    assert all(len(layers) == 5 for _, layers in _groups(gemma))
    assert sorted(layer for _, layers in _groups(gemma) for layer in layers) == list(range(30))
    # Every layer sliding: one sliding-window group.
    assert _groups(make_kv_cache_config([64] * 6, 16, 10)) == [("S", tuple(range(6)))]
    # Under 1.5x: the larger bucket's size, the smaller group padded (12 sliding + 13 full: 13 tensors).
    padded = make_kv_cache_config([64] * 12 + [None] * 13, 16, 10)
    assert _groups(padded) == [("F", tuple(range(12, 25))), ("S", tuple(range(12)))]
    assert padded.num_layers_per_block == 13
    # 6 sliding + 4 full (not under 1.5x): groups of 4, both sliding groups padded to 4.
    uneven = make_kv_cache_config(_layout("sssff", 2), 16, 10)
    assert _groups(uneven) == [("F", (3, 4, 8, 9)), ("S", (0, 2, 6)), ("S", (1, 5, 7))]
    assert uneven.num_layers_per_block == 4
    uneven = make_kv_cache_config([64, 64, 64, None, None], 16, 10)
    assert _groups(uneven) == [("F", (3, 4)), ("S", (0, 2)), ("S", (1,))]
    # Two windows: two sliding specs, two buckets of 1: groups of one layer.
    two = make_kv_cache_config([64, None, 32, None], 16, 10)
    assert _groups(two) == [("F", (1,)), ("F", (3,)), ("S", (0,)), ("S", (2,))]


def test_the_hybrid_manager_switched_off_caches_every_layer_as_full_attention():
    config = make_kv_cache_config(_layout("sssssf", 5), 16, 10, disable_hybrid_kv_cache_manager=True)
    assert _groups(config) == [("F", tuple(range(30)))]
    # A model whose layers all slide keeps its window (vLLM unifies only mixed models).
    assert _groups(make_kv_cache_config([64] * 4, 16, 10, disable_hybrid_kv_cache_manager=True)) == [
        ("S", (0, 1, 2, 3))
    ]


def test_a_single_group_engine_answers_per_group_like_a_hybrid_one():
    for manager, num_groups in ((KVCacheManager(20, BLOCK), 1), (hybrid_manager(), 2)):
        request = Request("r", list(range(10)), BLOCK)
        hits, _, new_blocks = admit(manager, request)
        assert hits == ((),) * num_groups  # the manager's shared empty KVCacheBlocks
        assert isinstance(new_blocks, KVCacheBlocks) and [len(group) for group in new_blocks.blocks] == [3] * num_groups


def test_blocks_leave_the_window_as_the_request_decodes_and_stay_cached():
    manager = hybrid_manager()
    request = Request("r", list(range(100, 116)), BLOCK)  # 16 tokens: 4 full blocks
    admit(manager, request)
    full, sliding = manager.get_block_ids_by_group("r")
    assert len(full) == len(sliding) == 4 and NULL not in sliding
    # Before token 16 runs, its window is tokens 8..16: blocks 0 and 1 (tokens 0..7) are behind it.
    decode(manager, request)
    full, sliding = manager.get_block_ids_by_group("r")
    assert sliding[:2] == [NULL, NULL] and NULL not in sliding[2:]
    assert NULL not in full  # full attention keeps everything
    freed = [b for b in manager.block_pool.blocks if b.ref_cnt == 0 and b.block_hash is not None]
    assert {b.kv_cache_group_id for b in freed} == {1}  # freed while running, still cached
    manager.free(request)
    manager.check_invariants()
    assert manager.get_num_free_blocks() == manager.num_blocks


def test_the_hit_is_what_every_group_can_serve_and_a_junction_gets_pinned():
    manager = hybrid_manager()
    prompt = list(range(200, 226))  # 26 tokens: 6 full blocks; replay boundary = token 25 -> blocks 4, 5 end there
    first = Request("a", prompt, BLOCK)
    admit(manager, first)
    manager.free(first)
    # The sliding-window group cached only the 2 blocks ending at the replay boundary (blocks 4 and 5).
    cached_sliding = sorted(
        i for i, h in enumerate(first.block_hashes) if manager.block_pool.get_cached_block(h, 1) is not None
    )
    assert cached_sliding == [4, 5]
    # Same prompt again: the hit is 6 blocks capped by the last-block rule to (26-1)//4 = 6.
    again = Request("b", prompt, BLOCK)
    hits, num_hit_tokens, _ = admit(manager, again)
    assert num_hit_tokens == 24
    assert [b.block_id for b in hits[1]][:4] == [NULL] * 4
    manager.free(again)
    # A prompt sharing only the first 17 tokens: full attention finds 4 blocks, the window none -> hit 0 ...
    shared = prompt[:17]
    second = Request("c", shared + [1, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    hits, num_hit_tokens, _ = admit(manager, second)
    assert num_hit_tokens == 0 and hits == ((), ())
    assert manager.shared_prefix_boundary["c"] == 16  # ... and the junction at token 16 is pinned
    manager.free(second)
    # ... so the third prompt with that prefix hits the 16 tokens in both groups.
    third = Request("d", shared + [9, 9, 9, 9, 9, 9, 9, 9], BLOCK)
    hits, num_hit_tokens, _ = admit(manager, third)
    assert num_hit_tokens == 16
    assert [b.block_id for b in hits[1]][:2] == [NULL, NULL] and NULL not in [b.block_id for b in hits[0]]
    manager.free(third)
    manager.check_invariants()


def test_a_sliding_window_hit_survives_an_evicted_first_block():
    pool_manager = hybrid_manager()
    pool = pool_manager.block_pool
    request = Request("a", list(range(300, 326)), BLOCK)
    admit(pool_manager, request)
    pool_manager.free(request)
    hashes = request.block_hashes
    # Evict the full-attention group's block 0: full attention now finds nothing ...
    block0 = pool.get_cached_block(hashes[0], 0)
    pool.free_block_queue.remove(block0)
    pool.free_block_queue.appendleft(block0)
    pool.get_new_blocks(1)
    assert pool_manager.find_longest_cache_hit(hashes, 6) == []
    # ... while the sliding-window group's run at blocks 4, 5 is still a hit for that group alone.
    found = find_sliding_window_cache_hit(pool, hashes, 6, sliding_window_contiguous_blocks(WINDOW, BLOCK), 1)
    assert [b.block_id for b in found][:4] == [NULL] * 4 and NULL not in [b.block_id for b in found[4:]]
    # The request's hit is the smaller one: nothing.
    assert pool_manager.get_computed_blocks(Request("b", list(range(300, 326)), BLOCK))[1] == 0


def test_sliding_window_lookup_rules():
    manager = hybrid_manager()
    pool = manager.block_pool
    request = Request("a", list(range(400, 432)), BLOCK)  # 8 blocks
    hashes = request.block_hashes
    blocks = pool.get_new_blocks(8)
    # Cache blocks 1, 3, 4 and 6 for group 1.
    for index in (1, 3, 4, 6):
        pool.cache_full_blocks(request, blocks, index, index + 1, kv_cache_group_id=1)
    ids = lambda found: [b.block_id for b in found]  # noqa: E731
    b = [block.block_id for block in blocks]
    # Rightmost run of 2 is blocks 3, 4: nulls before it, nothing after.
    assert ids(find_sliding_window_cache_hit(pool, hashes, 8, 2, 1)) == [NULL, NULL, NULL, b[3], b[4]]
    # Capped at 4 blocks: blocks 0..3 have no run of 2 ending before 4 -> none, and block 0 is missing.
    assert ids(find_sliding_window_cache_hit(pool, hashes, 4, 2, 1)) == []
    # Group 0 holds none of them.
    assert find_sliding_window_cache_hit(pool, hashes, 8, 2, 0) == []
    # A run from block 0 shorter than needed is still a hit.
    pool.cache_full_blocks(request, blocks, 0, 1, kv_cache_group_id=1)
    assert ids(find_sliding_window_cache_hit(pool, hashes, 3, 3, 1)) == [b[0], b[1]]


def test_a_hybrid_engine_needs_blocks_in_both_groups_and_refuses_what_never_fits():
    config = make_kv_cache_config([WINDOW, None], BLOCK, 10)
    # 40 tokens: 10 full-attention blocks + at most cdiv(8 + 8, 4) + 1 = 5 sliding-window blocks.
    assert max_blocks_per_request(config, 40, max_num_batched_tokens=8) == 15
    manager = KVCacheManager(10, BLOCK, kv_cache_config=config)
    request = Request("a", list(range(24)), BLOCK)
    assert manager.allocate_slots(request, 24) is None  # 6 + 6 blocks > 10: nothing changed
    manager.check_invariants()
    assert manager.get_num_free_blocks() == 10 and "a" not in manager.req_to_blocks


def test_per_group_hits_are_required_in_a_hybrid_engine():
    manager = hybrid_manager()
    request = Request("a", list(range(8)), BLOCK)
    with pytest.raises(ValueError, match="one sequence for each of the 2 KV-cache groups"):
        manager.allocate_slots(request, 8, 4, [manager.block_pool.blocks[0]])
    with pytest.raises(ValueError, match="one sequence for each of the 2 KV-cache groups"):
        manager.allocate_slots(request, 8, 4, KVCacheBlocks(([manager.block_pool.blocks[0]],)))


def test_a_config_and_manager_disagreeing_on_size_is_refused():
    config = KVCacheConfig(
        8, (KVCacheGroupSpec((0,), FullAttentionSpec(4)), KVCacheGroupSpec((1,), SlidingWindowSpec(4, 9)))
    )
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(9, 4, kv_cache_config=config)


def _manager_with_cached(groups: list[int | None], cached: dict[int, set[int]], num_prompt_blocks: int):
    """A manager whose group ``g`` has the request's blocks at positions ``cached[g]`` cached (a lookup table)."""
    config = KVCacheConfig(
        40,
        tuple(
            KVCacheGroupSpec((i,), FullAttentionSpec(BLOCK) if window is None else SlidingWindowSpec(BLOCK, window))
            for i, window in enumerate(groups)
        ),
    )
    manager = KVCacheManager(40, BLOCK, kv_cache_config=config)
    request = Request("r", list(range(num_prompt_blocks * BLOCK + 1)), BLOCK)
    pool = manager.block_pool
    table = {
        (request.block_hashes[i], group): pool.blocks[group * 10 + i]
        for group, positions in cached.items()
        for i in positions
    }
    pool.get_cached_block = lambda block_hash, group=0: table.get((block_hash, group))
    return manager, request


def test_the_lookup_runs_to_its_fixed_point_over_the_specs():
    # Windows of 5 (one block a hit needs) and 13 tokens (three), 8 full-attention blocks cached.
    # Round 1: full 8, window 5 hits 8 (block 7), window 13 cuts to 5 (blocks 2..4). Round 2: window 5
    # has no block 4, cuts to 4 (block 3); window 13 serves 4 (blocks 1..3). Round 3 changes nothing.
    manager, request = _manager_with_cached(
        [None, 5, 13], {0: set(range(8)), 1: {3, 7}, 2: {0, 1, 2, 3, 4}}, num_prompt_blocks=8
    )
    hits, num_tokens = manager.get_computed_blocks(request)
    full, short, long = hits.blocks
    assert num_tokens == 4 * BLOCK
    assert [b.block_id for b in full] == [0, 1, 2, 3]
    assert [b.block_id for b in short] == [NULL_BLOCK_ID] * 3 + [13]
    assert [b.block_id for b in long] == [NULL_BLOCK_ID] + [21, 22, 23]
    assert manager.shared_prefix_boundary["r"] == 8 * BLOCK  # full attention could serve more: a junction


def test_groups_that_share_a_spec_are_looked_up_together():
    # Two sliding-window groups of one spec (need 2 blocks): group 1 has blocks 4..5 and 1..2, group 2
    # only 1..2 and 5: the run 4..5 is not in both, so the hit ends at block 2 in both groups.
    manager, request = _manager_with_cached(
        [None, 9, 9], {0: set(range(6)), 1: {1, 2, 4, 5}, 2: {1, 2, 5}}, num_prompt_blocks=6
    )
    assert len(manager.spec_groups) == 2
    hits, num_tokens = manager.get_computed_blocks(request)
    full, first, second = hits.blocks
    assert num_tokens == 3 * BLOCK
    assert [b.block_id for b in first] == [NULL_BLOCK_ID, 11, 12]
    assert [b.block_id for b in second] == [NULL_BLOCK_ID, 21, 22]


# -- prefix_cache_retention_interval (vLLM 0.33's setting) --------------------------------------------
def test_the_retention_interval_is_checked_as_vllm_checks_it():
    full_only = make_kv_cache_config([None, None], BLOCK, 10)
    hybrid = make_kv_cache_config([8, None], BLOCK, 10)
    KVCacheManager(10, BLOCK, kv_cache_config=full_only, prefix_cache_retention_interval=None)
    KVCacheManager(10, BLOCK, kv_cache_config=hybrid, prefix_cache_retention_interval=4 * BLOCK)
    with pytest.raises(ValueError, match="no sliding-window KV-cache group"):
        KVCacheManager(10, BLOCK, kv_cache_config=full_only, prefix_cache_retention_interval=4 * BLOCK)
    for bad in (-BLOCK, BLOCK + 1):
        with pytest.raises(ValueError, match="multiple of block_size"):
            KVCacheManager(10, BLOCK, kv_cache_config=hybrid, prefix_cache_retention_interval=bad)


@pytest.mark.parametrize(
    "retention, window, cached",
    [
        (0, 5, [5]),  # only the block before the boundary (token 24: block 6) - one block a hit needs
        (None, 5, None),  # every block
        (4 * BLOCK, 5, [3, 5, 7]),  # and the last block of every 4-block segment
        (4 * BLOCK, 13, [1, 2, 3, 4, 5, 6, 7]),  # three blocks a hit needs: 1..3 and 5..7 (and the boundary's 3..5)
        (2 * BLOCK, 13, None),  # a hit needs more blocks than a segment holds: every block
    ],
)
def test_which_blocks_a_sliding_window_group_caches(retention, window, cached):
    config = make_kv_cache_config([window, None], BLOCK, 40)
    manager = KVCacheManager(40, BLOCK, kv_cache_config=config, prefix_cache_retention_interval=retention)
    (sliding,) = manager.sliding_window_managers
    mask = sliding.cacheable_block_mask(0, 8, [24])
    assert mask is None if cached is None else [i for i, keep in enumerate(mask) if keep] == cached


def test_no_model_kind_branch_outside_the_construction_of_the_manager():
    """Issue 40: the engine, the scheduler and the widgets run one path for any number of KV-cache groups.

    The manager picks its lookup once, when it is built (``find_cache_hit``, as vLLM picks its coordinator);
    nothing asks "is this model hybrid?" afterwards.
    """
    import mini_vllm

    root = Path(mini_vllm.__file__).parent
    found = sorted(str(path.relative_to(root)) for path in root.rglob("*.py") if "is_hybrid" in path.read_text())
    assert not found, f"an is_hybrid branch is back in {found}"
    assert KVCacheManager(4, BLOCK).find_cache_hit.__func__ is KVCacheManager.find_unitary_cache_hit
    assert hybrid_manager().find_cache_hit.__func__ is KVCacheManager.find_hybrid_cache_hit
