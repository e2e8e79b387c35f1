"""mini-vLLM's KV-event stream equals real vLLM's, both decoded by vLLM's own ``KVEventBatch``.

The same workloads, the same ``--kv-events-config`` (vLLM's defaults, topic ``""``), the same
``PYTHONHASHSEED``: every ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` must be equal,
field by field (hashes as vLLM sends them by default, parents, token ids, block size, group,
medium, extra keys, the group's kind), in the same order. ``mini_vllm/tools/compare_kv_events.py``
runs both; vLLM runs from ``.venv-vllm`` (``make vllm``), and both streams are decoded again by
vLLM 0.33.0's classes, from its wheel's Python files (``benchmarks/get_vllm_source.sh``, which
``make test-unit`` runs first).
"""

from __future__ import annotations

import pytest

from mini_vllm.model import default_model_path
from mini_vllm.tools.compare_kv_events import compare_streams, first_difference, flat_events
from mini_vllm.tools.compare_vllm import build_workloads, vllm_missing_reason, vllm_python
from prerequisites import missing, under_ci
from test_vs_vllm_kv_cache_manager import release_source

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# Stored blocks, chained parents (a growing chat), evictions (BlockRemoved) and salts (extra keys).
WORKLOADS = ("shared_system_prompt", "multi_turn_chat", "eviction_and_preemption", "cache_salt_tenants")


@pytest.fixture(scope="module")
def streams():
    if vllm_python() is None:
        missing("vllm", vllm_missing_reason())
    from transformers import AutoTokenizer

    path = str(default_model_path())
    workloads = build_workloads(AutoTokenizer.from_pretrained(path), 32, WORKLOADS)
    source = release_source("0.33.0", ci=under_ci())
    return compare_streams(path, block_size=32, num_blocks=24, workloads=workloads, release_source=str(source))


def test_both_streams_decode_with_vllms_classes_to_the_same_events(streams):
    mini, vllm = flat_events(streams["mini"]), flat_events(streams["vllm"])
    assert first_difference(mini, vllm) is None
    kinds = {event["type"] for event in vllm}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}  # the workloads exercise all three
    assert any(e["type"] == "BlockStored" and e["parent_block_hash"] is not None for e in vllm)
    assert any(e["type"] == "BlockStored" and any(e["extra_keys"] or ()) for e in vllm)  # a salt


def test_vllm_0_33s_classes_decode_both_streams_to_the_same_events(streams):
    release = streams["release"]
    assert release["version"].startswith("0.33.0")
    mini, vllm = flat_events(release["mini"]), flat_events(release["vllm"])
    assert first_difference(mini, vllm) is None
    assert len(vllm) == len(flat_events(streams["vllm"]))


def test_both_streams_number_their_batches_from_0_on_vllms_default_topic(streams):
    for name in ("mini", "vllm"):
        batches = streams[name]
        assert [b["seq"] for b in batches] == list(range(len(batches))), name
        assert {b["topic"] for b in batches} == {""}, name
        assert {b["data_parallel_rank"] for b in batches} == {0}, name
