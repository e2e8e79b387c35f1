"""Checks for chapter 08: admitting waiting requests with a prefix lookup.

:func:`check_schedule_waiting` plugs your
``schedule_waiting(scheduler, token_budget, output) -> int`` into a real
:class:`~mini_vllm.scheduler.Scheduler` (with a real ``KVCacheManager``) and
runs scenarios step by step next to an untouched scheduler. No model is
needed: a fake "model" appends one token to every request that completed its
prefill, and finishes a request after its ``max_tokens``. After every step the
two schedulers must agree on everything: which requests ran with how many
tokens, their block tables, the queues, each request's ``num_cached_tokens``,
every block's ref count, the free queue, the prefix-cache counters and the
budget your function returns. Two schedulers with your function also run side
by side, interleaved, to catch state kept outside the scheduler.
"""

from __future__ import annotations

import types

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..events import ComputedBlocksFound
from ..kv_cache_manager import KVCacheManager
from ..request import Request, RequestStatus
from ..scheduler import Scheduler
from ._harness import CheckFailure, Checker, _short, guarded_check, learner_error
from .fixtures import pool_state


@dataclass
class Arrival:
    step: int  # the request is added before this step's schedule() (steps count from 0)
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class Scenario:
    """A pool and a scheduler's limits, and the requests that arrive (the fixed scenarios name what they change)."""

    name: str
    num_blocks: int = 12
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    arrivals: list[Arrival] = field(default_factory=list)
    enable_caching: bool = True


class _BoundedManager(KVCacheManager):
    """A :class:`KVCacheManager` that stops a learner's admission loop that never ends (one that rotates the
    queue past a request that does not fit, or never pops the one it admitted): at most a few lookups per
    waiting request in one ``schedule_waiting`` call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.looked_up = set()  # the requests get_computed_blocks was called for, in the last schedule_waiting call
        self.bound_lookups(None)

    def bound_lookups(self, limit: int | None, what: str = "") -> None:
        """From now on at most ``limit`` lookups (None: no bound); ``what`` names the call in the message.
        ``looked_up`` starts again: the requests looked up from now on."""
        self.lookups_left, self.lookups_limit, self.bounded_call = limit, limit, what
        if limit is not None:
            self.looked_up: set[str] = set()

    def get_computed_blocks(self, request: Request):
        self.looked_up.add(request.request_id)
        if self.lookups_left is not None:
            if self.lookups_left == 0:
                raise CheckFailure(
                    f"schedule_waiting: {self.bounded_call}: your loop called get_computed_blocks "
                    f"{self.lookups_limit} times and had not stopped: a loop that never ends\n"
                    "    hint: when allocate_slots returns None (the request does not fit), stop admitting (break): "
                    "the scheduler tries again next step, in the same order. Pop each admitted request from "
                    "scheduler.waiting, and never put a waiting request back (rotate, append) to try the next one"
                )
            self.lookups_left -= 1
        return super().get_computed_blocks(request)


class _CheckedScheduler(Scheduler):
    """A :class:`Scheduler` whose admission is the learner's ``schedule_waiting(scheduler, token_budget, output)``.

    ``Scheduler.schedule_waiting`` is chapter 08's exercise and a subclass may
    override it: this one calls the learner's function, guarded (a crash names
    the step, the queues and the free blocks), or the reference when there is
    none, and records the budget it returns.
    """

    def __init__(self, *args, learner_fn: Callable | None, describe_step: Callable[[], str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.learner_fn = learner_fn
        self.describe_step = describe_step
        self.budget_returned: int | None = None
        self.budget_given: int | None = None

    def check_admissions(self, token_budget: int, admitted: list) -> None:
        """Nothing here: the check compares every step with the reference's and names the mistake itself."""

    def schedule_waiting(self, token_budget: int, output) -> int:
        self.budget_given = token_budget
        if self.learner_fn is None:
            self.budget_returned = super().schedule_waiting(token_budget, output)
            return self.budget_returned
        waiting = [r.request_id for r in self.waiting]
        what = (
            f"{self.describe_step()}: schedule_waiting(scheduler, token_budget={token_budget}, output) with "
            f"waiting={waiting}, running={[r.request_id for r in self.running]}, "
            f"{self.kv_cache_manager.block_pool.get_num_free_blocks()} free blocks"
        )
        expected = "the budget left, after admitting waiting requests in order while they fit"
        try:
            self.kv_cache_manager.bound_lookups(4 * len(self.waiting) + 8, what)
            try:
                self.budget_returned = self.learner_fn(self, token_budget, output)
            finally:
                self.kv_cache_manager.bound_lookups(None)
        except (NotImplementedError, CheckFailure):
            raise
        except Exception as error:  # noqa: BLE001 - reported with the step that triggered it
            hint = ""
            if isinstance(error, ValueError) and "num_new_tokens must be positive, got -" in str(error):
                hint = (
                    "num_new_tokens came out negative: count what the request still needs from request.num_tokens "
                    "(its prompt and the tokens it has generated: a preempted request comes back with more than its "
                    "prompt) minus the hit's tokens, num_new_local_computed_tokens"
                )
            if isinstance(error, ValueError) and "num_new_tokens must be positive, got 0" in str(error):
                hint = (
                    "allocate_slots was asked for 0 new tokens: the token budget was spent (or was 0 to begin "
                    "with) and your loop went on admitting. Stop admitting once the budget is used up: loop "
                    "while scheduler.waiting and token_budget > 0 (and fewer than max_num_seqs are running)"
                )
            if isinstance(error, AssertionError) and "already holds blocks" in str(error):
                hint = (
                    "allocate_slots was given hit blocks for a request that already holds blocks: it is already "
                    "admitted, so the request you looked up and allocated for is not the one you take out of "
                    "scheduler.waiting. Use one end of the queue for both: scheduler.waiting[0], then popleft()"
                )
            raise learner_error("schedule_waiting", what, error, expected, hint) from None
        if isinstance(self.budget_returned, types.GeneratorType):
            raise CheckFailure(
                f"schedule_waiting: {what} returned a generator: your function has a `yield`, so calling it runs "
                "none of its code\n    hint: admit the requests in a loop and `return token_budget` (the budget "
                "left) at the end; no yield"
            )
        return self.budget_returned


class _Run:
    """One scheduler (the reference, or one with the learner's admission) driven by a fake model."""

    def __init__(self, scenario: Scenario, schedule_waiting: Callable | None) -> None:
        self.scenario = scenario
        manager = _BoundedManager(scenario.num_blocks, scenario.block_size, scenario.enable_caching)
        self.scheduler = _CheckedScheduler(
            manager,
            scenario.max_num_seqs,
            scenario.max_num_batched_tokens,
            learner_fn=schedule_waiting,
            describe_step=lambda: f"scenario '{scenario.name}', step {self.step_index}",
        )
        self.requests: dict[str, Request] = {}
        self.max_tokens: dict[str, int] = {}
        self.step_index = 0
        # The dashboard's hit events (optional in the exercise), per step: a listener makes events.active true.
        self.hits_shown: dict[int, list[tuple[str, tuple[int, ...], int]]] = {}
        self.scheduler.events.add(self._record_hit)
        # The scheduler owns its queues: the admission moves requests between them, never replaces them.
        self.queues = (self.scheduler.waiting, self.scheduler.running)

    def _record_hit(self, event: Any) -> None:
        if isinstance(event, ComputedBlocksFound):
            shown = (event.request_id, event.block_ids, event.num_computed_tokens)
            self.hits_shown.setdefault(self.step_index, []).append(shown)

    def done(self) -> bool:
        pending = any(a.step >= self.step_index for a in self.scenario.arrivals)
        return not pending and not self.scheduler.has_unfinished_requests()

    def step(self) -> dict[str, Any]:
        for arrival in self.scenario.arrivals:
            if arrival.step == self.step_index:
                request = Request(arrival.request_id, arrival.prompt_token_ids, block_size=self.scenario.block_size)
                self.requests[arrival.request_id] = request
                self.max_tokens[arrival.request_id] = arrival.max_tokens
                self.scheduler.add_request(request)
        waiting_before = [r.request_id for r in self.scheduler.waiting]
        self.scheduler.budget_returned = self.scheduler.budget_given = None
        output = self.scheduler.schedule()
        for name, queue, kind in zip(("waiting", "running"), self.queues, ("deque", "list")):
            if getattr(self.scheduler, name) is not queue:
                how = "popleft() the admitted request" if name == "waiting" else "append() the admitted request"
                raise CheckFailure(
                    f"schedule_waiting: scenario '{self.scenario.name}', step {self.step_index}: your function "
                    f"replaced scheduler.{name} with a new {type(getattr(self.scheduler, name)).__name__}\n"
                    f"    hint: the scheduler owns its {kind} scheduler.{name} (vLLM's owns its request queues) "
                    f"and keeps using that object: change it in place ({how}), never assign a new one"
                )
        snapshot = self.snapshot(output, waiting_before)
        # The fake model: every request whose prompt is fully computed gets one new token.
        for scheduled in output.scheduled:
            request = scheduled.request
            if scheduled.samples_token:
                request.append_output_token_ids(1000 + (request.num_tokens * 7 + len(request.request_id)) % 89)
                if request.num_output_tokens >= self.max_tokens[request.request_id]:
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH_CAPPED)
        self.step_index += 1
        return snapshot

    def snapshot(self, output, waiting_before: list[str]) -> dict[str, Any]:
        manager = self.scheduler.kv_cache_manager
        pool = manager.block_pool
        stats = manager.prefix_cache_stats
        return {
            "scheduled": [
                # The scenarios have one KV-cache group: its block table.
                (s.request.request_id, s.num_computed_tokens, s.num_new_tokens, tuple(s.block_ids[0]))
                for s in output.scheduled
            ],
            "preempted": [r.request_id for r in output.preempted],
            "waiting_before": waiting_before,
            "waiting": [r.request_id for r in self.scheduler.waiting],
            "running": [r.request_id for r in self.scheduler.running],
            "status": {rid: r.status.name for rid, r in self.requests.items()},
            "num_computed_tokens": {rid: r.num_computed_tokens for rid, r in self.requests.items()},
            "num_cached_tokens": {rid: r.num_cached_tokens for rid, r in self.requests.items()},
            "num_preemptions": {rid: r.num_preemptions for rid, r in self.requests.items()},
            "num_tokens": {rid: r.num_tokens for rid, r in self.requests.items()},
            "pool": pool_state(pool),
            "prefix_cache_stats": (stats.requests, stats.queries, stats.hits),
            "budget_returned": self.scheduler.budget_returned,
            "budget_given": self.scheduler.budget_given,
        }


def _admitted(snapshot: dict[str, Any]) -> list[str]:
    """Requests that were waiting before the step and ran in it."""
    waiting_before = set(snapshot["waiting_before"])
    return [rid for rid, *_ in snapshot["scheduled"] if rid in waiting_before]


def _diagnose(
    scenario: Scenario, step: int, got: dict[str, Any], want: dict[str, Any], looked_up: set[str] | None = None
) -> tuple[str, str]:
    """(what differs, hint) for the first difference between two snapshots of the same step.

    ``looked_up``: the requests the learner's function looked up (``get_computed_blocks``) in this step; a
    hint about the hit's blocks or tokens says first when there was no lookup to take them from.
    """
    where = f"scenario '{scenario.name}', step {step}"
    got_admitted, want_admitted = _admitted(got), _admitted(want)
    if got_admitted != want_admitted:
        problem = (
            f"{where}: the requests admitted from the waiting queue should be {want_admitted}; yours: {got_admitted}"
        )
        extra = [rid for rid in got_admitted if rid not in want_admitted]
        if len(got["running"]) > scenario.max_num_seqs:
            return problem, (
                f"max_num_seqs = {scenario.max_num_seqs}: stop admitting once that many requests are running"
            )
        got_tokens = sum(n for _, _, n, _ in got["scheduled"])
        if got_tokens > scenario.max_num_batched_tokens:
            return problem, (
                f"the token budget is {scenario.max_num_batched_tokens} tokens per step and you scheduled "
                f"{got_tokens}: stop when the budget is spent and return what is left"
            )
        if extra:
            order = want["waiting_before"]
            blocked = [rid for rid in order if rid not in want_admitted and rid in got["waiting_before"]]
            if blocked and blocked[0] == extra[0]:
                return problem, (
                    f"'{extra[0]}' did not fit in the free blocks: allocate_slots returned None for it, and None "
                    "means nothing was allocated. Check for None before admitting, and stop there (FIFO)"
                )
            if blocked and order.index(blocked[0]) < order.index(extra[0]):
                return problem, (
                    f"'{blocked[0]}' did not fit in the free blocks (allocate_slots returned None), so admission "
                    f"stops there for this step: a request behind it ('{extra[0]}') may not overtake it (FIFO). "
                    "Break out of the loop; do not skip to the next request"
                )
            return problem, "admit waiting requests in order, while the budget, max_num_seqs and the free blocks allow"
        if sorted(got_admitted) == sorted(want_admitted):
            return problem, (
                "the right requests, in the wrong order: admit from the FRONT of scheduler.waiting "
                "(scheduler.waiting[0], then popleft()), in arrival order; do not sort the queue (e.g. shortest "
                "first) or take from its back (pop())"
            )
        missing = [rid for rid in want_admitted if rid not in got_admitted]
        if not missing:
            return problem, "admit waiting requests in order, while the budget, max_num_seqs and the free blocks allow"
        return problem, (
            f"'{missing[0]}' fits (budget, max_num_seqs and free blocks all allow it) but you did not admit it; "
            "keep admitting until the first request that does not fit"
        )
    want_by_id = {rid: (c, n, b) for rid, c, n, b in want["scheduled"]}
    for rid, computed, new, blocks in got["scheduled"]:
        if rid not in want_by_id:
            return (
                f"{where}: '{rid}' ran in this step but should not have; the step should run "
                f"{[r for r, *_ in want['scheduled']]}; yours ran {[r for r, *_ in got['scheduled']]}",
                "admit each request once: after popleft() it is in scheduler.running, and the running "
                "requests are scheduled before yours is called",
            )
        want_computed, want_new, want_blocks = want_by_id[rid]
        not_looked_up = looked_up is not None and rid not in looked_up and want_computed > 0
        if not_looked_up and ((computed, new) != (want_computed, want_new) or blocks != want_blocks):
            problem = (
                f"{where}: '{rid}' should compute tokens [{want_computed}, {want_computed + want_new}) with the block "
                f"table {list(want_blocks)}; yours: [{computed}, {computed + new}), {list(blocks)}"
            )
            return problem, _no_lookup_hint(rid, got)
        if (computed, new) != (want_computed, want_new):
            problem = (
                f"{where}: '{rid}' should compute tokens [{want_computed}, {want_computed + want_new}) "
                f"({want_new} new tokens after {want_computed} cached); yours: [{computed}, {computed + new})"
            )
            if computed == want_computed > 0 and new > want_new and computed + new > got["num_tokens"][rid]:
                return problem, (
                    f"'{rid}' has {got['num_tokens'][rid]} tokens, {want_computed} of them found in the prefix "
                    f"cache: only {got['num_tokens'][rid] - want_computed} are left to compute, and you scheduled "
                    f"{new}. Count the hit's tokens as computed before you work out the new ones: num_new_tokens = "
                    "min(request.num_tokens - num_new_local_computed_tokens, token_budget), with "
                    "num_new_local_computed_tokens from get_computed_blocks (request.num_computed_tokens is still 0 "
                    "before admission)"
                )
            if computed == 0 and want_computed > 0:
                return problem, (
                    f"get_computed_blocks found {want_computed} cached tokens: start from there "
                    "(pass num_new_local_computed_tokens to schedule_request) and compute only the rest"
                )
            if new > want_new and want_computed + want_new < computed + new:
                return problem, (
                    "chunked prefill: a prompt longer than the token budget left gets only "
                    "min(remaining tokens, token_budget) tokens now, the rest in later steps"
                )
            return problem, "num_new_tokens = min(request.num_tokens - num_new_local_computed_tokens, token_budget)"
        if blocks != want_blocks:
            problem = f"{where}: '{rid}' should have the block table {list(want_blocks)}; yours: {list(blocks)}"
            num_hit_blocks = want_computed // scenario.block_size
            if num_hit_blocks and tuple(blocks[:num_hit_blocks]) != tuple(want_blocks[:num_hit_blocks]):
                return problem, (
                    f"its first {want_computed // scenario.block_size} blocks are cache hits shared with another "
                    "request: pass the hit blocks and their token count to allocate_slots "
                    "(allocate_slots(request, num_new_tokens, num_new_local_computed_tokens, new_computed_blocks)), "
                    "or they are allocated a second time and not shared"
                )
            if len(blocks) > len(want_blocks) and tuple(blocks[: len(want_blocks)]) == tuple(want_blocks):
                return problem, (
                    f"the table is long: allocate_slots was asked for more tokens than '{rid}' computes in this step. "
                    "Its num_new_tokens are only the tokens after the hit (at most the budget left); the hit's tokens "
                    "go to allocate_slots separately, as num_new_local_computed_tokens"
                )
            if want_computed and len(blocks) < len(want_blocks):
                return problem, (
                    f"the table is short: its {want_computed} cached tokens were not counted. Pass the hit's token "
                    "count as allocate_slots' third argument (allocate_slots(request, num_new_tokens, "
                    "num_new_local_computed_tokens, new_computed_blocks)): with 0 it sizes the table as if the "
                    "hit blocks held nothing"
                )
            return problem, "allocate the slots with kv_cache_manager.allocate_slots, once per admitted request"
    for rid, want_cached in want["num_cached_tokens"].items():
        got_cached = got["num_cached_tokens"][rid]
        if got_cached != want_cached:
            problem = f"{where}: '{rid}'.num_cached_tokens should be {want_cached}; yours: {got_cached}"
            if want["num_preemptions"][rid] > 0 and want_cached >= 0:
                return problem, (
                    f"'{rid}' was preempted and re-admitted: num_cached_tokens reports the hit of its FIRST "
                    "admission (what the user's prompt got from the cache); set it only while it is still -1"
                )
            if want_cached < 0:
                return problem, (
                    f"'{rid}' has not been admitted yet (allocate_slots returned None, or it was not tried): set "
                    "num_cached_tokens only after allocate_slots has returned its blocks, on its first admission"
                )
            return problem, "on first admission, set request.num_cached_tokens to the cached tokens found"
    if got["status"] != want["status"]:
        rid = next(r for r in want["status"] if got["status"][r] != want["status"][r])
        problem = f"{where}: '{rid}'.status should be {want['status'][rid]}; yours: {got['status'][rid]}"
        if rid in want["waiting"]:
            return problem, (
                f"'{rid}' was not admitted (it did not fit), so it stays waiting: set its status to RUNNING only "
                "after allocate_slots has returned its blocks"
            )
        return problem, "an admitted request's status becomes RequestStatus.RUNNING"
    if got["waiting"] != want["waiting"] or got["running"] != want["running"]:
        problem = (
            f"{where}: queues should be waiting={want['waiting']}, running={want['running']}; "
            f"yours: waiting={got['waiting']}, running={got['running']}"
        )
        lost = [rid for rid in want["waiting"] if rid not in got["waiting"] and rid not in got["running"]]
        if lost:
            return problem, (
                f"'{lost[0]}' did not fit, so it must stay at the front of scheduler.waiting; yours took it off the "
                "queue. Look at scheduler.waiting[0] and popleft() only once allocate_slots has returned blocks"
            )
        if (
            want["waiting"]
            and sorted(got["waiting"]) == sorted(want["waiting"])
            and got["waiting"][-1] == want["waiting"][0] != got["waiting"][0]
        ):
            return problem, (
                f"'{want['waiting'][0]}' did not fit, so it must stay at the FRONT of scheduler.waiting; yours put it "
                "back at the end (append). Look at scheduler.waiting[0] and popleft() only once allocate_slots has "
                "returned blocks"
            )
        return problem, (
            "an admitted request leaves the front of scheduler.waiting (popleft) and joins the end of scheduler.running"
        )
    if got["budget_returned"] != want["budget_returned"]:
        given, left, returned = want["budget_given"], want["budget_returned"], got["budget_returned"]
        scheduled = {rid: num_computed for rid, num_computed, *_ in want["scheduled"]}
        cached = sum(scheduled[rid] for rid in _admitted(want))  # what the admissions found computed already
        if returned == given != left:
            hint = "you returned the budget you were given: take each admitted request's num_new_tokens off it"
        elif cached and returned == left - cached:
            hint = "cached tokens cost no budget: only each request's num_new_tokens comes off token_budget"
        else:
            hint = (
                f"this call was given token_budget={given}: return it minus the num_new_tokens of each request "
                "this call admitted, counted from that argument alone (no total kept between calls in a global, "
                "a default argument or an attribute)"
            )
        return (
            f"{where}: your function should return {left} (the token budget left); it returned {returned}",
            hint,
        )
    if got["prefix_cache_stats"] != want["prefix_cache_stats"]:
        return (
            f"{where}: prefix-cache counters (requests, queries, hits) should be {want['prefix_cache_stats']}; "
            f"yours: {got['prefix_cache_stats']}",
            "leave the counters to the engine: allocate_slots counts a request's lookup when it admits it, so "
            "call get_computed_blocks once per request you try to admit, pass its result to allocate_slots, and "
            "do not change prefix_cache_stats yourself",
        )
    if got["pool"] != want["pool"]:
        queue = "free queue (head -> tail)"
        return (
            f"{where}: block ref counts / free queue differ: expected ref_cnt {want['pool']['ref_cnt']}, "
            f"free queue {want['pool'][queue]}; yours: {got['pool']['ref_cnt']}, {got['pool'][queue]}",
            "let allocate_slots take the references (it touches the hit blocks); do not touch blocks yourself",
        )
    for key in want:
        if got[key] != want[key]:
            return f"{where}: {key} should be {_short(want[key])}; yours: {_short(got[key])}", ""
    return f"{where}: differs", ""


def _no_lookup_hint(rid: str, got: dict[str, Any]) -> str:
    """The hint for a request admitted without a lookup while the prefix cache held some of its blocks."""
    again = got["num_preemptions"][rid] > 0
    return (
        f"your function did not look '{rid}' up in the prefix cache (no get_computed_blocks(request) for it in this "
        "step), and the cache held "
        + (
            "its first blocks: it was preempted and comes back now. Preemption freed its blocks, but they stay "
            "cached until they are evicted, so a re-admitted request finds what is left of them. "
            if again
            else "its first blocks. "
        )
        + "Look up every request you try to admit, each time you try it, and pass what the lookup found to "
        "allocate_slots and schedule_request"
    )


def _run_scenario(
    schedule_waiting: Callable, check: Checker, scenario: Scenario, random_case: bool = False, copies: int = 1
) -> None:
    """Step the reference and ``copies`` schedulers with the learner's admission side by side.

    With two copies the learner's schedulers run interleaved, as two engines in one process do:
    state kept outside the scheduler (a mutable default, a global) shows up as a difference.
    """
    reference = _Run(scenario, None)
    learners = [_Run(scenario, schedule_waiting) for _ in range(copies)]
    for step in range(500):
        if reference.done():
            break
        want = reference.step()
        for copy_index, learner in enumerate(learners):
            check.case = f"scenario '{scenario.name}', step {step}"
            got = learner.step()
            if got != want:
                problem, hint = _diagnose(scenario, step, got, want, learner.scheduler.kv_cache_manager.looked_up)
                if copy_index > 0:
                    problem = f"two schedulers running side by side, the second one: {problem}"
                    hint = (
                        "the first scheduler was right, the second differs: your function keeps state outside "
                        "the scheduler it is given (a mutable default argument such as seen=[], a global, a "
                        "function attribute). Use only the scheduler and its kv_cache_manager. Then: " + hint
                    )
                check.expect(False, problem, hint, random_case=random_case)
            if learner.hits_shown:  # the optional dashboard lines are in: they must say what happened
                _expect_same_hits_shown(check, scenario, step, learner, reference, random_case)
    else:
        check.fail(f"scenario '{scenario.name}' did not finish in 500 steps (with the reference)")
    for learner in learners:
        check.expect(
            learner.done(), f"scenario '{scenario.name}': requests are left unfinished", random_case=random_case
        )


def _expect_same_hits_shown(
    check: Checker, scenario: Scenario, step: int, learner: _Run, reference: _Run, random_case: bool
) -> None:
    """The dashboard's ``ComputedBlocksFound`` events of a step: one per admitted request, as the reference's."""
    got, want = learner.hits_shown.get(step, []), reference.hits_shown.get(step, [])
    if got == want:
        return
    hint = (
        "emit ComputedBlocksFound(request.request_id, manager.block_ids_of(new_computed_blocks), "
        "num_new_local_computed_tokens) once per admitted request, right after its status is set: not for a "
        "request that did not fit (allocate_slots returned None), and with the lookup's blocks and tokens"
    )
    check.expect(
        False,
        f"scenario '{scenario.name}', step {step}: your optional dashboard lines announced the hits "
        f"(request id, hit block ids, hit tokens) {got}; the admissions were {want}",
        hint,
        random_case=random_case,
    )


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def fixed_scenarios() -> list[Scenario]:
    """The edge cases, each built to expose one mistake."""
    system = _tokens(1, 8)  # two full blocks of 4 tokens
    return [
        Scenario(
            "a later request hits the blocks of a running one",
            arrivals=[Arrival(0, "A", system + [20, 21], 4), Arrival(1, "B", system + [30, 31, 32], 3)],
        ),
        Scenario(
            "two requests with one prefix in the same step",
            arrivals=[Arrival(0, "A", system + [20], 3), Arrival(0, "B", system + [30, 31], 3)],
        ),
        Scenario(
            "FIFO: a request that does not fit blocks the ones behind it",
            num_blocks=8,
            arrivals=[
                Arrival(0, "R", _tokens(100, 18), 3),
                Arrival(1, "big", _tokens(200, 16), 2),
                Arrival(1, "small", _tokens(300, 3), 2),
            ],
        ),
        Scenario(
            "max_num_seqs = 2",
            num_blocks=16,
            max_num_seqs=2,
            arrivals=[Arrival(0, name, _tokens(10 * i + 100, 5), 2) for i, name in enumerate("XYZ")],
        ),
        Scenario(
            "a 20-token prompt with a budget of 8 tokens (chunked prefill)",
            max_num_batched_tokens=8,
            arrivals=[Arrival(0, "long", _tokens(1, 20), 2)],
        ),
        Scenario(
            "two 6-token prompts with a budget of 8 tokens",
            max_num_batched_tokens=8,
            arrivals=[Arrival(0, "P", _tokens(1, 6), 2), Arrival(0, "Q", _tokens(50, 6), 2)],
        ),
        Scenario(
            "an 8-token prompt spends the whole budget of 8: the request behind it waits",
            max_num_batched_tokens=8,
            arrivals=[Arrival(0, "P", _tokens(1, 8), 2), Arrival(0, "Q", _tokens(50, 4), 2)],
        ),
        Scenario(
            "preemption and re-admission",
            num_blocks=7,
            arrivals=[
                Arrival(0, "A", system + [40], 12),
                Arrival(1, "B", system + [50, 51, 52, 53], 12),
            ],
        ),
        Scenario(
            "prefix caching disabled",
            arrivals=[Arrival(0, "A", system + [20], 2), Arrival(1, "B", system + [30], 2)],
            enable_caching=False,
        ),
    ]


def random_scenario(rng, index: int) -> Scenario:
    block_size = rng.choice([2, 3, 4])  # 3: the engine accepts any block size, not only powers of two
    num_blocks = rng.randint(6, 16)
    prefixes = [_tokens(1000 * (p + 1), rng.randint(0, 3 * block_size)) for p in range(3)]
    arrivals = []
    for r in range(rng.randint(2, 6)):
        prompt = rng.choice(prefixes) + _tokens(100 * (r + 1) + 10 * index, rng.randint(1, 2 * block_size))
        capacity = num_blocks * block_size
        prompt = prompt[: capacity - 2]
        max_tokens = rng.randint(1, max(1, min(8, capacity - len(prompt))))
        arrivals.append(Arrival(rng.randint(0, 4), f"r{r}", prompt, max_tokens))
    arrivals.sort(key=lambda a: a.step)
    return Scenario(
        f"random {index}",
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 4),
        max_num_batched_tokens=rng.choice([3, 5, 8, 16, 64]),
        arrivals=arrivals,
        enable_caching=rng.random() < 0.85,
    )


@guarded_check(part="schedule_waiting")
def check_schedule_waiting(schedule_waiting: Callable) -> None:
    """Your ``schedule_waiting(scheduler, token_budget, output) -> int`` (``Scheduler.schedule_waiting``)."""
    check = Checker("schedule_waiting")
    # Two engines at once must not interfere (first: state kept between calls shows up here by name).
    _run_scenario(schedule_waiting, check, fixed_scenarios()[0], copies=2)
    for scenario in fixed_scenarios():
        _run_scenario(schedule_waiting, check, scenario)
    for index in range(40):
        _run_scenario(schedule_waiting, check, random_scenario(check.rng, index), random_case=True)
    check.passed()
