"""``ParentRequest`` (``mini_vllm/parallel_sampling.py``): one prompt's child ids, the children's
settings, and the merge of their outputs; then ``n > 1`` end to end through ``LLM.generate``."""

from __future__ import annotations

import pytest

from mini_vllm import LLM, SamplingParams
from mini_vllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mini_vllm.parallel_sampling import ParentRequest


def child_output(request_id: str, token_ids: list[int], num_cached_tokens: int, arrival_time: float) -> RequestOutput:
    """What the engine's ``_make_output`` gives for one finished child: one completion, index 0."""
    return RequestOutput(
        request_id=request_id,
        prompt="Once upon a time",
        prompt_token_ids=[1, 2, 3],
        outputs=[CompletionOutput(0, f"text of {request_id}", token_ids, "length")],
        num_cached_tokens=num_cached_tokens,
        metrics=RequestMetrics(arrival_time=arrival_time),
    )


# -- child ids ------------------------------------------------------------------------------


def test_one_completion_is_the_prompt_itself():
    params = SamplingParams(max_tokens=4)
    parent = ParentRequest("0-0", params)
    assert parent.request_id == "0-0"
    assert parent.n == 1
    assert parent.child_request_ids == ["0-0"]
    assert parent.get_child_info(0) == ("0-0", params)
    assert parent.get_child_sampling_params(0) is params  # no copy for n == 1


def test_n_completions_are_named_id_dash_k_in_order():
    parent = ParentRequest("chat", SamplingParams(n=3))
    assert parent.n == 3
    assert parent.child_request_ids == ["chat-0", "chat-1", "chat-2"]
    assert [parent.get_child_info(k)[0] for k in range(3)] == ["chat-0", "chat-1", "chat-2"]


# -- child settings ---------------------------------------------------------------------------


def test_seeded_children_sample_with_seed_plus_k_and_n_1():
    params = SamplingParams(n=3, seed=7, temperature=1.0, top_k=5, max_tokens=8, stop=["\n"])
    parent = ParentRequest("r", params)
    children = [parent.get_child_sampling_params(k) for k in range(3)]
    assert [child.seed for child in children] == [7, 8, 9]
    assert [child.n for child in children] == [1, 1, 1]
    for child in children:
        assert child is not params
        assert (child.temperature, child.top_k, child.max_tokens, child.stop_strings) == (1.0, 5, 8, ["\n"])
    # The prompt's own settings are unchanged.
    assert (params.n, params.seed) == (3, 7)


def test_unseeded_children_stay_unseeded_and_get_their_own_copy():
    params = SamplingParams(n=2, temperature=0.8)
    parent = ParentRequest("r", params)
    first, second = (parent.get_child_sampling_params(k) for k in range(2))
    assert first.seed is None and second.seed is None
    assert first.n == second.n == 1
    assert first is not params and second is not params and first is not second
    assert params.n == 2


def test_a_completion_index_out_of_range_is_refused():
    parent = ParentRequest("r", SamplingParams(n=2))
    with pytest.raises(IndexError, match="'r' has 2 completions; there is no completion 2"):
        parent.get_child_sampling_params(2)


# -- merge ------------------------------------------------------------------------------------


def test_merge_orders_completions_by_child_sets_index_and_takes_the_first_childs_metrics():
    parent = ParentRequest("p", SamplingParams(n=3, seed=1))
    outputs = {
        "p-0": child_output("p-0", [10], num_cached_tokens=0, arrival_time=1.0),
        "p-1": child_output("p-1", [11], num_cached_tokens=16, arrival_time=2.0),
        "p-2": child_output("p-2", [12], num_cached_tokens=16, arrival_time=3.0),
        "other": child_output("other", [99], num_cached_tokens=5, arrival_time=4.0),  # not ours: ignored
    }
    # Finished in another order than the children's: the merge follows the children's order.
    finished = {key: outputs[key] for key in ("p-2", "other", "p-0", "p-1")}
    merged = parent.merge(finished)
    assert merged.request_id == "p"
    assert merged.prompt == "Once upon a time"
    assert merged.prompt_token_ids == [1, 2, 3]
    assert [c.token_ids for c in merged.outputs] == [[10], [11], [12]]
    assert [c.index for c in merged.outputs] == [0, 1, 2]
    assert [c.text for c in merged.outputs] == ["text of p-0", "text of p-1", "text of p-2"]
    assert merged.num_cached_tokens == 0  # the first child's, not the largest or the last
    assert merged.metrics is outputs["p-0"].metrics
    assert merged.per_completion_metrics == [outputs[k].metrics for k in ("p-0", "p-1", "p-2")]
    assert [m.arrival_time for m in merged.per_completion_metrics] == [1.0, 2.0, 3.0]


def test_merge_of_one_completion_keeps_the_prompts_id():
    parent = ParentRequest("solo", SamplingParams())
    child = child_output("solo", [5, 6], num_cached_tokens=4, arrival_time=1.0)
    merged = parent.merge({"solo": child})
    assert merged.request_id == "solo"
    assert [c.token_ids for c in merged.outputs] == [[5, 6]]
    assert merged.outputs[0].index == 0
    assert merged.num_cached_tokens == 4
    assert merged.per_completion_metrics == [child.metrics]


def test_merge_with_a_missing_child_names_it():
    parent = ParentRequest("p", SamplingParams(n=3))
    finished = {"p-0": child_output("p-0", [1], 0, 1.0), "p-2": child_output("p-2", [3], 0, 1.0)}
    with pytest.raises(ValueError, match=r"cannot merge request 'p': 1 of its 3 completions .*\['p-1'\]"):
        parent.merge(finished)


# -- end to end -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_blocks=64)


def test_n_3_seeded_equals_three_single_runs_seeded_7_8_9(llm):
    prompt = "Once upon a time"
    [merged] = llm.generate(prompt, SamplingParams(n=3, seed=7, max_tokens=8, temperature=1.0))
    assert len(merged.outputs) == 3
    assert [c.index for c in merged.outputs] == [0, 1, 2]
    assert len(merged.per_completion_metrics) == 3
    singles = [
        llm.generate(prompt, SamplingParams(seed=seed, max_tokens=8, temperature=1.0))[0].outputs[0]
        for seed in (7, 8, 9)
    ]
    assert [c.token_ids for c in merged.outputs] == [c.token_ids for c in singles]
    assert [c.text for c in merged.outputs] == [c.text for c in singles]
    assert len({tuple(c.token_ids) for c in singles}) > 1  # the seeds do give different samples
    assert not llm.llm_engine.requests  # every child finished and left the engine


def test_add_requests_returns_the_parents_child_ids(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=3)
    parents = engine.add_parent_requests(["Once upon a time", "Hello"], params, request_ids=["a", "b"])
    try:
        assert [p.request_id for p in parents] == ["a", "b"]
        assert [p.child_request_ids for p in parents] == [["a-0", "a-1"], ["b-0", "b-1"]]
        assert [engine.requests[k].sampling_params.seed for k in ("a-0", "a-1", "b-0", "b-1")] == [3, 4, 3, 4]
    finally:
        for request_id in ("a-0", "a-1", "b-0", "b-1"):
            engine.abort_request(request_id)
    assert engine.add_requests("Hello", SamplingParams(n=2, max_tokens=1), request_ids=["c"]) == {"c": ["c-0", "c-1"]}
    for request_id in ("c-0", "c-1"):
        engine.abort_request(request_id)
    assert not engine.requests


def test_abort_request_takes_a_prompts_id_and_lists_of_ids_as_vllms_does(llm):
    """vLLM's ``abort_request(request_ids)``: several ids at once, and a prompt's id stops all its completions."""
    from engine_invariants import assert_nothing_leaked

    engine = llm.llm_engine
    long = SamplingParams(n=3, max_tokens=200, temperature=1.0, ignore_eos=True)
    engine.add_requests(["Once upon a time"], long, request_ids=["P"])
    engine.add_requests(["Hello", "Hi"], SamplingParams(max_tokens=200, ignore_eos=True), request_ids=["x", "y"])
    engine.step()
    assert sorted(engine.requests) == ["P-0", "P-1", "P-2", "x", "y"]
    engine.abort_request("P")  # the prompt's id: its three completions
    assert sorted(engine.requests) == ["x", "y"]
    engine.abort_request(("x", "y"))  # a tuple of ids, as vLLM's list
    assert not engine.requests
    assert_nothing_leaked(engine)
    engine.abort_request(["P", "x", "never-seen"])  # finished and unknown ids: nothing to do
    for bad in (None, 5, ["x", 5]):
        with pytest.raises(TypeError, match="request_ids must be a str or an iterable of str"):
            engine.abort_request(bad)
    # A prompt whose completions all finished is forgotten with the last one (no state left behind).
    engine.add_requests(["Hello"], SamplingParams(n=2, max_tokens=1, temperature=1.0), request_ids=["z"])
    assert engine.parent_requests == {"z": ["z-0", "z-1"]}
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.parent_requests
    assert_nothing_leaked(engine)
