"""ARC eviction for the CPU tier: recency and frequency, balanced by what the tier regrets evicting.

Adaptive Replacement Cache (Megiddo and Modha, 2003) keeps four ordered lists,
oldest first:

* ``t1``: chunks stored and not reused since (recency);
* ``t2``: chunks a request has reused (frequency);
* ``b1`` and ``b2``: *ghosts*, the keys (no data) evicted from ``t1`` and
  ``t2``, each at most ``cache_capacity`` long.

``target_t1_size`` is how large ``t1`` should be. An eviction takes the
oldest idle chunk of ``t1`` while ``t1`` is at least that large, else of
``t2`` (and of the other list when one has none idle). A request offering to
store a key that is a ghost tells the tier it evicted the wrong thing: a
``b1`` ghost moves the target up (recency mattered), a ``b2`` ghost down
(frequency did), by the ratio of the ghost lists' lengths, at least 1.

A stored chunk goes to ``t1``. A finished request moves each chunk it reused
(loaded, or offered again while stored) from ``t1`` to ``t2``, or to ``t2``'s
recent end; a chunk it only stored stays in its list and is made recent
there: a store is not a reuse.

vLLM equivalent: ``vllm/v1/kv_offload/cpu/policies/arc.py`` (``ARCCachePolicy``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from .base import OffloadKey, ReqContext
from .cache_policy import CachePolicy, ChunkStatus, order_request_keys


class ARCCachePolicy(CachePolicy):
    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.t1.get(key) or self.t2.get(key)

    def keys(self) -> list[OffloadKey]:
        return [*self.t1, *self.t2]

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)  # back from the dead: no longer a ghost
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _adapt_to_ghost_hit(self, key: OffloadKey) -> None:
        """Move the target towards the list ``key`` was wrongly evicted from."""
        if key in self.b1:
            step = max(1, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + step, self.cache_capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            step = max(1, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - step, 0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            self._adapt_to_ghost_hit(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                chunk = self.t1.pop(key)
                if chunk.is_ready:
                    self.t2[key] = chunk  # used again: frequent
                else:
                    self.t1[key] = chunk  # only being stored: recent, not frequent
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._adapt_to_ghost_hit(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        for key in reversed(order_request_keys(key_groups, req_context)):
            if key in insertion_only_keys:
                for stored in (self.t1, self.t2):
                    if key in stored:
                        stored.move_to_end(key)
                        break
            elif key in reused_keys and key in self.t1:
                self.t2[key] = self.t1.pop(key)
            elif key in reused_keys and key in self.t2:
                self.t2.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        # Choose all n first (nothing changes if there are fewer than n), then evict them.
        def idle(chunks: Iterator[tuple[OffloadKey, ChunkStatus]]) -> Iterator[tuple[OffloadKey, ChunkStatus]]:
            return ((key, chunk) for key, chunk in chunks if chunk.ref_cnt == 0 and key not in protected)

        t1_idle, t2_idle = idle(iter(self.t1.items())), idle(iter(self.t2.items()))
        t1_size = len(self.t1)  # as it will be once the chosen t1 chunks are gone
        chosen: list[tuple[OffloadKey, ChunkStatus, bool]] = []  # (key, chunk, from t1)
        for _ in range(n):
            entry = next(t1_idle, None) if t1_size >= int(self.target_t1_size) else None
            from_t1 = entry is not None
            if entry is None:
                entry = next(t2_idle, None)
            if entry is None:
                entry, from_t1 = next(t1_idle, None), True
                if entry is None:
                    return None
            if from_t1:
                t1_size -= 1
            chosen.append((*entry, from_t1))

        for key, _, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.cache_capacity:
                ghosts.popitem(last=False)
        return [(key, chunk) for key, chunk, _ in chosen]

    def clear(self) -> None:
        for chunks in (self.t1, self.t2, self.b1, self.b2):
            chunks.clear()
        self.target_t1_size = 0.0
