"""The hybrid model end to end, mini-vLLM against real vLLM (``make vllm``): chapter 08b's claims.

``mini_vllm.tools.compare_vllm.run_hybrid_side_by_side`` sends the same token ids
through both engines, the bundled hybrid model (``mini_vllm/hybrid_model/``:
sliding-window layers 0 and 2, window 64, full-attention layers 1 and 3),
float32, block size 32, the same pool and scheduler limits, each workload
from a cold cache. vLLM runs it with ``model_impl="transformers"`` (its native
Qwen3 implements no per-layer window: it refuses this config). Requests: prompts longer
than the window, shared prefixes that diverge (the junction), the same prompt
again, a growing chat, and a pool so small that requests are preempted.

Then SmolLM2-135M-Instruct (``make real-model``), its first 6 layers re-laid by
its ``config.json`` as the layouts people serve (2:1, Gemma 3's 5:1, every
layer sliding), in the smallest pool vLLM accepts and a roomy one, and chapter
08b's chat under each ``prefix_cache_retention_interval`` and with the hybrid
manager off (``RELAID``; ``run_relaid_side_by_side``, both engines at once).

Equal per request: ``num_cached_tokens`` and the greedy tokens; per workload:
the prefix-cache counters and the preemptions. vLLM starts once per half (one
subprocess, ~1 min each on 2 cores). Skipped, with the reason, without ``.venv-vllm``
or the real model; under ``CI=true`` that is a failure (tests/prerequisites.py).
"""

from __future__ import annotations

import pytest

from mini_vllm.tools.compare_vllm import (
    CHAT_LAYOUTS,
    CHAT_NUM_LAYERS,
    run_hybrid_side_by_side,
    vllm_missing_reason,
    vllm_python,
)
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


# -- SmolLM2-135M re-laid as the hybrid layouts people serve (config override, its first 6 layers) -------
# Its first RELAID_NUM_LAYERS layers (their real weights) keep what is compared, the grouping, as on all 30:
# vLLM's group size is the smallest bucket, so 2:1 gives 2 sliding-window groups and 1 full-attention group
# (4 + 2 layers; 20 + 10 of 30), 5:1 gives 5 + 1 (5 + 1; 25 + 5), all sliding gives 1; no layout pads, on
# 6 layers or 30. Five times fewer layers make every forward pass cheaper: the set fits in make test.
# (pattern, pool, workloads, settings for both engines). The pools of the eviction runs are the smallest
# vLLM accepts at max_model_len 512, block size 32, window 64 (its start-up check: 16 blocks for the
# full-attention group, 17 per sliding-window group, and its null block): 2:1 50, 5:1 101, every layer
# sliding 17. Chapter 08b's chat (CHAT_LAYOUTS: 5:1 in a roomy pool under retention 0, None and 128 and the
# hybrid manager off) is part of the set: its committed reference is checked against this live run.
RELAID_NUM_LAYERS = CHAT_NUM_LAYERS
RELAID = [
    ("ssf", 50, ["eviction_and_preemption"], {}),
    ("sssssf", 101, ["eviction_and_preemption", "junction"], {}),
    ("s", 17, ["eviction_and_preemption"], {}),
    *CHAT_LAYOUTS,
    ("s", 64, ["junction", "multi_turn_chat"], {}),
    ("ssf", 160, ["junction", "multi_turn_chat"], {}),
]


@pytest.fixture(scope="module")
def relaid(tmp_path_factory) -> dict:
    """Every RELAID engine, one vLLM subprocess for all of them, beside mini-vLLM's (about a minute on 2 cores)."""
    if vllm_python() is None:
        missing("vllm", vllm_missing_reason())
    from mini_vllm.tools.compare_vllm.harness import run_relaid_side_by_side
    from mini_vllm.tools.real_model import real_model_path

    path = real_model_path()
    if path is None:
        missing("real-model", "SmolLM2-135M-Instruct is not installed: run `make real-model`")
    folder = str(tmp_path_factory.mktemp("relaid"))
    return run_relaid_side_by_side(path, RELAID, folder, num_layers=RELAID_NUM_LAYERS, at_once=True)


@pytest.mark.parametrize("index", range(len(RELAID)), ids=[f"{p}-{n}-{s}" for p, n, _, s in RELAID])
def test_every_layout_gets_the_same_hits_and_tokens_as_vllm(relaid, index):
    run = relaid["runs"][index]
    pattern = run["pattern"]
    groups = (run["vllm_kv_cache"] or {}).get("groups", [])
    if not run["settings"].get("disable_hybrid_kv_cache_manager"):  # vLLM's groups: as many as ours
        from mini_vllm.kv_cache_interface import make_kv_cache_config

        windows = [64 if pattern[i % len(pattern)] == "s" else None for i in range(relaid["num_layers"])]
        assert len(groups) == len(make_kv_cache_config(windows, 32, 1).kv_cache_groups), groups
    for workload in run["workloads"]:
        different = [row for row in workload["rows"] if not (row["cached_equal"] and row["tokens_equal"])]
        assert not different, f"{pattern} {run['settings']} {workload['name']}: {different}"
        assert workload["counters_equal"] and workload["same_num_requests"], (workload["mini"], workload["vllm"])
        assert workload["mini"]["num_preemptions"] == workload["vllm"]["num_preemptions"]


def test_six_layers_group_as_thirty_do(relaid):
    """The reason 6 layers stand for 30: vLLM 0.33's rule gives each layout the same groups on both."""
    from mini_vllm.kv_cache_interface import make_kv_cache_config

    def group_sizes(pattern: str, num_layers: int) -> list[int]:
        windows = [64 if pattern[i % len(pattern)] == "s" else None for i in range(num_layers)]
        return [len(group.layer_ids) for group in make_kv_cache_config(windows, 32, 1).kv_cache_groups]

    assert relaid["num_layers"] == RELAID_NUM_LAYERS
    for pattern, expected in (("ssf", [2, 2, 2]), ("sssssf", [1] * 6), ("s", [6])):
        six, thirty = group_sizes(pattern, 6), group_sizes(pattern, 30)
        assert sorted(six) == expected and len(thirty) == len(six), (pattern, six, thirty)
    vllm_groups = {run["pattern"]: len(run["vllm_kv_cache"]["groups"]) for run in relaid["runs"] if not run["settings"]}
    assert vllm_groups == {"ssf": 3, "sssssf": 6, "s": 1}


def test_the_small_pools_evict_and_preempt(relaid):
    """The smallest pools are small enough to matter: each layout's eviction workload preempts."""
    for run in relaid["runs"][:3]:
        (eviction, *_) = run["workloads"]
        assert eviction["mini"]["num_preemptions"] > 0, (run["pattern"], eviction["mini"])


def test_retention_changes_what_the_next_turn_of_a_chat_hits(relaid):
    """Under retention 0 a turn hits at most up to where the previous prompt ended (the reply's blocks were
    never cached); every block cached (None), or the hybrid manager off, hits at least as much."""
    cached = {
        tuple(sorted(run["settings"].items())): [row["mini_cached"] for row in workload["rows"]]
        for run in relaid["runs"]
        for workload in run["workloads"]
        if workload["name"] == "multi_turn_chat" and run["pattern"] == "sssssf"
    }
    sparse = cached[()]
    dense = cached[(("prefix_cache_retention_interval", None),)]
    off = cached[(("disable_hybrid_kv_cache_manager", True),)]
    assert all(d >= s for d, s in zip(dense, sparse)) and all(o >= s for o, s in zip(off, sparse))
    assert dense != sparse  # the chat is long enough for the setting to show


def _what_is_compared(run: dict) -> dict:
    """A run's per-request hits and token verdicts and per-workload counters, without the timings."""
    untimed = ("mini_ttft_s", "vllm_ttft_s")
    counters = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")
    return {
        workload["name"]: {
            "rows": [{k: v for k, v in row.items() if k not in untimed} for row in workload["rows"]],
            "mini": {k: workload["mini"][k] for k in counters},
            "vllm": {k: workload["vllm"][k] for k in counters},
        }
        for workload in run["workloads"]
    }


def test_chapter_08b_chat_reference_is_what_a_live_run_gives(relaid):
    """Chapter 08b shows the committed chat where vLLM is missing: it must be what vLLM and mini-vLLM give now
    (after a change, `python -m mini_vllm compare-vllm --write-references` writes it again)."""
    import json

    from mini_vllm.tools.compare_vllm import CHAT_REFERENCE_RUN, reference_path

    committed = json.loads(reference_path(CHAT_REFERENCE_RUN).read_text())
    assert committed["num_layers"] == relaid["num_layers"]
    live = {(run["pattern"], run["num_blocks"], json.dumps(run["settings"])): run for run in relaid["runs"]}
    for run in committed["runs"]:
        now = _what_is_compared(live[(run["pattern"], run["num_blocks"], json.dumps(run["settings"]))])
        for name, then in _what_is_compared(run).items():
            assert then == now[name], (run["settings"], name)


def test_chapter_08b_chat_reference_has_every_setting_and_equal_engines():
    """Without vLLM: the committed chat has a run per setting, one row per turn, and both engines agree."""
    import json

    from mini_vllm.tools.compare_vllm import CHAT_LAYOUTS, CHAT_NUM_LAYERS, CHAT_REFERENCE_RUN, reference_path

    committed = json.loads(reference_path(CHAT_REFERENCE_RUN).read_text())
    assert committed["num_layers"] == CHAT_NUM_LAYERS
    assert [(r["pattern"], r["num_blocks"], r["settings"]) for r in committed["runs"]] == [
        (pattern, num_blocks, settings) for pattern, num_blocks, _, settings in CHAT_LAYOUTS
    ]
    for run in committed["runs"]:
        (chat,) = run["workloads"]
        assert chat["name"] == "multi_turn_chat" and len(chat["rows"]) == 5
        assert chat["cached_equal"] and chat["tokens_equal"] and chat["counters_equal"]


def test_relay_model_keeps_the_first_layers_real_weights_and_refuses_a_layer_count_it_lacks(tmp_path):
    """Without vLLM, on the bundled model (4 layers): 2 kept, every other tensor unchanged, layer_types for 2."""
    import json

    from safetensors import safe_open

    from mini_vllm.model import default_model_path
    from mini_vllm.tools.compare_vllm.harness import relay_model

    source = default_model_path()
    target = relay_model(source, "sf", 64, str(tmp_path), num_layers=2)
    config = json.loads((tmp_path / "default_model-sf-2-layers" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["layer_types"]) == (2, ["sliding_attention", "full_attention"])
    with safe_open(f"{source}/model.safetensors", "pt") as full, safe_open(f"{target}/model.safetensors", "pt") as kept:
        expected = [name for name in full.keys() if ".layers.2." not in name and ".layers.3." not in name]
        assert sorted(kept.keys()) == sorted(expected) and len(expected) < len(list(full.keys()))
        assert all(kept.get_tensor(name).equal(full.get_tensor(name)) for name in expected)
    for wrong in (0, 5):
        with pytest.raises(ValueError, match="num_layers must be 1..4"):
            relay_model(source, "sf", 64, str(tmp_path / f"wrong-{wrong}"), num_layers=wrong)
