"""The hybrid model end to end, mini-vLLM against real vLLM (``make vllm``): chapter 08b's claims.

``mini_vllm.tools.compare_vllm.run_hybrid_side_by_side`` sends the same token ids
through both engines, the bundled hybrid model (``mini_vllm/hybrid_model/``:
sliding-window layers 0 and 2, window 64, full-attention layers 1 and 3),
float32, block size 32, the same pool and scheduler limits, each workload
from a cold cache. vLLM runs it with ``model_impl="transformers"`` (its native
Qwen3 implements no per-layer window: it refuses this config). Requests: prompts longer
than the window, shared prefixes that diverge (the junction), the same prompt
again, a growing chat, and a pool so small that requests are preempted.

Equal per request: ``num_cached_tokens`` and the greedy tokens; per workload:
the prefix-cache counters and the preemptions. vLLM starts once (one
subprocess, ~1 min). Skipped, with the reason, without ``.venv-vllm``; under
``CI=true`` that is a failure (tests/prerequisites.py).
"""

from __future__ import annotations

import pytest

from mini_vllm.tools.compare_vllm import run_hybrid_side_by_side, vllm_missing_reason, vllm_python
from prerequisites import missing


@pytest.fixture(scope="module")
def side_by_side() -> dict:
    if vllm_python() is None:
        missing("vllm", vllm_missing_reason())
    return run_hybrid_side_by_side()


def workloads(result: dict) -> dict[str, dict]:
    return {w["name"]: w for run in result["runs"] for w in run["workloads"]}


def test_vllm_builds_the_same_two_kv_cache_groups(side_by_side):
    kv_cache = side_by_side["vllm_kv_cache"]
    assert kv_cache["coordinator"] == "HybridKVCacheCoordinator"
    specs = sorted((g["spec"], g["sliding_window"], tuple(g["layers"])) for g in kv_cache["groups"])
    assert [(spec, window) for spec, window, _ in specs] == [("FullAttentionSpec", None), ("SlidingWindowSpec", 64)]
    assert [len(layers) for _, _, layers in specs] == [2, 2]


@pytest.mark.parametrize(
    "name", ["junction", "longer_than_the_window", "shared_system_prompt", "multi_turn_chat", "eviction_and_preemption"]
)
def test_every_request_gets_the_same_hit_and_the_same_tokens(side_by_side, name):
    workload = workloads(side_by_side)[name]
    different = [row for row in workload["rows"] if not (row["cached_equal"] and row["tokens_equal"])]
    assert not different, f"{name}: {different}"
    assert workload["counters_equal"] and workload["same_num_requests"], (workload["mini"], workload["vllm"])
    assert workload["mini"]["num_preemptions"] == workload["vllm"]["num_preemptions"]


def test_the_junction_workload_shows_the_rule_of_the_chapter(side_by_side):
    # P; a prompt sharing P's first blocks: 0 (the sliding window kept only P's last blocks);
    # a third sharing them: a hit (the second pinned the junction); P again: a hit.
    cached = [row["mini_cached"] for row in workloads(side_by_side)["junction"]["rows"]]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] > 0 and cached[3] > cached[2]


def test_the_small_pool_preempts_in_both_engines(side_by_side):
    workload = workloads(side_by_side)["eviction_and_preemption"]
    assert workload["mini"]["num_preemptions"] > 0


def test_a_wrong_sliding_window_lookup_is_caught(side_by_side):
    """A mini-vLLM whose sliding-window group looked up like full attention (from the left, to the first
    miss) would differ from vLLM on the junction workload: the comparison can fail."""
    from transformers import AutoTokenizer

    from mini_vllm import LLM
    from mini_vllm.tools.compare_vllm import MAX_NUM_BATCHED_TOKENS, build_hybrid_workloads, run_mini_workloads
    from mini_vllm.engine_parts import EngineParts
    from mini_vllm.kv_cache_manager import longest_cache_hit
    from mini_vllm.model import hybrid_model_path

    def from_the_left(block_pool, block_hashes, max_num_blocks, num_contiguous_blocks, kv_cache_group_id):
        return longest_cache_hit(
            block_hashes[:max_num_blocks], lambda h: block_pool.get_cached_block(h, kv_cache_group_id)
        )

    path = hybrid_model_path()
    run = side_by_side["runs"][0]
    llm = LLM(
        path,
        device="cpu",
        block_size=run["block_size"],
        num_blocks=run["num_blocks"],
        max_model_len=512,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        parts=EngineParts(find_sliding_window_cache_hit=from_the_left),
    )
    (junction,) = build_hybrid_workloads(AutoTokenizer.from_pretrained(path), run["block_size"], ["junction"])
    (wrong,) = run_mini_workloads(llm, [junction])
    vllm_cached = [row["vllm_cached"] for row in workloads(side_by_side)["junction"]["rows"]]
    assert [r["num_cached_tokens"] for r in wrong["requests"]] != vllm_cached


# -- SmolLM2-135M re-laid as the hybrid layouts people serve (config override, same weights) -------------
# (pattern, pool, workloads, settings for both engines). The pools of the eviction runs are the smallest
# vLLM accepts at max_model_len 512, block size 32, window 64 (its start-up check: 16 blocks for the
# full-attention group, 17 per sliding-window group, and its null block): 2:1 50, 5:1 101, every layer
# sliding 17.
RELAID = [
    ("ssf", 50, ["eviction_and_preemption"], {}),
    ("sssssf", 101, ["eviction_and_preemption"], {}),
    ("s", 17, ["eviction_and_preemption"], {}),
    ("sssssf", 240, ["junction", "multi_turn_chat"], {}),
    ("s", 64, ["junction", "multi_turn_chat"], {}),
    ("ssf", 160, ["junction", "multi_turn_chat"], {}),
    ("ssf", 160, ["multi_turn_chat"], {"prefix_cache_retention_interval": None}),
    ("ssf", 160, ["multi_turn_chat"], {"prefix_cache_retention_interval": 64}),
    ("ssf", 160, ["multi_turn_chat"], {"disable_hybrid_kv_cache_manager": True}),
]
RELAID_OPT_IN = "MINI_VLLM_RELAID_E2E"


@pytest.fixture(scope="module")
def relaid(tmp_path_factory) -> dict:
    """Every RELAID engine, one vLLM subprocess for all of them (minutes: opt-in, see RELAID_OPT_IN)."""
    import os

    if not os.environ.get(RELAID_OPT_IN):
        pytest.skip(f"{RELAID_OPT_IN}=1 runs the re-laid layouts against real vLLM (about 10 minutes)")
    if vllm_python() is None:
        missing("vllm", vllm_missing_reason())
    from mini_vllm.tools.compare_vllm.harness import run_relaid_side_by_side
    from mini_vllm.tools.real_model import real_model_path

    path = real_model_path()
    if path is None:
        missing("real-model", "SmolLM2-135M-Instruct is not installed: run `make real-model`")
    return run_relaid_side_by_side(path, RELAID, str(tmp_path_factory.mktemp("relaid")))


@pytest.mark.parametrize("index", range(len(RELAID)), ids=[f"{p}-{n}-{s}" for p, n, _, s in RELAID])
def test_every_layout_gets_the_same_hits_and_tokens_as_vllm(relaid, index):
    run = relaid["runs"][index]
    pattern = run["pattern"]
    groups = (run["vllm_kv_cache"] or {}).get("groups", [])
    if not run["settings"].get("disable_hybrid_kv_cache_manager"):  # vLLM's groups: as many as ours
        from mini_vllm.kv_cache_interface import make_kv_cache_config

        windows = [64 if pattern[i % len(pattern)] == "s" else None for i in range(30)]
        assert len(groups) == len(make_kv_cache_config(windows, 32, 1).kv_cache_groups), groups
    for workload in run["workloads"]:
        different = [row for row in workload["rows"] if not (row["cached_equal"] and row["tokens_equal"])]
        assert not different, f"{pattern} {run['settings']} {workload['name']}: {different}"
        assert workload["counters_equal"] and workload["same_num_requests"], (workload["mini"], workload["vllm"])
        assert workload["mini"]["num_preemptions"] == workload["vllm"]["num_preemptions"]


def test_retention_changes_what_the_next_turn_of_a_chat_hits(relaid):
    """Under retention 0 a turn hits at most up to where the previous prompt ended (the reply's blocks were
    never cached); every block cached (None), or the hybrid manager off, hits at least as much."""
    cached = {
        (run["pattern"], tuple(sorted(run["settings"].items()))): [row["mini_cached"] for row in workload["rows"]]
        for run in relaid["runs"]
        for workload in run["workloads"]
        if workload["name"] == "multi_turn_chat" and run["pattern"] == "ssf"
    }
    sparse = cached[("ssf", ())]
    dense = cached[("ssf", (("prefix_cache_retention_interval", None),))]
    off = cached[("ssf", (("disable_hybrid_kv_cache_manager", True),))]
    assert all(d >= s for d, s in zip(dense, sparse)) and all(o >= s for o, s in zip(off, sparse))
