"""EngineStats: the engine's step count over the scheduler's counters (mini_vllm/engine_stats.py).

Every flat name the chapters, the command line, the router and ``/metrics`` read is derived
from the one ``SchedulerStats`` it holds; nothing is copied, so nothing can disagree.
"""

from __future__ import annotations

import dataclasses

import pytest

from mini_vllm.kv_cache_manager import PrefixCacheStats
from mini_vllm.llm_engine import EngineStats
from mini_vllm.scheduler import SchedulerStats

# The names (and their order) the chapters print and tools read: chapter A lists them.
METRIC_NAMES = (
    "num_steps",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "hit_rate",
    "num_preemptions",
    "num_evictions",
    "num_blocks",
    "num_blocks_in_use",
    "num_running",
    "num_waiting",
    "prefix_cache_requests",
    "prefix_cache_preempted_requests",
    "prefix_cache_preempted_queries",
    "prefix_cache_preempted_hits",
)


def make_stats() -> EngineStats:
    counters = PrefixCacheStats(
        requests=3, queries=40, hits=10, preempted_requests=1, preempted_queries=12, preempted_hits=8
    )
    scheduler_stats = SchedulerStats(
        num_running_reqs=2,
        num_waiting_reqs=5,
        num_preemptions=1,
        num_blocks=32,
        num_free_blocks=20,
        num_evictions=4,
        prefix_cache_stats=counters,
    )
    return EngineStats(num_steps=7, scheduler_stats=scheduler_stats)


def test_every_name_is_read_from_the_scheduler_stats():
    stats = make_stats()
    assert EngineStats.metric_names() == METRIC_NAMES
    assert {name: getattr(stats, name) for name in METRIC_NAMES} == {
        "num_steps": 7,
        "prefix_cache_queries": 40,
        "prefix_cache_hits": 10,
        "hit_rate": 0.25,
        "num_preemptions": 1,
        "num_evictions": 4,
        "num_blocks": 32,
        "num_blocks_in_use": 12,
        "num_running": 2,
        "num_waiting": 5,
        "prefix_cache_requests": 3,
        "prefix_cache_preempted_requests": 1,
        "prefix_cache_preempted_queries": 12,
        "prefix_cache_preempted_hits": 8,
    }
    # One owner: the flat names follow the counters they are read from.
    stats.scheduler_stats.prefix_cache_stats.hits = 20
    assert (stats.prefix_cache_hits, stats.hit_rate) == (20, 0.5)


def test_the_names_are_read_only():
    stats = make_stats()
    with pytest.raises(AttributeError):
        stats.prefix_cache_hits = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_steps = 0


def test_the_repr_lists_the_flat_names_as_before():
    assert repr(make_stats()) == (
        "EngineStats(num_steps=7, prefix_cache_queries=40, prefix_cache_hits=10, hit_rate=0.25, "
        "num_preemptions=1, num_evictions=4, num_blocks=32, num_blocks_in_use=12, num_running=2, "
        "num_waiting=5, prefix_cache_requests=3, prefix_cache_preempted_requests=1, "
        "prefix_cache_preempted_queries=12, prefix_cache_preempted_hits=8)"
    )


def test_equal_counters_are_equal_stats():
    assert make_stats() == make_stats()
    other = make_stats()
    other.scheduler_stats.num_evictions += 1
    assert other != make_stats()
