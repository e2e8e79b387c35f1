"""The CPU tier's bookkeeping: its chunk pool, reference counts, a request's accesses, and the events.

``CPUOffloadingManager`` runs beside the scheduler and says, for every key,
whether the tier holds it and in which *chunk* (a slot of the tier's host
tensors, ``num_chunks`` of them). It owns:

* the chunk pool: never-used chunks are handed out first, in order, then the
  freed ones, last freed first;
* each chunk's ``ref_cnt`` (-1: store in flight; 0: idle, evictable; > 0:
  being loaded; ``cache_policy.py``), and how many chunks are idle, so that a
  store that cannot evict enough is refused before the policy is asked;
* what each request did with the tier (``_RequestAccess``): the keys it used,
  in order, which it stored and which it reused. The policy hears of a
  request's uses as they happen (``on_request_access``, ``on_store_miss``)
  and counts them when it finishes (``on_request_finished``): a request that
  stores a prefix and reads it back in the same run is one use, not two;
* the events, ``stored`` when a store completes and ``removed`` when a chunk
  is evicted, with the tier's medium.

Which chunks it holds and whom to evict is the policy's (``lru.py``, ``arc.py``,
by name in ``CACHE_POLICIES``).

vLLM equivalent: ``vllm/v1/kv_offload/cpu/manager.py`` (``CPUOffloadingManager``)
with its default ``store_threshold=1``: every block offered is stored. Left
out: ``store_threshold`` >= 2 and its access tracker (store a block only once
it has been offered that many times), out-of-tree policies and the metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from ..validation import check_positive_int, one_of
from .arc import ARCCachePolicy
from .base import (
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    get_offload_group_idx,
)
from .cache_policy import CachePolicy, ChunkStatus
from .lru import LRUCachePolicy, lru_evict

CACHE_POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUCachePolicy, "arc": ARCCachePolicy}


@dataclass
class _RequestAccess:
    """What one request has done with the tier so far (kept in its ``ReqContext.notes``)."""

    generation: int  # the manager's reset count when it was made: a reset forgets it
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)  # group -> keys, in first-use order
    seen_keys: set[OffloadKey] = field(default_factory=set)
    inserted_keys: set[OffloadKey] = field(default_factory=set)  # stored by this request
    reused_keys: set[OffloadKey] = field(default_factory=set)  # found stored, and used
    store_miss_keys: set[OffloadKey] = field(default_factory=set)  # offered and not held
    finished: bool = False


class CPUOffloadingManager(OffloadingManager):
    """The CPU tier's scheduler side: ``num_chunks`` chunks, evicted by ``cache_policy`` (``"lru"`` or ``"arc"``).

    ``lru_evict``: the LRU policy's eviction choice (``lru.lru_evict``; an
    engine's ``EngineParts.lru_evict``); ARC makes its own.
    """

    medium = Medium.CPU

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        enable_events: bool = False,
        lru_evict: Callable[..., list | None] = lru_evict,
    ) -> None:
        check_positive_int("num_chunks", num_chunks)
        if cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache_policy must be {one_of(CACHE_POLICIES)}, got {cache_policy!r}")
        self.num_chunks = num_chunks
        policy_class = CACHE_POLICIES[cache_policy]
        if policy_class is LRUCachePolicy:
            self.policy: CachePolicy = LRUCachePolicy(cache_capacity=num_chunks, evict=lru_evict)
        else:
            self.policy = policy_class(cache_capacity=num_chunks)
        self.num_allocated_chunks = 0  # chunks 0 .. this - 1 have been handed out at least once
        self.free_chunk_ids: list[int] = []  # handed out and given back; reused last-in first-out
        self.num_evictable_chunks = 0  # chunks with ref_cnt 0
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self.generation = 0  # reset_cache() count

    # -- the chunk pool --------------------------------------------------------------

    def num_free_chunks(self) -> int:
        return len(self.free_chunk_ids) + self.num_chunks - self.num_allocated_chunks

    def _allocate_chunks(self, n: int) -> list[ChunkStatus]:
        num_fresh = min(n, self.num_chunks - self.num_allocated_chunks)
        chunks = [ChunkStatus(self.num_allocated_chunks + i) for i in range(num_fresh)]
        self.num_allocated_chunks += num_fresh
        chunks += [ChunkStatus(self.free_chunk_ids.pop()) for _ in range(n - num_fresh)]
        return chunks

    # -- what each request did ----------------------------------------------------------

    def _access(self, req_context: ReqContext) -> _RequestAccess:
        access = req_context.notes.get(self)
        if access is None or access.generation != self.generation:
            access = req_context.notes[self] = _RequestAccess(self.generation)
        return access

    def _record_access(
        self, keys: Iterable[OffloadKey], req_context: ReqContext, reused_keys: Iterable[OffloadKey] = ()
    ) -> None:
        """Note the keys ``req_context``'s request uses (the policy hears of the new ones) and those it reused."""
        access = self._access(req_context)
        new_keys = [key for key in dict.fromkeys(keys) if key not in access.seen_keys]
        if new_keys and access.finished:
            raise RuntimeError(f"request {req_context.req_id!r} used the tier after it finished")
        for key in new_keys:
            access.key_groups.setdefault(get_offload_group_idx(key), []).append(key)
            access.seen_keys.add(key)
        if new_keys:
            self.policy.on_request_access(new_keys, req_context)
        # Reading back a chunk this request stored itself is not a reuse.
        access.reused_keys.update(key for key in reused_keys if key not in access.inserted_keys)

    # -- the scheduler's calls ------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> None:
        self._access(req_context)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        chunk = self.policy.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        chunks = []
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None or not chunk.is_ready:
                raise ValueError(f"prepare_load: key {key.hex()} is not stored in the tier (lookup it first)")
            if chunk.ref_cnt == 0:  # idle -> being loaded: no longer a candidate for eviction
                self.policy.mark_non_evictable(key)
                self.num_evictable_chunks -= 1
            chunk.ref_cnt += 1
            chunks.append(chunk)
        self._record_access(keys, req_context, reused_keys=keys)
        return CPULoadStoreSpec([chunk.chunk_id for chunk in chunks])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.policy.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None or chunk.ref_cnt <= 0:
                raise ValueError(f"complete_load: key {key.hex()} is not being loaded")
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self.num_evictable_chunks += 1
                self.policy.mark_evictable(key)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, protected: Collection[OffloadKey] = ()
    ) -> PrepareStoreOutput | None:
        """Make room for the keys not yet held; neither they nor ``protected`` are evicted for it (None: no room)."""
        keys = list(keys)
        # Stored already: a reuse (when readable); being stored: nothing to do; neither: to store.
        keys_to_store = [key for key in keys if self.policy.get(key) is None]
        stored_keys = [key for key in keys if (chunk := self.policy.get(key)) is not None and chunk.is_ready]

        access = self._access(req_context)
        new_misses = [key for key in keys_to_store if key not in access.store_miss_keys]
        if new_misses:  # before insert(): ARC learns from the ghosts that insert() removes
            self.policy.on_store_miss(new_misses, req_context)
            access.store_miss_keys.update(new_misses)
        offered = set(keys_to_store) | set(stored_keys)
        self._record_access([key for key in keys if key in offered], req_context, reused_keys=stored_keys)

        if not keys_to_store:
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[])

        num_to_evict = len(keys_to_store) - self.num_free_chunks()
        evicted_keys: list[OffloadKey] = []
        if num_to_evict > 0:
            if num_to_evict > self.num_evictable_chunks:
                return None
            # Never evict a key offered in this very call: it must still be there afterwards.
            evicted = self.policy.evict(num_to_evict, protected={*keys, *protected})
            if evicted is None:
                return None
            self.num_evictable_chunks -= len(evicted)
            for key, chunk in evicted:
                self.free_chunk_ids.append(chunk.chunk_id)
                evicted_keys.append(key)
            if self.events is not None:
                self.events.append(OffloadingEvent(keys=evicted_keys, medium=self.medium, removed=True))

        chunks = self._allocate_chunks(len(keys_to_store))
        for key, chunk in zip(keys_to_store, chunks):
            self.policy.insert(key, chunk, req_context)
        access.inserted_keys.update(keys_to_store)
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,
            store_spec=CPULoadStoreSpec([chunk.chunk_id for chunk in chunks]),
            evicted_keys=evicted_keys,
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        in_flight = [key for key in keys if (chunk := self.policy.get(key)) is not None and not chunk.is_ready]
        for key in in_flight:
            chunk = self.policy.get(key)
            if success:  # readable from now on, and idle
                chunk.ref_cnt = 0
                self.num_evictable_chunks += 1
                self.policy.mark_evictable(key)
            else:  # forget it: its chunk goes back to the pool
                self.policy.remove(key)
                self.free_chunk_ids.append(chunk.chunk_id)
        if in_flight and self.events is not None:
            self.events.append(
                OffloadingEvent(keys=in_flight, medium=self.medium, removed=not success, metadata_only=not success)
            )

    def on_request_finished(self, req_context: ReqContext) -> None:
        access = req_context.notes.get(self)
        if access is None or access.generation != self.generation or access.finished:
            return
        access.finished = True
        key_groups = []
        for group_idx in sorted(access.key_groups):
            keys = access.key_groups[group_idx]
            if all(req_context.get_offload_key_position(key) is not None for key in keys):
                keys = sorted(keys, key=req_context.get_offload_key_position)
            key_groups.append(keys)
        self.policy.on_request_finished(
            key_groups, access.inserted_keys - access.reused_keys, access.reused_keys, req_context
        )

    def set_events_enabled(self, enabled: bool) -> None:
        """Record events from now on, or stop and drop those nobody took (the engine's listeners come and go)."""
        if not enabled:
            self.events = None
        elif self.events is None:
            self.events = []

    def take_events(self) -> list[OffloadingEvent]:
        if self.events is None:
            return []
        events, self.events = self.events, []
        taken = []
        for event in events:
            if event.metadata_only:
                # A failed store's keys, unless a later store of the same keys already holds them again.
                keys = [key for key in event.keys if self.policy.get(key) is None]
                if not keys:
                    continue
                event = OffloadingEvent(keys=keys, medium=event.medium, removed=True, metadata_only=True)
            taken.append(event)
        return taken

    def reset_cache(self) -> None:
        self.policy.clear()
        self.generation += 1
        self.num_evictable_chunks = 0
        self.num_allocated_chunks = 0
        self.free_chunk_ids.clear()

    # -- for the tests and the widgets -------------------------------------------------------

    def resident(self) -> dict[OffloadKey, tuple[int, int]]:
        """Every key the tier holds (stored or being stored): its chunk id and ref_cnt."""
        return {key: (chunk.chunk_id, chunk.ref_cnt) for key in self.policy.keys() if (chunk := self.policy.get(key))}
