"""LRU eviction for the CPU tier: the idle chunk used longest ago leaves first.

Every chunk has a *rank*, a pair compared as a tuple; the smallest idle one
is evicted first. A use gives a chunk a fresh rank ``(next_rank, 0)``, above
every rank given before. Within a request the order is by prefix: all of a
request's keys share its *request rank* (taken when the request first uses
the tier) and are ordered by ``-end position``, so that a prefix's tail is
evicted before its head, whose loss would make the tail unreachable anyway
(a lookup walks the hash chain from the head). When the request finishes its
keys are used once more, tail first, so its head ends up the most recent.

A rank is the chunk's recency whether or not it is pinned: a chunk that a
load is reading keeps its rank and is simply not a candidate until its
``ref_cnt`` is back to 0.

The eviction choice itself is :func:`lru_evict`, a function of the policy,
so that an engine may be given another one (``EngineParts.lru_evict``, the
offloading chapter's exercise).

vLLM equivalent: ``vllm/v1/kv_offload/cpu/policies/lru.py`` (``LRUCachePolicy``),
which keeps the idle chunks in a lazily invalidated heap; here the candidates
are sorted when an eviction needs them, which picks the same chunks, the
smallest ``(rank, key)`` first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from .base import OffloadKey, ReqContext
from .cache_policy import CachePolicy, ChunkStatus, order_request_keys

Rank = tuple[int, int]  # (a use's number, or the request's, and -end position within the request)
Evicted = list[tuple[OffloadKey, ChunkStatus]]


def lru_evict(policy: LRUCachePolicy, n: int, protected: set[OffloadKey]) -> Evicted | None:
    """Evict ``policy``'s ``n`` idle, unprotected chunks of smallest ``(rank, key)``, oldest first; all or nothing.

    Only keys in ``policy.evictable`` (ref_cnt 0: not being stored or loaded)
    and not in ``protected`` are candidates. Returns ``(key, chunk)`` pairs in
    eviction order, each chunk gone from the policy (``policy.remove``); with
    fewer than ``n`` candidates, None and nothing removed.
    """
    candidates = sorted((policy.ranks[key], key) for key in policy.evictable if key not in protected)
    if len(candidates) < n:
        return None
    evicted = []
    for _, key in candidates[:n]:
        evicted.append((key, policy.chunks[key]))
        policy.remove(key)
    return evicted


class LRUCachePolicy(CachePolicy):
    """``evict``: the eviction choice, ``(policy, n, protected) -> [(key, chunk), ...] | None`` (:func:`lru_evict`)."""

    def __init__(self, cache_capacity: int, evict: Callable[..., Evicted | None] = lru_evict) -> None:
        super().__init__(cache_capacity)
        self.evict_choice = evict
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.ranks: dict[OffloadKey, Rank] = {}
        self.evictable: set[OffloadKey] = set()  # the chunks with ref_cnt 0
        self.next_rank = 0
        # Bumped by clear(): a request's rank taken before a reset is not reused after it.
        self.generation = 0

    def _fresh_rank(self) -> int:
        self.next_rank += 1
        return self.next_rank

    def _request_rank(self, req_context: ReqContext) -> int:
        """The rank all of this request's keys share, taken at its first use of the tier."""
        generation, rank = req_context.notes.get(self, (None, None))
        if generation != self.generation:
            rank = self._fresh_rank()
            req_context.notes[self] = (self.generation, rank)
        return rank

    def _use(self, keys: Iterable[OffloadKey]) -> None:
        """A fresh rank for each stored key, in the order given (the last one is the most recent)."""
        for key in keys:
            if key in self.chunks:
                self.ranks[key] = (self._fresh_rank(), 0)

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def keys(self) -> list[OffloadKey]:
        return list(self.chunks)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.chunks[key] = chunk
        position = req_context.get_offload_key_position(key)
        if position is None:
            self.ranks[key] = (self._fresh_rank(), 0)
        else:
            self.ranks[key] = (self._request_rank(req_context), -position)
        if chunk.ref_cnt == 0:
            self.evictable.add(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self.ranks.pop(key, None)
        self.evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # Given head to tail, used tail first: the head ends up the most recent.
        self._use(reversed(list(keys)))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        request_rank = self._request_rank(req_context)
        for key in keys:
            position = req_context.get_offload_key_position(key)
            if position is None or key not in self.chunks:
                continue
            rank = (request_rank, -position)
            if self.ranks[key] < rank:  # never make a chunk older than it is
                self.ranks[key] = rank

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        self._use(reversed(order_request_keys(key_groups, req_context)))

    def evict(self, n: int, protected: set[OffloadKey]) -> Evicted | None:
        return self.evict_choice(self, n, protected)

    def clear(self) -> None:
        self.chunks.clear()
        self.ranks.clear()
        self.evictable.clear()
        self.next_rank = 0
        self.generation += 1

    def mark_evictable(self, key: OffloadKey) -> None:
        self.evictable.add(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.evictable.remove(key)
