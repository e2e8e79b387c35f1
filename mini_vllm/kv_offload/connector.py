"""The tier in the engine: the lookup past the pool's hit, the loads before the forward pass, the stores after it.

``OffloadingConnector`` joins the CPU tier (``CPUOffloadingManager``, which
only keeps books; or a ``TieringOffloadingManager``, the CPU tier with a
file-system tier below it, ``tiering.py``) to the engine, in the three
places vLLM's ``OffloadingConnector`` does:

1. **Lookup, at admission** (``Scheduler.schedule_waiting``). After the pool's
   own hit of ``n`` blocks, ``get_num_new_matched_tokens`` goes on along the
   same hash chain, block ``n``, ``n + 1``, ... in the tier, while it says
   HIT. Those tokens are *external* hits: the scheduler allocates pool blocks
   for them and schedules only the tokens after them, and
   ``update_state_after_alloc`` pins their chunks (``prepare_load``) and
   notes which pool block each one fills.
2. **Load, before the forward pass** (``ModelRunner.execute_model``):
   ``load_kv`` copies each pinned chunk from the tier's host tensors into its
   pool block, then unpins it. A chunk that cannot be read (``copy_to_pool``
   returns False) is recomputed: the request's step is moved back to start at
   that block, so this very forward pass computes its tokens again (a step
   may then compute more tokens than its budget; vLLM recomputes them in a
   later step instead, with ``kv_load_failure_policy="recompute"``: its
   default, ``"fail"``, ends the request with an error).
3. **Store, after the forward pass**: ``save_kv`` offers the tier every
   prompt block the step has just filled (vLLM's default
   ``offload_prompt_only``), and copies the ones the tier wants
   (``prepare_store``) into their chunks. A request that loaded from the
   tier offers only the blocks after its hits; one that did not offers its
   pool hit too, so a prefix the pool kept and the tier lost goes back to
   the tier (vLLM's ``next_stored_chunk_idx``).

The step ends in vLLM's order (its ``build_connector_meta``, then the
workers' reports): every request's ``prepare_store``, then the requests
finished since the last step (their prompt blocks the tier refused so far
offered once more, from a copy taken at finish, then
``on_request_finished``), then the step's loads and stores complete. So a
chunk loaded or stored in a step is not evicted by a later store of the
same step, and a finished request's accesses count after the next step's
stores, or at once when nothing else runs (vLLM's engine then takes one
more, empty, step).

On a CPU both tiers live in host memory; what a tier hit saves is the
forward pass over its tokens, at the price of a copy. The copies are
synchronous here, so a chunk is never being stored or loaded while the
scheduler looks.

Its stores and evictions reach the engine's listeners as vLLM's KV events
with ``medium="CPU"`` (``take_events``), after the pool's (``medium="GPU"``).

Hits from the tier are counted apart from the pool's, as vLLM's
``connector_prefix_cache_stats`` (``vllm:external_prefix_cache_queries`` and
``_hits``): per admitted request, the tokens past the pool's hit are
queried and the tier's tokens are hits.

vLLM equivalent: ``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``
and its ``offloading/scheduler.py`` and ``offloading/worker.py``, with the
``CPUOffloadingSpec`` of ``vllm/v1/kv_offload/cpu/``. One KV-cache group only
(a hybrid model's tier is not built here) and one block per chunk.

Unlike the pool's lookup, which stops before the block of the prompt's last
token (``get_computed_blocks``), the tier's goes on to the last full block,
as vLLM's does: a prompt the tier holds whole is loaded whole, counted as
cached whole, and its last token is computed again (the scheduler starts
the step there), since its logits give the first output token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..events import BlockRemoved, BlockStored
from ..kv_cache_manager import PrefixCacheStats
from .base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from .cpu_manager import CPUOffloadingManager
from .tiering import TieringOffloadingManager

if TYPE_CHECKING:
    from ..request import Request
    from ..scheduler import SchedulerOutput


@dataclass
class _RequestState:
    context: ReqContext
    next_block_to_store: int = 0  # blocks before it were cached already, or offered to the tier
    # Pinned by update_state_after_alloc, copied by load_kv: (block index in the request, pool block, chunk).
    loads: list[tuple[int, int, int]] = field(default_factory=list)
    load_keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # its block table, as of its last step


@dataclass
class _FinishedRequest:
    """A finished request, until the next step's end: its prompt blocks the tier refused so far are offered once
    more, from a copy taken at finish (its pool blocks are freed), then the tier learns its accesses."""

    context: ReqContext
    keys: list[OffloadKey]
    blocks: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]  # per key: (its pool block, its K/V per layer)


class OffloadingConnector:
    """The CPU tier of ``manager.num_chunks`` chunks of ``block_size`` tokens, wired into one engine."""

    def __init__(self, manager: CPUOffloadingManager | TieringOffloadingManager, block_size: int) -> None:
        self.manager = manager
        self.block_size = block_size
        self.requests: dict[str, _RequestState] = {}
        # Finished requests, offered and forgotten by the tier after the next step's stores (vLLM's order).
        self.finished: list[_FinishedRequest] = []
        self.prefix_cache_stats = PrefixCacheStats()  # the external hits (vLLM: connector_prefix_cache_stats)
        # The tier's copies: per layer of the pool, a (K, V) pair shaped like the pool's with one chunk per block.
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pool_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The pool's K/V tensors (the model runner's), and host tensors as large for the tier's chunks."""
        unique = list({id(pair[0]): pair for pair in kv_caches}.values())  # layers may share a tensor
        self.pool_caches = unique
        shape = (self.manager.num_chunks, *unique[0][0].shape[1:])
        self.host_caches = [
            (torch.zeros(shape, dtype=k.dtype, device="cpu"), torch.zeros(shape, dtype=v.dtype, device="cpu"))
            for k, v in unique
        ]
        if isinstance(self.manager, TieringOffloadingManager):  # the disk tier reads and writes these chunks
            self.manager.secondary_tier.register_host_caches(self.host_caches)

    def _keys(self, request: Request, start: int, end: int) -> list[OffloadKey]:
        return [make_offload_key(block_hash, 0) for block_hash in request.block_hashes[start:end]]

    def _state(self, request: Request) -> _RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            state = self.requests[request.request_id] = _RequestState(ReqContext(request.request_id))
            self.manager.on_new_request(state.context)
        return state

    # -- the scheduler's side ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """How many tokens after the pool's ``num_computed_tokens`` the tier holds, in whole blocks."""
        state = self._state(request)
        first = num_computed_tokens // self.block_size
        last = request.num_tokens // self.block_size  # every full block, the last token's too (vLLM's lookup)
        keys = self._keys(request, first, last)
        for index, key in enumerate(keys, start=first):  # the scheduler records each key's end position
            state.context.set_offload_key_position(key, (index + 1) * self.block_size)
        num_hits = 0
        for key in keys:
            if self.manager.lookup(key, state.context) is not LookupResult.HIT:
                break
            num_hits += 1
        # Restarting from this lookup (a new request, or a preempted one): every block is offered again, the
        # pool's hit too (a prefix the tier lost comes back to it), unless the tier's hit is loaded (below).
        state.next_block_to_store = 0
        return num_hits * self.block_size

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        """The request was admitted with ``num_external_tokens`` from the tier after its pool hit: pin their chunks."""
        state = self._state(request)
        queried = request.num_tokens - num_computed_tokens
        if queried:
            self.prefix_cache_stats.record(queried, num_external_tokens, preempted=request.num_preemptions > 0)
        if not num_external_tokens:
            return
        first = num_computed_tokens // self.block_size
        indices = range(first, first + num_external_tokens // self.block_size)
        keys = self._keys(request, indices.start, indices.stop)
        spec = self.manager.prepare_load(keys, state.context)
        state.loads = [(index, block_ids[index], chunk) for index, chunk in zip(indices, spec.chunk_ids)]
        state.load_keys = keys
        state.next_block_to_store = indices.stop  # the pool's hit and the tier's are offered no more

    def request_finished(self, request: Request) -> None:
        state = self.requests.pop(request.request_id, None)
        if state is None:
            return
        if state.load_keys:  # finished before its step ran: its chunks must not stay pinned
            self.manager.complete_load(state.load_keys, state.context)
        # Its prompt blocks the tier refused so far (vLLM's store jobs of a finished request): copied now.
        num_full = request.num_prompt_tokens // self.block_size
        keys = self._keys(request, state.next_block_to_store, num_full)
        for index, key in enumerate(keys, start=state.next_block_to_store):
            state.context.set_offload_key_position(key, (index + 1) * self.block_size)
        blocks = [
            (block_id, [(pool_k[block_id].clone(), pool_v[block_id].clone()) for pool_k, pool_v in self.pool_caches])
            for block_id in state.block_ids[state.next_block_to_store : num_full]
        ]
        self.finished.append(_FinishedRequest(state.context, keys[: len(blocks)], blocks))
        if not self.requests:  # nothing else runs: vLLM's engine takes one more, empty, step for it now
            self.end_idle_step()

    def end_idle_step(self) -> None:
        """What an empty step does: offer the finished requests' blocks, forget them, end the stores."""
        stored: list[tuple[list[OffloadKey], ReqContext]] = []
        self._forget_finished(stored)
        for keys, context in stored:
            self.manager.complete_store(keys, context)

    def _forget_finished(self, stored: list[tuple[list[OffloadKey], ReqContext]]) -> None:
        """The requests finished since the last step: their refused prompt blocks offered once more, after the
        step's own stores (``stored`` gets what the tier took), then ``on_request_finished``."""
        for finished in self.finished:
            output = self.manager.prepare_store(finished.keys, finished.context) if finished.keys else None
            if output is not None:
                block_of = dict(zip(finished.keys, finished.blocks))
                for key, chunk_id in zip(output.keys_to_store, output.store_spec.chunk_ids):
                    block_id, kv = block_of[key]
                    self.copy_to_tier(block_id, chunk_id, kv)
                stored.append((output.keys_to_store, finished.context))
        for finished in self.finished:
            self.manager.on_request_finished(finished.context)
        self.finished.clear()

    # -- the events, with their medium ---------------------------------------------------------
    def set_kv_cache_events(self, enabled: bool) -> None:
        """Record the tier's events while someone listens (the scheduler's ``set_kv_cache_events``)."""
        self.manager.set_events_enabled(enabled)

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """The tier's events since the last call, as vLLM's KV events with ``medium="CPU"``.

        vLLM's default payload (its ``OffloadingEventsTracker`` without
        ``self_describing_kv_events``): each stored key is one ``BlockStored``
        naming its hash, with no tokens and no parent; each eviction is one
        ``BlockRemoved`` with every hash it evicted. A failed store's keys
        (``metadata_only``) were never announced, so nothing is published.
        """
        kv_events: list[BlockStored | BlockRemoved] = []
        for event in self.manager.take_events():
            medium = event.medium.value
            if not event.removed:
                kv_events.extend(
                    BlockStored(
                        (get_offload_block_hash(key),), None, (), 0, group_idx=get_offload_group_idx(key), medium=medium
                    )
                    for key in event.keys
                )
            elif not event.metadata_only:
                by_group: dict[int, list[bytes]] = {}
                for key in event.keys:
                    by_group.setdefault(get_offload_group_idx(key), []).append(get_offload_block_hash(key))
                kv_events.extend(
                    BlockRemoved(tuple(hashes), group_idx=group_idx, medium=medium)
                    for group_idx, hashes in by_group.items()
                )
        return kv_events

    # -- the worker's side: the copies ------------------------------------------------------
    def copy_to_pool(self, chunk_id: int, block_id: int) -> bool:
        """Copy one chunk of the tier into a pool block; False if it cannot be read."""
        for (host_k, host_v), (pool_k, pool_v) in zip(self.host_caches, self.pool_caches):
            pool_k[block_id].copy_(host_k[chunk_id])
            pool_v[block_id].copy_(host_v[chunk_id])
        return True

    def copy_to_tier(
        self, block_id: int, chunk_id: int, kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> None:
        """Copy pool block ``block_id`` into a chunk of the tier (from ``kv``, its copy, once the block is freed)."""
        sources = self.pool_caches if kv is None else [(k[None], v[None]) for k, v in kv]
        index = block_id if kv is None else 0
        for (host_k, host_v), (source_k, source_v) in zip(self.host_caches, sources):
            host_k[chunk_id].copy_(source_k[index])
            host_v[chunk_id].copy_(source_v[index])

    def load_kv(self, scheduler_output: SchedulerOutput) -> None:
        """Before the forward pass: fill the pool blocks of this step's tier hits; recompute what fails to load."""
        for scheduled in scheduler_output.scheduled:
            state = self.requests.get(scheduled.request.request_id)
            if state is None or not state.loads:
                continue
            failed = [index for index, block_id, chunk_id in state.loads if not self.copy_to_pool(chunk_id, block_id)]
            state.loads = []  # copied; their chunks stay pinned until save_kv, as a load job ends after the step
            if failed:  # compute from the first block that did not load, in this step
                start = min(failed) * self.block_size
                scheduled.num_new_tokens += scheduled.num_computed_tokens - start
                scheduled.num_computed_tokens = start
                if scheduled.first_admission:  # its cached tokens were counted with these
                    scheduled.request.num_cached_tokens = min(scheduled.request.num_cached_tokens, start)

    def save_kv(self, scheduler_output: SchedulerOutput) -> None:
        """After the forward pass: offer the tier the prompt blocks this step filled, copy what it takes; end the step.

        In vLLM's order: every request's ``prepare_store`` first (a chunk
        stored or loaded in this step cannot be evicted by the next request's
        store: its job has not ended), then the accesses of the requests
        finished since the last step (``on_request_finished``), then the
        step's transfers end, its loads and then its stores, as vLLM's
        workers report them when the step is over.
        """
        stored: list[tuple[list[OffloadKey], ReqContext]] = []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            state = self.requests.get(request.request_id)
            if state is None:
                continue
            state.block_ids = list(scheduled.block_ids[0])  # the one KV-cache group's table
            end = min(scheduled.num_computed_tokens + scheduled.num_new_tokens, request.num_prompt_tokens)
            num_full = end // self.block_size
            if num_full <= state.next_block_to_store:
                continue
            first = state.next_block_to_store
            keys = self._keys(request, first, num_full)
            for index, key in enumerate(keys, start=first):
                state.context.set_offload_key_position(key, (index + 1) * self.block_size)
            output = self.manager.prepare_store(keys, state.context)
            if output is None:  # the tier could not make room: offered again after the next step
                continue
            block_of = dict(zip(keys, state.block_ids[first:num_full]))
            for key, chunk_id in zip(output.keys_to_store, output.store_spec.chunk_ids):
                self.copy_to_tier(block_of[key], chunk_id)
            stored.append((output.keys_to_store, state.context))
            state.next_block_to_store = num_full
        self._forget_finished(stored)
        for scheduled in scheduler_output.scheduled:
            state = self.requests.get(scheduled.request.request_id)
            if state is not None and state.load_keys:
                self.manager.complete_load(state.load_keys, state.context)
                state.load_keys = []
        for keys, context in stored:
            self.manager.complete_store(keys, context)
