"""The engine's extension points: the pieces one engine may have replaced, in one plain-data object.

    >>> from mini_vllm import LLM
    >>> from mini_vllm.engine_parts import EngineParts
    >>> llm = LLM(parts=EngineParts(free_blocks=my_free_blocks))   # this engine only

Every field is one piece of the engine, named as the course's exercise that
writes it (``mini_vllm/course/parts.py``), with the signature of the engine's
own implementation, which is its default. ``LLMEngine`` hands each field to
the object that owns the piece, when it builds that object; the engine's own
path goes through the same place (with the defaults). Nothing is patched:
two engines in one process with different parts do not affect each other,
and a field changed after the engine is built changes nothing (the object is
frozen).

Who owns what (the field -> where it is called):

=========================  ===============================================  ==========================
field                      called by                                        reference
=========================  ===============================================  ==========================
``free_queue``             ``BlockPool.__init__`` (the free queue's class)  ``FreeKVCacheBlockQueue``
``slot_mapping``           ``ModelRunner.prepare_inputs``                   ``model_runner.compute_slot_mapping``
``hash_block_tokens``      ``Request`` (its block hasher)                   ``hashing.hash_block_tokens``
``hash_request_tokens``    ``Request`` (its block hasher)                   ``hashing.hash_request_tokens``
``find_longest_cache_hit`` ``KVCacheManager.find_longest_cache_hit``        ``kv_cache_manager.find_longest_cache_hit``
``free_blocks``            ``BlockPool.free_blocks``                        ``BlockPool.free_blocks``
``free_request_blocks``    ``KVCacheManager.free``                          ``kv_cache_manager.free_request_blocks``
``get_new_blocks``         ``BlockPool.get_new_blocks``                     ``BlockPool.get_new_blocks``
``lru_evict``              ``LRUCachePolicy.evict`` (the CPU tier, with     ``kv_offload.lru.lru_evict``
                           ``kv_offloading_size``, chapter 06c)
``store_kv``               the attention backend, every layer and step      the backend's own (None)
``paged_decode``           the attention backend, decode steps              the backend's own (None)
``schedule_waiting``       ``Scheduler.schedule``                           ``Scheduler.schedule_waiting``
``find_sliding_window_``   ``SlidingWindowManager.find_longest_cache_hit``  ``single_type_kv_cache_``
``cache_hit``              (hybrid models, chapter 08b)                     ``manager.find_sliding_``
                                                                            ``window_cache_hit``
=========================  ===============================================  ==========================

A replacement may change *how* its piece works, never *what* the rest of the
engine relies on: each field's description below says what it must keep
(the course's checks test exactly these). ``KVCacheManager.check_invariants``
asserts the pool's share of them after any step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import hashing
from .block_pool import BlockPool, FreeKVCacheBlockQueue
from .kv_cache_manager import find_longest_cache_hit, find_sliding_window_cache_hit, free_request_blocks
from .kv_offload.lru import lru_evict
from .scheduler import Scheduler


def _reference_slot_mapping() -> Callable[[list[int], int, int, int], list[int]]:
    # Looked up when the parts are made (model_runner imports torch; this module does not).
    from .model_runner import compute_slot_mapping

    return compute_slot_mapping


@dataclass(frozen=True)
class EngineParts:
    """The replaceable pieces of one engine; every default is the engine's own implementation.

    Attributes:
        free_queue: the free-block queue's class, called once with the pool's
            blocks in reuse order (head first). Must keep: head-first reuse
            order; ``popleft``, ``remove`` (a block from anywhere: a cache hit),
            ``append`` (tail) and ``appendleft`` (head) in O(1); an accurate
            ``num_free_blocks``; ``get_all_free_blocks()`` head to tail (widgets,
            checks); every block at most once. Batch operations (``popleft_n``,
            ``append_n``, ``prepend_n``, ``__len__``) are added from the single
            ones when the class lacks them (``block_pool.with_batch_operations``).
        slot_mapping: ``(block_ids, start, end, block_size) -> list[int]``, the
            cache slot of each token position ``start..end-1`` of one sequence
            whose block table is ``block_ids``. Must be exactly
            ``block_ids[p // block_size] * block_size + p % block_size``: the
            attention backend writes and reads the cache at these slots.
        hash_block_tokens: ``(parent_block_hash, token_ids, extra_keys) -> bytes``,
            one full block's hash chained to its parent (None: ``NONE_HASH``).
            Must be SHA-256 of the pickled ``(parent, tuple(token_ids),
            extra_keys)``, byte for byte (hashes meet the engine's in one cache
            and vLLM's in the comparisons); only used with ``hash_algo="sha256"``.
        hash_request_tokens: ``(token_ids, block_size, cache_salt, lora_name) ->
            list[bytes]``, one chained hash per full block; when given, it hashes
            the requests (before ``hash_block_tokens``). Same bytes as the
            reference; a partial block gets no hash.
        find_longest_cache_hit: ``(block_pool, block_hashes, max_num_blocks) ->
            list[KVCacheBlock]``, the cached blocks of the longest prefix of
            ``block_hashes``, at most ``max_num_blocks``. Must stop at the first
            miss, take no reference and change nothing (the scheduler may
            not admit the request), and cost O(hit length), not O(pool).
        free_blocks: ``(block_pool, ordered_blocks) -> None``, drop one reference
            on each block; a block reaching 0 becomes free. Must keep: unhashed
            blocks to the queue's head (first of them first), hashed ones to
            its tail, both in the order given; a ValueError for a block freed
            more often than allocated; hashes and the map untouched (eviction
            is lazy). Where freed blocks go *is* the eviction policy.
        free_request_blocks: ``(block_pool, req_blocks) -> None``, free a
            finished or preempted request's block table (``KVCacheManager.free``
            has already forgotten it). Must free every block once, last block
            first, through ``block_pool.free_blocks``.
        get_new_blocks: ``(block_pool, num_blocks) -> list[KVCacheBlock]``, pop
            ``num_blocks`` from the queue's head, each with ``ref_cnt`` 1 (a
            ValueError, changing nothing, when fewer are free). Lazy eviction:
            a popped block that still has a hash leaves the map (that block
            only), loses its hash, counts in ``num_evictions`` and, when events
            are on, records a ``BlockRemoved`` event; with caching off nothing
            is evicted.
        lru_evict: ``(policy, n, protected) -> list[(key, chunk)] | None``, the
            CPU tier's LRU eviction choice (only with ``kv_offloading_size``).
            Must evict exactly ``n`` chunks among ``policy.evictable`` (ref_cnt
            0: no store or load in flight) not in ``protected``, smallest
            ``(policy.ranks[key], key)`` first, each through ``policy.remove``,
            and return them as ``(key, chunk)`` pairs in that order; with fewer
            than ``n`` candidates, None and the policy unchanged.
        store_kv: ``(key, value, k_cache, v_cache, slot_mapping) -> None``, write
            each new token's K/V row into its slot (slot -1: skip) and nothing
            else. None: the attention backend's own. When given (or
            ``paged_decode``), the engine runs the torch backend with it
            (``attention.torch_backend.PartsAttentionBackend``).
        paged_decode: ``(query, k_cache, v_cache, block_table, seq_len, scale) ->
            Tensor``, one sequence's decode attention over its ``seq_len``
            cached tokens, in the query's dtype, caches unchanged. None: the
            backend's own.
        schedule_waiting: ``(scheduler, token_budget, output) -> int``, admit
            waiting requests and return the budget left. Must keep FIFO order
            and stop at the first request the pool cannot serve (it keeps its
            place), when the budget is spent or at ``max_num_seqs`` running;
            look up the prefix (``get_computed_blocks``) and allocate
            (``allocate_slots``) through the manager; set ``RUNNING`` and, on a
            first admission, ``num_cached_tokens``; put each admission in the
            step through ``scheduler.schedule_request``. An engine with an
            offloading tier (``kv_offloading_size``) refuses a replacement:
            the lookup into the tier is the engine's own method's.
        find_sliding_window_cache_hit: ``(block_pool, block_hashes,
            max_num_blocks, num_contiguous_blocks, kv_cache_group_id) ->
            list[KVCacheBlock]``, a sliding-window group's hit (hybrid models
            only): searching right to left, the first run of
            ``num_contiguous_blocks`` blocks cached for that group, with
            ``block_pool.null_block`` at every position before the run (or, with
            no such run, a shorter run that starts at block 0). Must take no
            reference, change nothing, and look up only that group's blocks.
    """

    free_queue: Callable[[list[Any]], Any] = FreeKVCacheBlockQueue
    slot_mapping: Callable[[list[int], int, int, int], list[int]] = field(default_factory=_reference_slot_mapping)
    hash_block_tokens: Callable[..., bytes] = hashing.hash_block_tokens
    hash_request_tokens: Callable[..., list[bytes]] = hashing.hash_request_tokens
    find_longest_cache_hit: Callable[..., list[Any]] = find_longest_cache_hit
    free_blocks: Callable[..., None] = BlockPool.free_blocks
    free_request_blocks: Callable[..., None] = free_request_blocks
    get_new_blocks: Callable[..., list[Any]] = BlockPool.get_new_blocks
    lru_evict: Callable[..., list[Any] | None] = lru_evict
    store_kv: Callable[..., None] | None = None
    paged_decode: Callable[..., Any] | None = None
    schedule_waiting: Callable[..., int] = Scheduler.schedule_waiting
    find_sliding_window_cache_hit: Callable[..., list[Any]] = find_sliding_window_cache_hit

    def replaced(self) -> list[str]:
        """The fields that are not the engine's own implementation, in field order."""
        reference = EngineParts()
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not getattr(reference, f.name)]

    def unusable_with_offloading(self, eviction_policy: str) -> dict[str, str]:
        """The replaced parts an engine with an offloading tier under ``eviction_policy`` cannot run, each with why.

        ``LLMEngine`` refuses an engine built with any of them; the learner's engine
        (``mini_vllm.course.learner_engine``) leaves such kept parts out with a note.
        """
        why = {"schedule_waiting": "the tier is looked up by the engine's own schedule_waiting, past the pool's hit"}
        if eviction_policy != "lru":
            why["lru_evict"] = f"the {eviction_policy!r} policy never calls it; only the 'lru' policy does"
        replaced = self.replaced()
        return {name: reason for name, reason in why.items() if name in replaced}

    def block_hasher(self, hash_algo: str) -> hashing.BlockHasher:
        """What each ``Request`` of the engine hashes its full blocks with (``hashing.make_block_hasher``)."""
        return hashing.make_block_hasher(hash_algo, self.hash_block_tokens, self.hash_request_tokens)


ENGINE_PART_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineParts))
"""Every extension point's name, in the order a request meets them in the course."""
