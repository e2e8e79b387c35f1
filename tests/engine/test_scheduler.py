"""The scheduler on its own: a real ``KVCacheManager``, no model.

``FakeEngine.step`` is ``LLMEngine.step`` / ``_update_from_output`` without the forward pass:
schedule, then for every scheduled request that samples (a decode, or a prefill's last chunk)
append one made-up token and finish the request at its ``max_tokens``, through
``Scheduler.finish_request`` as ``LLMEngine._finish`` does. The tests read the scheduler's public
output (``SchedulerOutput``: who computes which tokens, who was preempted) and the manager's
state (block tables, free blocks, prefix-cache counters). Blocks hold 4 tokens throughout.
"""

from __future__ import annotations

import pytest

from mini_vllm.kv_cache_manager import KVCacheManager
from mini_vllm.request import Request, RequestStatus
from mini_vllm.scheduler import Scheduler, SchedulerOutput

BLOCK_SIZE = 4


class FakeEngine:
    """Drives a ``Scheduler`` step by step as ``LLMEngine`` does, with a "model" that returns a token per request."""

    def __init__(
        self,
        num_blocks: int,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        enable_caching: bool = True,
    ) -> None:
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)
        self.scheduler = Scheduler(self.manager, max_num_seqs, max_num_batched_tokens)
        self.max_tokens: dict[str, int] = {}
        self.sampled: list[str] = []  # the requests that got a token in the last step

    def add(self, request_id: str, prompt_token_ids: list[int], max_tokens: int = 100) -> Request:
        request = Request(request_id, prompt_token_ids, BLOCK_SIZE)
        self.max_tokens[request_id] = max_tokens
        self.scheduler.add_request(request)
        return request

    def step(self) -> tuple[SchedulerOutput, list[str]]:
        """One engine step; returns its plan and the ids of the requests that finished in it."""
        output = self.scheduler.schedule()
        finished = []
        self.sampled = []
        for scheduled in output.scheduled:  # the model would return one row of logits per entry
            if not scheduled.samples_token:
                continue  # a prefill chunk that is not the prompt's last: nothing to sample
            request = scheduled.request
            self.sampled.append(request.request_id)
            request.append_output_token_ids(1000 + request.num_tokens)  # the "sampled" token
            if request.num_output_tokens >= self.max_tokens[request.request_id]:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH_CAPPED)
                finished.append(request.request_id)
        self.manager.check_invariants()
        self.check_queues()
        return output, finished

    def check_queues(self) -> None:
        """The scheduler's invariants: each request in one queue; running ones hold blocks for their computed tokens."""
        running, waiting = self.scheduler.running, list(self.scheduler.waiting)
        assert not set(map(id, running)) & set(map(id, waiting))
        for request in running:
            assert request.status is RequestStatus.RUNNING
            assert len(self.manager.get_block_ids(request.request_id)) * BLOCK_SIZE >= request.num_computed_tokens
        for request in waiting:
            assert self.manager.get_block_ids(request.request_id) == [] and request.num_computed_tokens == 0

    def block_ids(self, request_id: str) -> list[int]:
        return self.manager.get_block_ids(request_id)


def plan(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, tokens computed before the step, tokens computed in it), in batch order."""
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in output.scheduled]


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_a_request_is_admitted_while_another_decodes():
    engine = FakeEngine(num_blocks=16)
    a = engine.add("a", prompt(100, 6))
    output, _ = engine.step()
    assert plan(output) == [("a", 0, 6)]
    assert engine.sampled == ["a"] and output.scheduled[0].first_admission
    assert a.num_output_tokens == 1

    b = engine.add("b", prompt(200, 5))  # arrives while a decodes
    output, _ = engine.step()
    assert plan(output) == [("a", 6, 1), ("b", 0, 5)]  # one batch: a's decode token and b's whole prompt
    assert [s.first_admission for s in output.scheduled] == [False, True]
    assert output.total_num_scheduled_tokens == 6
    assert (a.num_computed_tokens, b.num_computed_tokens) == (7, 5)
    assert (a.num_output_tokens, b.num_output_tokens) == (2, 1)
    assert engine.scheduler.running == [a, b] and not engine.scheduler.waiting

    output, _ = engine.step()
    assert plan(output) == [("a", 7, 1), ("b", 5, 1)]  # both decode
    # Each block table covers the request's computed tokens: ceil(8 / 4) and ceil(6 / 4) blocks.
    assert (len(engine.block_ids("a")), len(engine.block_ids("b"))) == (2, 2)


def test_a_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    engine = FakeEngine(num_blocks=16, max_num_batched_tokens=8)
    a = engine.add("a", prompt(100, 20))
    b = engine.add("b", prompt(200, 3))

    output, _ = engine.step()
    assert plan(output) == [("a", 0, 8)]  # the budget is spent on a's first chunk: b waits
    assert engine.sampled == [] and a.num_output_tokens == 0
    assert list(engine.scheduler.waiting) == [b]

    output, _ = engine.step()
    assert plan(output) == [("a", 8, 8)]  # a running request's next chunk comes first
    assert a.num_output_tokens == 0

    output, _ = engine.step()
    assert plan(output) == [("a", 16, 4), ("b", 0, 3)]  # the last chunk leaves room for b's prompt
    assert engine.sampled == ["a", "b"]
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 1)
    assert len(engine.block_ids("a")) == 5  # 20 tokens

    output, _ = engine.step()
    assert plan(output) == [("a", 20, 1), ("b", 3, 1)]
    for _ in range(5):
        output, _ = engine.step()
        assert output.total_num_scheduled_tokens <= 8


def test_when_blocks_run_out_the_most_recently_admitted_request_is_preempted_and_later_recomputed():
    engine = FakeEngine(num_blocks=4)
    engine.add("a", prompt(100, 8), max_tokens=2)  # 8 tokens: its next token needs a third block
    b = engine.add("b", prompt(200, 6), max_tokens=3)  # 6 tokens: its next one still fits its second
    output, _ = engine.step()
    assert plan(output) == [("a", 0, 8), ("b", 0, 6)]
    assert engine.manager.get_num_free_blocks() == 0  # 2 + 2 blocks
    b_blocks = engine.block_ids("b")

    output, finished = engine.step()
    # a (admitted first) needs a block; none is free, so b (admitted last) gives back its blocks.
    assert output.preempted == [b]
    assert plan(output) == [("a", 8, 1)]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and engine.block_ids("b") == []
    assert list(engine.scheduler.waiting) == [b] and engine.scheduler.running == []  # a finished in this step
    assert finished == ["a"]
    assert engine.scheduler.make_stats().num_preemptions == 1
    assert b.output_token_ids == [1000 + 6]  # its sampled token is kept: only its K/V are recomputed
    assert engine.block_ids("a") == [] and engine.manager.get_num_free_blocks() == 4  # a's blocks are free again

    output, _ = engine.step()
    # Re-admitted: its first block (4 prompt tokens, still cached) is a hit; the rest is
    # recomputed, including the token it had sampled, and the step samples its next token.
    assert plan(output) == [("b", 4, 3)] and engine.sampled == ["b"]
    assert not output.scheduled[0].first_admission
    assert engine.block_ids("b")[0] == b_blocks[0]
    assert b.num_cached_tokens == 0  # what it hit at its first admission, unchanged
    assert engine.manager.prefix_cache_stats.preempted_hits == 4
    assert b.num_output_tokens == 2

    output, finished = engine.step()
    assert plan(output) == [("b", 7, 1)] and finished == ["b"]
    assert engine.manager.get_num_free_blocks() == 4 and not engine.scheduler.has_unfinished_requests()


def test_no_request_is_admitted_in_a_step_that_preempted():
    engine = FakeEngine(num_blocks=4)
    engine.add("a", prompt(100, 8))
    engine.add("b", prompt(200, 6))
    engine.step()
    c = engine.add("c", prompt(300, 1))  # would need one block, and one is free after b's preemption
    output, _ = engine.step()
    assert [r.request_id for r in output.preempted] == ["b"]
    assert plan(output) == [("a", 8, 1)]
    assert [r.request_id for r in engine.scheduler.waiting] == ["b", "c"]  # the preempted one first
    assert c.status is RequestStatus.WAITING


def test_a_running_request_preempts_itself_when_it_is_the_only_one_left():
    engine = FakeEngine(num_blocks=2)
    a = engine.add("a", prompt(100, 8))  # fills both blocks
    engine.step()
    output, _ = engine.step()  # its 9th token needs a third block: there is none, and no one else to preempt
    assert output.preempted == [a] and output.is_empty
    assert a.status is RequestStatus.PREEMPTED and engine.manager.get_num_free_blocks() == 2


def test_admission_reuses_the_cached_prefix_of_an_earlier_request():
    engine = FakeEngine(num_blocks=16)
    engine.add("a", prompt(100, 10), max_tokens=1)
    output, finished = engine.step()
    assert finished == ["a"]
    a_blocks = output.scheduled[0].block_ids  # a's block table in that step; its 2 full blocks stay cached

    b = engine.add("b", prompt(100, 8) + [7, 7, 7])  # a's first 8 tokens, then its own
    output, _ = engine.step()
    assert plan(output) == [("b", 8, 3)]  # computes only the 3 tokens after the hit
    assert output.scheduled[0].block_ids[:2] == a_blocks[:2]
    assert b.num_cached_tokens == 8
    stats = engine.manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 21, 8)

    # A prompt that is all cached still computes its last token (its logits give the first
    # output token): at most (8 - 1) // 4 = 1 block comes from the cache.
    c = engine.add("c", prompt(100, 8))
    output, _ = engine.step()
    assert plan(output) == [("b", 11, 1), ("c", 4, 4)]
    assert c.num_cached_tokens == 4


def test_requests_running_together_share_their_common_blocks():
    engine = FakeEngine(num_blocks=16)
    engine.add("a", prompt(100, 9))
    engine.step()
    engine.add("b", prompt(100, 9))  # the same prompt, while a decodes
    output, _ = engine.step()
    assert plan(output) == [("a", 9, 1), ("b", 8, 1)]
    shared = engine.block_ids("a")[:2]
    assert engine.block_ids("b")[:2] == shared
    assert [engine.manager.block_pool.blocks[i].ref_cnt for i in shared] == [2, 2]


def test_finishing_frees_the_blocks_and_leaves_no_trace():
    engine = FakeEngine(num_blocks=16)
    engine.add("a", prompt(100, 5), max_tokens=2)
    engine.add("b", prompt(200, 9), max_tokens=4)
    engine.step()
    assert engine.manager.get_num_free_blocks() == 16 - 2 - 3

    output, finished = engine.step()
    assert finished == ["a"] and plan(output) == [("a", 5, 1), ("b", 9, 1)]
    assert a_gone(engine, "a")
    assert engine.manager.get_num_free_blocks() == 16 - 3  # only b's blocks are in use
    assert engine.scheduler.running == [output.scheduled[1].request]

    finished = []
    while engine.scheduler.has_unfinished_requests():
        finished += engine.step()[1]
    assert finished == ["b"] and a_gone(engine, "b")
    assert engine.manager.get_num_free_blocks() == 16
    assert engine.manager.req_to_blocks == {} and engine.manager.num_cached_block == {}
    assert engine.scheduler.schedule().is_empty


def a_gone(engine: FakeEngine, request_id: str) -> bool:
    scheduler = engine.scheduler
    queued = [r.request_id for r in [*scheduler.running, *scheduler.waiting]]
    return request_id not in queued and engine.block_ids(request_id) == []


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_at_most_max_num_seqs_requests_run(max_num_seqs):
    engine = FakeEngine(num_blocks=32, max_num_seqs=max_num_seqs)
    engine.add("a", prompt(100, 4), max_tokens=1)
    engine.add("b", prompt(200, 4), max_tokens=3)
    engine.add("c", prompt(300, 4), max_tokens=3)
    output, finished = engine.step()
    admitted = ["a", "b", "c"][:max_num_seqs]
    assert [s.request.request_id for s in output.scheduled] == admitted  # the rest wait, in order
    assert [r.request_id for r in engine.scheduler.waiting] == ["a", "b", "c"][max_num_seqs:]
    assert finished == ["a"]  # which makes room for the next one
    output, _ = engine.step()
    expected = {1: [("b", 0, 4)], 2: [("b", 4, 1), ("c", 0, 4)]}[max_num_seqs]
    assert plan(output) == expected
    while engine.scheduler.has_unfinished_requests():
        output, _ = engine.step()
        assert len(output.scheduled) <= max_num_seqs
    assert engine.manager.get_num_free_blocks() == 32
