"""What a CPU tier's eviction policy is asked, and the status of one stored chunk.

The CPU tier (``cpu_manager.py``) keeps one *chunk* per key: a slot in its
host tensors and a reference count. Which chunks it holds, in which order,
and which one leaves when room is needed is the *cache policy's*: LRU
(``lru.py``) or ARC (``arc.py``). The two differ in how they keep their
chunks (one recency order; ARC's four lists) as much as in whom they evict,
so the policy owns both the chunk map and the eviction decision; the manager
owns the chunk pool, the reference counts and the events.

A chunk's ``ref_cnt``:

* ``-1``: its store is in flight, nobody may read it (``lookup`` says HIT_PENDING);
* ``0``: stored and idle, the only state in which it may be evicted;
* ``> 0``: that many loads are reading it.

vLLM equivalent: ``vllm/v1/kv_offload/cpu/policies/base.py`` (``ChunkStatus``,
``CachePolicy``, ``order_request_keys``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

from .base import OffloadKey, ReqContext

STORE_IN_FLIGHT = -1  # ref_cnt of a chunk whose store has not completed


class ChunkStatus:
    """One chunk of the tier: its slot (``chunk_id``) and how many use it (``ref_cnt``, see the module docstring)."""

    __slots__ = ("chunk_id", "ref_cnt")

    def __init__(self, chunk_id: int) -> None:
        self.chunk_id = chunk_id
        self.ref_cnt = STORE_IN_FLIGHT  # a chunk is allocated for a store

    @property
    def is_ready(self) -> bool:
        """Stored, so it can be read."""
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"ChunkStatus(chunk_id={self.chunk_id}, ref_cnt={self.ref_cnt})"


def order_request_keys(key_groups: Sequence[Sequence[OffloadKey]], req_context: ReqContext) -> list[OffloadKey]:
    """A request's keys, every group's, in one head-to-tail order (by end position when all are known)."""
    keys = [key for group in key_groups for key in group]
    if all(req_context.get_offload_key_position(key) is not None for key in keys):
        keys.sort(key=req_context.get_offload_key_position)
    return keys


class CachePolicy(ABC):
    """The chunks a CPU tier holds and the choice of which to evict; ``cache_capacity`` chunks at most."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """The chunk stored (or being stored) under ``key``, or None."""

    @abstractmethod
    def keys(self) -> list[OffloadKey]:
        """Every key held (stored or being stored), in the policy's own order."""

    @abstractmethod
    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        """A chunk just allocated for a store."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget a chunk whose store failed."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Mark chunks as used just now."""

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keys a request offers to store that the tier does not hold (seen once per request)."""
        self.touch(keys, req_context)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keys a request uses for the first time (looked up and loaded, or offered for a store)."""

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """A finished request's keys, per group in prefix order: the ones it only stored and the ones it reused."""
        for keys in key_groups:
            self.touch(keys, req_context)

    @abstractmethod
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Evict exactly ``n`` idle chunks not in ``protected``, or nothing at all and None when there are not ``n``."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every chunk, whatever its ref_cnt, and the policy's own state."""

    def mark_evictable(self, key: OffloadKey) -> None:
        """The chunk's ref_cnt has just become 0."""

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """The chunk's ref_cnt has just left 0."""
