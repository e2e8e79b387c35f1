"""The file-system tier below the CPU tier (vLLM's ``secondary_tiers: [{"type": "fs", ...}]``), in the engine.

Three 64-token prefixes, each with 5 tokens of its own, are written through
the CPU tier to disk by one engine; a second engine, in a new process with
the same ``PYTHONHASHSEED`` and ``root_dir``, gets each prefix back from disk:
64 cached tokens, counted as external hits as vLLM counts them, and the same
greedy tokens as an engine without tiers (the new process costs about 10 s
on a busy 2-core machine: torch, the model). A truncated or padded file is
deleted and recomputed, not served; the blocks before it stay hits. Other
settings (block size, model, dtype) write to another folder. Bad settings
are a ValueError naming the key.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from mini_vllm import LLM, SamplingParams
from mini_vllm.config import EngineConfig
from mini_vllm.events import BlockStored
from mini_vllm.hashing import hash_request_tokens
from mini_vllm.kv_offload import CPUOffloadingManager, LookupResult, ReqContext, make_offload_key
from mini_vllm.kv_offload.file_mapper import FileMapper
from mini_vllm.kv_offload.fs_tier import FileSystemTierManager
from mini_vllm.kv_offload.tiering import TieringOffloadingManager

PREFIX, SUFFIX, BLOCK_SIZE = 64, 5, 16
rng = random.Random(1)
PROMPTS = [[rng.randrange(100, 1000) for _ in range(PREFIX + SUFFIX)] for _ in range(3)]
GREEDY = SamplingParams(max_tokens=4, temperature=0)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fs_config(root_dir, **tier) -> dict:
    return {
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [{"type": "fs", "root_dir": str(root_dir), **tier}],
        }
    }


def make_llm(root_dir=None, block_size=BLOCK_SIZE, **tier) -> LLM:
    settings = (
        {} if root_dir is None else {"kv_offloading_size": 0.01, "kv_transfer_config": fs_config(root_dir, **tier)}
    )
    return LLM(num_blocks=12, block_size=block_size, max_num_seqs=1, device="cpu", **settings)


def run(llm: LLM, prompts=PROMPTS) -> list[tuple[list[int], int]]:
    """Each prompt, one at a time: (greedy tokens, cached tokens)."""
    outputs = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0] for p in prompts]
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outputs]


def block_file(llm: LLM, prompt: list[int], index: int) -> str:
    """The file of block ``index`` of ``prompt`` in ``llm``'s fs tier."""
    tier = llm.llm_engine.scheduler.connector.manager.secondary_tier
    return tier.file_mapper.get_file_name(make_offload_key(hash_request_tokens(prompt, BLOCK_SIZE)[index], 0))


@pytest.fixture(scope="module")
def without_tiers():
    return run(make_llm())


# -- a second engine, in a new process --------------------------------------------------------
ENGINE_PROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from test_kv_offload_fs import make_llm, run
llm = make_llm({root_dir!r})
results = run(llm)
stats = llm.llm_engine.scheduler.make_stats()
external = stats.connector_prefix_cache_stats
print(json.dumps({{"results": results, "pool_hits": stats.prefix_cache_stats.hits,
                  "external": [external.queries, external.hits]}}))
"""


def engine_process(root_dir) -> dict:
    """A new engine in a new process, with this process's PYTHONHASHSEED (set or not, the same NONE_HASH)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    code = ENGINE_PROCESS.format(tests=os.path.dirname(os.path.abspath(__file__)), root_dir=str(root_dir))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_engine_in_a_new_process_gets_its_prompts_from_disk(tmp_path, without_tiers):
    assert [cached for _, cached in run(make_llm(tmp_path))] == [0, 0, 0]  # written through to disk
    second = engine_process(tmp_path)
    assert [cached for _, cached in second["results"]] == [PREFIX] * 3
    assert [tokens for tokens, _ in second["results"]] == [tokens for tokens, _ in without_tiers]
    # vLLM's counters: the pool had nothing, the tiers every prefix (external hits, as CPU-tier hits are).
    assert second["pool_hits"] == 0
    assert second["external"] == [3 * (PREFIX + SUFFIX), 3 * PREFIX]


# -- files that cannot be served -----------------------------------------------------------------
def test_a_truncated_or_padded_file_is_recomputed_not_served(tmp_path, without_tiers):
    writer = make_llm(tmp_path)
    run(writer)
    truncated, padded = block_file(writer, PROMPTS[0], 2), block_file(writer, PROMPTS[1], 0)
    size = os.path.getsize(truncated)
    with open(truncated, "r+b") as f:
        f.truncate(size // 2)
    with open(padded, "ab") as f:
        f.write(b"\0" * 8)
    reader = make_llm(tmp_path)  # a new CPU tier, the same disk
    results = run(reader)
    # Prompt 0 keeps its two blocks before the bad one; prompt 1's first block is bad: nothing from disk.
    assert [cached for _, cached in results] == [2 * BLOCK_SIZE, 0, PREFIX]
    assert [tokens for tokens, _ in results] == [tokens for tokens, _ in without_tiers]
    # The bad files were deleted, and the recomputed blocks written through again, whole.
    assert os.path.getsize(truncated) == os.path.getsize(padded) == size


def test_the_comparison_fails_on_a_file_of_the_right_size_with_other_bytes(tmp_path, without_tiers):
    """A file's bytes are served as they are (vLLM's tier has no checksum either): altered, the tokens change."""
    writer = make_llm(tmp_path)
    run(writer, PROMPTS[:1])
    for index in range(4):
        path = block_file(writer, PROMPTS[0], index)
        with open(path, "r+b") as f:
            f.write(torch.randn(os.path.getsize(path) // 4).numpy().tobytes())
    results = run(make_llm(tmp_path), PROMPTS[:1])
    assert results[0][1] == PREFIX and results[0][0] != without_tiers[0][0]


# -- settings ----------------------------------------------------------------------------------------
def test_other_settings_never_share_files(tmp_path):
    run(make_llm(tmp_path), PROMPTS[:1])
    other_block_size = make_llm(tmp_path, block_size=32)
    assert run(other_block_size, PROMPTS[:1])[0][1] == 0
    folders = sorted(name for name in os.listdir(tmp_path))
    assert len(folders) == 4  # two settings: each a folder with config.json and a folder of block files (_r0)
    configs = [json.load(open(tmp_path / name / "config.json")) for name in folders if not name.endswith("_r0")]
    assert sorted(config["tokens_per_hash"] for config in configs) == [16, 32]
    base = {
        "root_dir": "/kv",
        "model_name": "m",
        "tokens_per_hash": 16,
        "dtype": "torch.float32",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["model.layers.0.self_attn.attn"]}],
    }
    changes = [
        {"model_name": "m2"},
        {"dtype": "torch.bfloat16"},
        {"tokens_per_hash": 32},
        {"kv_cache_groups": [{"tokens_per_block": 16, "layer_names": []}]},
    ]
    base_paths = {FileMapper(**{**base, **change}).base_path for change in [{}, *changes]}
    assert len(base_paths) == 1 + len(changes)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"secondary_tiers": [{"type": "fs", "root_dir": "/kv"}]}, "needs spec_name 'TieringOffloadingSpec'"),
        ({"spec_name": "TieringOffloadingSpec"}, "needs secondary_tiers"),
        ({"spec_name": "CPUOffloadingSpec", "secondary_tiers": []}, "spec_name must be 'TieringOffloadingSpec'"),
        ({"spec_name": "TieringOffloadingSpec", "secondary_tiers": [{"type": "p2p"}]}, "type 'p2p' not built here"),
        ({"spec_name": "TieringOffloadingSpec", "secondary_tiers": [{"type": "fs"}]}, "needs root_dir"),
        ({"spec_name": "TieringOffloadingSpec", "secondary_tiers": {"type": "fs"}}, "a list of one tier"),
        (
            {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [{"type": "fs", "root_dir": "/a"}] * 2},
            "a list of one tier",
        ),
        (
            {
                "spec_name": "TieringOffloadingSpec",
                "secondary_tiers": [{"type": "fs", "root_dir": "/a", "n_read_threads": 4}],
            },
            r"key\(s\) \['n_read_threads'\] not built here",
        ),
        (
            {
                "spec_name": "TieringOffloadingSpec",
                "secondary_tiers": [{"type": "fs", "root_dir": "/a", "enable_kv_events": 1}],
            },
            "enable_kv_events must be true or false",
        ),
    ],
)
def test_bad_tier_settings_are_a_value_error_naming_them(extra, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(kv_offloading_size=1, kv_transfer_config={"kv_connector_extra_config": extra})


# -- events, opt-in, with their medium ------------------------------------------------------------------
@pytest.mark.parametrize("enable_kv_events", [False, True])
def test_the_fs_tier_publishes_its_stores_with_medium_storage_when_asked(tmp_path, enable_kv_events):
    llm = make_llm(tmp_path, enable_kv_events=enable_kv_events)
    events = []
    llm.llm_engine.add_listener(events.append)
    run(llm, PROMPTS[:1])
    stored = [h for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE" for h in e.block_hashes]
    assert stored == (list(hash_request_tokens(PROMPTS[0], BLOCK_SIZE)) if enable_kv_events else [])
    assert all(os.path.exists(block_file(llm, PROMPTS[0], i)) for i in range(4))


# -- the tiering manager alone ------------------------------------------------------------------------
def test_a_promotion_never_evicts_the_blocks_its_own_lookup_found(tmp_path):
    """Two CPU chunks, three blocks on disk: the third cannot come up without evicting the first two, so it is a MISS."""
    mapper = FileMapper(str(tmp_path), "m", 16, "torch.float32", [])
    tier = FileSystemTierManager(mapper)
    tier.register_host_caches([(torch.arange(2 * 4.0).reshape(2, 4), torch.zeros(2, 4))])
    manager = TieringOffloadingManager(CPUOffloadingManager(2), tier)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
    writer = ReqContext("writer")
    for key in keys:  # each one stored (written through to disk), evicting the oldest from the CPU tier
        output = manager.prepare_store([key], writer)
        manager.complete_store(output.keys_to_store, writer)
    assert all(tier.lookup(key) for key in keys) and set(manager.resident()) == set(keys[1:])
    reader = ReqContext("reader")
    assert [manager.lookup(key, reader) for key in keys] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    # keys[0] came up evicting keys[1], keys[1] evicting keys[2]; keys[2] would have had to evict one of them.
    assert set(manager.resident()) == set(keys[:2]) and manager.num_promoted_keys == 2
    assert sorted(manager.prepare_load(keys[:2], reader).chunk_ids) == [0, 1]
