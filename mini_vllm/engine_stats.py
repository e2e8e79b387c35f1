"""``EngineStats``: the engine's step count over the scheduler's counters (what ``LLMEngine.get_stats`` returns).

vLLM equivalent: ``vllm/v1/metrics/stats.py`` (``SchedulerStats``,
``PrefixCacheStats``), read by its ``StatLoggers``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scheduler import SchedulerStats


@dataclass(frozen=True)
class EngineStats:
    """Engine-wide counters (vLLM: ``vllm:prefix_cache_*``, ``vllm:num_preemptions``, ``vllm:kv_cache_usage_perc``).

    Owns only ``num_steps``; every other number is the scheduler's
    (``scheduler_stats``, from ``Scheduler.make_stats``), read through the flat
    names below that the chapters, the command line, the router and
    ``/metrics`` use. The prefix-cache counters are
    ``KVCacheManager.prefix_cache_stats``, as vLLM 0.33 counts them: one
    lookup per admitted request, re-admissions after preemption apart
    (``prefix_cache_preempted_*``), nothing with caching off. ``hit_rate``
    is ``prefix_cache_hits / prefix_cache_queries``.
    """

    num_steps: int
    scheduler_stats: SchedulerStats

    @property
    def prefix_cache_queries(self) -> int:
        return self.scheduler_stats.prefix_cache_stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.scheduler_stats.prefix_cache_stats.hits

    @property
    def hit_rate(self) -> float:
        return self.scheduler_stats.prefix_cache_stats.hit_rate

    @property
    def num_preemptions(self) -> int:
        return self.scheduler_stats.num_preemptions

    @property
    def num_evictions(self) -> int:
        return self.scheduler_stats.num_evictions

    @property
    def num_blocks(self) -> int:
        return self.scheduler_stats.num_blocks

    @property
    def num_blocks_in_use(self) -> int:
        return self.scheduler_stats.num_blocks - self.scheduler_stats.num_free_blocks

    @property
    def num_running(self) -> int:
        return self.scheduler_stats.num_running_reqs

    @property
    def num_waiting(self) -> int:
        return self.scheduler_stats.num_waiting_reqs

    @property
    def prefix_cache_requests(self) -> int:
        return self.scheduler_stats.prefix_cache_stats.requests

    @property
    def prefix_cache_preempted_requests(self) -> int:
        return self.scheduler_stats.prefix_cache_stats.preempted_requests

    @property
    def prefix_cache_preempted_queries(self) -> int:
        return self.scheduler_stats.prefix_cache_stats.preempted_queries

    @property
    def prefix_cache_preempted_hits(self) -> int:
        return self.scheduler_stats.prefix_cache_stats.preempted_hits

    @classmethod
    def metric_names(cls) -> tuple[str, ...]:
        """Every name a reader can take from the stats: ``num_steps``, then the properties above, in order."""
        return ("num_steps", *(name for name, value in vars(cls).items() if isinstance(value, property)))

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.metric_names())
        return f"EngineStats({values})"
