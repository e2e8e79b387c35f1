"""The scheduler: continuous batching, chunked prefill, preemption (chapter 08).

Each engine step the scheduler decides which requests run and how many of
their tokens are computed, under two limits: a token budget
(``max_num_batched_tokens``) and a cap on running requests (``max_num_seqs``).

1. **Running requests first.** A decoding request needs 1 token; a request
   whose prompt is being prefilled in chunks needs the rest of its prompt
   (cut to the remaining budget). If the KV cache cannot give it a block, the
   most recently admitted running request is *preempted*: its blocks are
   freed and it goes back to the front of the waiting queue, to be recomputed
   later (its own blocks stay cached until evicted, so it usually hits them).
2. **Then waiting requests, in order.** For each: look up its cached prefix
   (``get_computed_blocks``), then ask for slots for the rest
   (``allocate_slots``). A prompt longer than the remaining budget is
   chunked: its first part is computed now, the rest in later steps.

There is no separate "prefill phase": prefills, prefill chunks and decodes all
go into one batch. That is continuous batching.

vLLM equivalent: ``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule``,
``update_from_output``).
"""

from __future__ import annotations

import copy
import itertools
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .events import (
    BlockRemoved,
    BlocksAllocated,
    BlocksFreed,
    ComputedBlocksFound,
    EventBus,
    RequestPreempted,
)
from .block_pool import KVCacheBlock
from .kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from .request import Request, RequestStatus

if TYPE_CHECKING:
    from .kv_offload.connector import OffloadingConnector


def schedule_whole_prompt(kv_cache_manager: KVCacheManager, request: Request) -> int | None:
    """Admit one request whose whole prompt is computed in one step, as ``Scheduler`` does without its queues.

    Looks up the cached prefix (``get_computed_blocks``), allocates slots for
    the rest of the prompt (``allocate_slots``) and marks the prompt computed.
    Returns how many prompt tokens came from the cache, or None — changing
    nothing — when the pool cannot hold the prompt. For the chapters, the
    router, the benchmarks and the tests, which admit prompts one at a time;
    the engine goes through ``Scheduler.schedule``.
    """
    new_computed_blocks, num_new_local_computed_tokens = kv_cache_manager.get_computed_blocks(request)
    new_blocks = kv_cache_manager.allocate_slots(
        request, request.num_tokens - num_new_local_computed_tokens, num_new_local_computed_tokens, new_computed_blocks
    )
    if new_blocks is None:
        return None
    request.num_computed_tokens = request.num_tokens
    return num_new_local_computed_tokens


@dataclass
class SchedulerStats:
    """What the scheduler and its KV-cache manager count (vLLM: ``SchedulerStats``, ``Scheduler.make_stats``).

    ``prefix_cache_stats`` is a copy of ``KVCacheManager.prefix_cache_stats``
    (cumulative here; vLLM hands them out per step). The one owner of these
    counters: ``EngineStats`` holds one and reads its flat names from it.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int
    num_evictions: int
    prefix_cache_stats: PrefixCacheStats
    # The KV-cache offloading tier's hits (vLLM's name; None without a tier): ``OffloadingConnector``.
    connector_prefix_cache_stats: PrefixCacheStats | None = None


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens ``[num_computed_tokens, + num_new_tokens)``."""

    request: Request
    num_computed_tokens: int  # tokens with K/V in the cache before this step
    num_new_tokens: int
    # The request's block table after allocation, one per KV-cache group in group order (vLLM's
    # NewRequestData.block_ids): ``block_ids[0]`` is *the* table of a single-group model; a hybrid
    # model (chapter 08b) has one per group, the null block as -1.
    block_ids: tuple[list[int], ...]
    first_admission: bool = False  # admitted for the first time in this step (set by Scheduler.schedule)

    @property
    def samples_token(self) -> bool:
        """True when this step computes the request's last token, so its logits give a new token.

        That is every decode step, and the prefill step that computes the prompt's
        last chunk; a step that computes an earlier chunk samples nothing.
        """
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """One step's plan. ``newly_cached_blocks``: blocks entered into the prefix
    cache while scheduling it, whose K/V this step's forward pass must write
    (if it fails, they are uncached: see ``Scheduler.undo_failed_step``)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    newly_cached_blocks: list[KVCacheBlock] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class EngineStalled(RuntimeError):
    """Requests wait and none can ever run (blocks leaked, or an admission that admits nothing).

    Raised by ``Scheduler.schedule`` instead of letting ``LLM.generate`` step
    forever; the message (``Scheduler._stalled``) says which of the two it is.
    """


class Scheduler:
    """Owns the waiting and running queues; the ``KVCacheManager`` owns the blocks.

    The engine talks only to the scheduler, the scheduler to the manager, the
    manager to its ``BlockPool``: everything the engine needs of the cache
    (statistics, KV events, a reset, undoing a failed step) is a method here.

    Invariants: a request is in exactly one of ``waiting`` / ``running`` until
    it finishes; a running request holds blocks for all its computed tokens;
    a waiting request holds none.

    ``schedule_waiting``, admission, is an extension point
    (``mini_vllm/engine_parts.py``): a function ``(scheduler, token_budget,
    output) -> int`` given here becomes this scheduler's bound method; the
    class's own method is the reference (a subclass may override it too).
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        events: EventBus | None = None,
        *,
        schedule_waiting: Callable[[Scheduler, int, SchedulerOutput], int] | None = None,
        connector: OffloadingConnector | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.events = events if events is not None else EventBus()
        self.num_preemptions = 0
        self.connector = connector  # a KV-cache offloading tier below the pool, or None
        if schedule_waiting is not None and schedule_waiting is not type(self).schedule_waiting:
            self.schedule_waiting = types.MethodType(schedule_waiting, self)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        self.kv_cache_manager.take_newly_cached_blocks()  # start this step's record afresh
        try:
            token_budget = self._schedule_running(self.max_num_batched_tokens, output)
            # Admit new requests only if no running request had to be preempted: memory is short.
            if not output.preempted:
                self._schedule_admissions(token_budget, output)
        except BaseException:
            # Scheduling itself failed (a bug): no forward pass will write the blocks cached so far.
            self.kv_cache_manager.uncache_blocks(self.kv_cache_manager.take_newly_cached_blocks())
            raise
        output.newly_cached_blocks = self.kv_cache_manager.take_newly_cached_blocks()
        if not output.scheduled and not output.preempted and not self.running and self.waiting:
            raise EngineStalled(self._stalled())
        return output

    def _stalled(self) -> str:  # the message of EngineStalled
        """Why nothing can ever run: requests wait, none runs, and the first one was refused blocks.

        Every queued request fits in the whole pool (the engine checks that before
        queueing it), so with nothing running this means blocks that no request holds
        never came back: a leak. Without this error, ``LLM.generate`` would step forever.
        """
        manager = self.kv_cache_manager
        in_use = manager.num_blocks - manager.get_num_free_blocks()
        stalled = (
            f"the engine cannot make progress: {len(self.waiting)} request(s) wait, none runs, and "
            f"{self.waiting[0].request_id!r} was not admitted. "
        )
        if in_use:
            return stalled + (
                f"{in_use} of the pool's {manager.num_blocks} blocks are in use although no request holds "
                "any: they leaked (a ref_cnt that never came back to 0, or a freed block that never "
                "reached the free queue)"
            )
        return stalled + "Every block is free, so schedule_waiting admitted nothing it could have"

    def _schedule_admissions(self, token_budget: int, output: SchedulerOutput) -> int:
        """``schedule_waiting`` plus what the scheduler records around it, whoever wrote it.

        Which admissions are first admissions (a request never admitted before has
        ``num_cached_tokens < 0``; admission is FIFO and stops at ``max_num_seqs``
        running, so only that many waiting requests can be admitted), and the
        pool's KV events of the admissions, in the step they happened in.
        """
        candidates = itertools.islice(self.waiting, self.max_num_seqs)
        never_admitted = {id(request) for request in candidates if request.num_cached_tokens < 0}
        num_scheduled = len(output.scheduled)
        budget = token_budget
        token_budget = self.schedule_waiting(token_budget, output)
        admitted = output.scheduled[num_scheduled:]
        self.check_admissions(budget, admitted)
        for scheduled in admitted:
            scheduled.first_admission = id(scheduled.request) in never_admitted
        if self.events.active:
            self.emit_kv_cache_events()
        return token_budget

    def check_admissions(self, token_budget: int, admitted: list[ScheduledRequest]) -> None:
        """What any admission must respect, as vLLM's scheduler asserts it: the step's token budget, and no
        token past a request's last. A ``schedule_waiting`` that breaks it is told here, by name, instead of
        by a shape error in the model steps later."""
        spent = sum(scheduled.num_new_tokens for scheduled in admitted)
        if spent > token_budget:
            raise AssertionError(f"schedule_waiting scheduled {spent} new tokens with a token budget of {token_budget}")
        for scheduled in admitted:
            if scheduled.num_computed_tokens + scheduled.num_new_tokens > scheduled.request.num_tokens:
                raise AssertionError(
                    f"schedule_waiting scheduled request {scheduled.request.request_id!r} past its last token: "
                    f"{scheduled.num_computed_tokens} computed + {scheduled.num_new_tokens} new > "
                    f"{scheduled.request.num_tokens} tokens"
                )

    def _schedule_running(self, token_budget: int, output: SchedulerOutput) -> int:
        """Give every running request its next tokens (a decode token or a prefill chunk).

        Returns the token budget left.
        """
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if not self._allocate_or_preempt(request, num_new_tokens, output):
                break  # the request preempted itself: nothing left to preempt for it
            self.schedule_request(request, request.num_computed_tokens, num_new_tokens, output)
            token_budget -= num_new_tokens
            index += 1
        return token_budget

    def schedule_waiting(self, token_budget: int, output: SchedulerOutput) -> int:
        """Admit waiting requests in FIFO order: prefix lookup, then slots for the rest.

        Chapter 08's exercise and an extension point: a subclass may override
        it (the course's check does), or ``Scheduler(schedule_waiting=...)``
        give one scheduler another (``EngineParts.schedule_waiting``).

        With a KV-cache offloading tier (``connector``), the lookup goes on past
        the pool's hit into the tier, along the same hash chain: the tier's
        tokens get new blocks, loaded before the forward pass, not computed.

        Stops at the first request the pool cannot serve (it keeps its place),
        when the budget is spent, or at ``max_num_seqs`` running requests.
        Returns the token budget left.
        """
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            # The cached prefix: its blocks and the tokens they hold (vLLM's names).
            new_computed_blocks, num_new_local_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)
            # Past the pool's hit, the offloading tier's along the same hash chain: loaded, not computed.
            num_external_computed_tokens = 0
            if self.connector is not None:
                num_external_computed_tokens = self.connector.get_num_new_matched_tokens(
                    request, num_new_local_computed_tokens
                )
            num_computed_tokens = num_new_local_computed_tokens + num_external_computed_tokens
            # A prompt loaded whole from the tier computes its last token again: its logits give the first output.
            first_new_token = min(num_computed_tokens, request.num_tokens - 1)
            # Chunked prefill: a prompt longer than the budget gets only its first part now.
            num_new_tokens = min(request.num_tokens - first_new_token, token_budget)
            new_blocks = self.kv_cache_manager.allocate_slots(  # the tier's hits get new blocks, to load into
                request,
                first_new_token - num_new_local_computed_tokens + num_new_tokens,
                num_new_local_computed_tokens,
                new_computed_blocks,
            )
            if new_blocks is None:
                break  # not enough free blocks: keep FIFO order, try again next step
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    request,
                    self.kv_cache_manager.get_block_ids(request.request_id),
                    num_new_local_computed_tokens,
                    num_external_computed_tokens,
                )
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:  # its first admission; a re-admission keeps the first value
                request.num_cached_tokens = num_computed_tokens
            if self.events.active:
                block_ids = self.kv_cache_manager.block_ids_of(new_computed_blocks)
                self.events.emit(ComputedBlocksFound(request.request_id, block_ids, num_new_local_computed_tokens))
                self._emit_allocation(request, new_blocks)
            self.schedule_request(request, first_new_token, num_new_tokens, output)
            token_budget -= num_new_tokens
        return token_budget

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, output: SchedulerOutput) -> bool:
        """Allocate slots for a running request, preempting from the back until it fits.

        Returns False if ``request`` itself had to be preempted.
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                if self.events.active:
                    self._emit_allocation(request, new_blocks)
                return True
            victim = self.running.pop()  # the most recently admitted request
            self.preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False

    def schedule_request(
        self,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        output: SchedulerOutput,
    ) -> None:
        """Put ``request`` in this step's batch: compute ``num_new_tokens`` tokens after its first ``num_computed_tokens``.

        Records a ``ScheduledRequest`` (with the request's block table) in
        ``output`` and advances ``request.num_computed_tokens``: the model
        computes those tokens in this step. Chapter 08's ``schedule_waiting``
        exercise calls it for every request it admits.
        """
        block_ids = self.kv_cache_manager.get_block_ids_by_group(request.request_id)
        output.scheduled.append(ScheduledRequest(request, num_computed_tokens, num_new_tokens, block_ids))
        # The tokens count as computed from now on: the model computes them in this step.
        request.num_computed_tokens = num_computed_tokens + num_new_tokens

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the waiting queue."""
        self._requeue(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.events.active:
            self.events.emit(RequestPreempted(request.request_id))

    def _requeue(self, request: Request) -> None:
        """Free all of ``request``'s blocks and put it at the front of the waiting queue, to be recomputed
        from scratch (its generated tokens are kept): what a preemption and a failed step's undo share."""
        self._free_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    # -- when a step fails -----------------------------------------------------------
    def undo_failed_step(self, output: SchedulerOutput, requeue: bool) -> None:
        """Undo a step whose forward pass raised, so that the cache holds only computed K/V.

        1. Every block cached while scheduling the step leaves the prefix cache
           first: its K/V were never (or only partly) written. A request
           admitted in the same step may already hold one as a cache hit —
           its K/V would be garbage too, which is why *every* request of the
           step is handled in step 2, not only the ones that cached blocks.
        2. Each request of the step gives back all its blocks. With
           ``requeue`` it goes back to the front of the waiting queue, to be
           recomputed from scratch like a preempted request (its generated
           tokens are kept; this is not counted as a preemption).
           Without, the caller finishes it (``finish_request``).

        ``num_computed_tokens`` of a requeued request is 0: it claims no
        token whose K/V were not written. vLLM has no such path: there an
        exception in the forward pass stops the engine core.
        """
        self.kv_cache_manager.uncache_blocks(output.newly_cached_blocks)
        if self.events.active:
            self.emit_kv_cache_events()  # the BlockRemoved events, right away
        if not requeue:
            return
        for scheduled in reversed(output.scheduled):  # appendleft in reverse keeps their order
            request = scheduled.request
            if request in self.running:
                self.running.remove(request)
            if scheduled.first_admission:
                request.num_cached_tokens = -1  # its hit may have included blocks just uncached
            self._requeue(request)

    # -- after the model ran --------------------------------------------------------
    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from whichever queue holds it and free its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free_blocks(request)
        if self.connector is not None:
            self.connector.request_finished(request)

    def _free_blocks(self, request: Request) -> None:
        if self.events.active:
            by_group = self.kv_cache_manager.get_block_ids_by_group(request.request_id)
            block_ids = tuple(block_id for ids in by_group for block_id in ids if block_id >= 0)
            self.kv_cache_manager.free(request)
            self.events.emit(BlocksFreed(request.request_id, block_ids))
        else:
            self.kv_cache_manager.free(request)

    def _emit_allocation(self, request: Request, new_blocks: KVCacheBlocks) -> None:
        # Evictions happen while the new blocks are popped, caching right after: report in that order.
        # The pool's KV events go to the listeners as they are (one family, vLLM's names).
        pool_events = self.kv_cache_manager.take_events()
        for event in pool_events:
            if isinstance(event, BlockRemoved):
                self.events.emit(event)
        block_ids = self.kv_cache_manager.block_ids_of(new_blocks)
        if block_ids:
            self.events.emit(BlocksAllocated(request.request_id, block_ids))
        for event in pool_events:
            if not isinstance(event, BlockRemoved):
                self.events.emit(event)

    def emit_kv_cache_events(self) -> None:
        """Pass the pending KV events (e.g. ``AllBlocksCleared`` after a reset) to the listeners: the pool's,
        then the offloading tier's (``medium="CPU"``), as vLLM's scheduler publishes them after each step."""
        for event in self.kv_cache_manager.take_events():
            self.events.emit(event)
        if self.connector is not None:
            for event in self.connector.take_events():
                self.events.emit(event)

    def set_kv_cache_events(self, enabled: bool) -> None:
        """Record the KV events while someone listens (the engine calls this as listeners come and go)."""
        self.kv_cache_manager.set_kv_cache_events(enabled)
        if self.connector is not None:
            self.connector.set_kv_cache_events(enabled)

    # -- the engine's view of the cache ------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (False, changing nothing, while a request holds blocks).

        With ``reset_running_requests`` every running request is preempted first
        (its blocks freed; it is recomputed from the waiting queue, in the same
        order), so the reset succeeds, as vLLM's ``Scheduler.reset_prefix_cache``.
        Listeners get the pool's ``AllBlocksCleared`` event, so a router in
        front of this engine learns that nothing is cached here any more.
        """
        if reset_running_requests:
            while self.running:  # from the back: preempt() puts each at the front, so they keep their order
                self.preempt(self.running.pop())
        reset = self.kv_cache_manager.reset_prefix_cache()
        if self.events.active:
            self.emit_kv_cache_events()
        return reset

    def make_stats(self) -> SchedulerStats:
        manager = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_preemptions=self.num_preemptions,
            num_blocks=manager.num_blocks,
            num_free_blocks=manager.get_num_free_blocks(),
            num_evictions=manager.num_evictions,
            prefix_cache_stats=copy.copy(manager.prefix_cache_stats),
            connector_prefix_cache_stats=copy.copy(self.connector.prefix_cache_stats) if self.connector else None,
        )
