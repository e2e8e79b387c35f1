"""The engine end to end: oracles (caching on == off, batched == one by one, chunked == whole,
tiny pool == big pool, n>1 sharing), bookkeeping after every run, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_invariants import assert_nothing_leaked

from mini_vllm import LLM, SamplingParams, default_model_path
from mini_vllm.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlocksAllocated,
    BlockStored,
    BlocksFreed,
    ComputedBlocksFound,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    StepFinished,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _prompts_file():
    return json.loads((Path(default_model_path()) / "prompts.json").read_text())


def chat_prompts(llm, count=4, system_index=0):
    """Chat prompts that share one long system prompt (the workload prefix caching is for)."""
    data = _prompts_file()
    system = data["system_prompts"][system_index]
    requests = data["user_requests"][:count]
    return [
        {
            "prompt_token_ids": llm.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": r}]
            )
        }
        for r in requests
    ]


def texts(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=256, device="cpu")


@pytest.fixture(scope="module")
def prompts(llm):
    return chat_prompts(llm)


@pytest.fixture(scope="module")
def reference_outputs(prompts):
    """Greedy outputs one prompt at a time with prefix caching off: the oracle."""
    plain = LLM(num_blocks=256, device="cpu", enable_prefix_caching=False)
    return [texts(plain.generate([p], GREEDY))[0] for p in prompts]


def test_greedy_outputs_equal_with_prefix_caching_on_and_off(llm, prompts, reference_outputs):
    outputs = llm.generate(prompts, GREEDY)
    assert texts(outputs) == reference_outputs
    assert sum(o.num_cached_tokens for o in outputs) > 0  # caching really happened
    assert_nothing_leaked(llm)


def test_batched_equals_one_by_one(llm, prompts, reference_outputs):
    one_by_one = [texts(llm.generate([p], GREEDY))[0] for p in prompts]
    batched = texts(llm.generate(prompts, GREEDY))
    assert batched == one_by_one == reference_outputs
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("chunk", [16, 37, 100])
def test_chunked_prefill_gives_the_same_outputs(prompts, reference_outputs, chunk):
    chunked = LLM(num_blocks=256, device="cpu", max_num_batched_tokens=chunk)
    outputs = chunked.generate(prompts, GREEDY)
    assert texts(outputs) == reference_outputs
    assert max(o.metrics.steps_to_first_token for o in outputs) > 1  # prompts really were chunked
    assert_nothing_leaked(chunked)


def test_tiny_pool_forces_eviction_and_preemption_without_changing_outputs(prompts, reference_outputs):
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    num_blocks = (longest + GREEDY.max_tokens) // 16 + 3  # room for about one request at a time
    tiny = LLM(num_blocks=num_blocks, device="cpu")
    outputs = tiny.generate(prompts + chat_prompts(tiny, 4, system_index=1), GREEDY)
    assert texts(outputs)[: len(prompts)] == reference_outputs
    stats = tiny.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_evictions > 0
    assert_nothing_leaked(tiny)
    # The counters are vLLM 0.33's: one lookup per request, at its first admission; the
    # re-admissions after preemption are counted apart. So the hit rate is exactly what the
    # outputs' num_cached_tokens say (counting every lookup would report hits no request got).
    all_prompts = prompts + chat_prompts(tiny, 4, system_index=1)
    assert stats.prefix_cache_requests == len(outputs)
    assert stats.prefix_cache_hits == sum(o.num_cached_tokens for o in outputs)
    assert stats.prefix_cache_queries == sum(len(p["prompt_token_ids"]) for p in all_prompts)
    assert stats.prefix_cache_preempted_requests > 0


def test_two_identical_long_prompts_in_one_step_hit_blocks_computed_in_that_step(prompts, reference_outputs):
    engine_llm = LLM(num_blocks=256, device="cpu")
    prompt = prompts[0]
    outputs = engine_llm.generate([prompt, prompt], GREEDY)
    assert texts(outputs) == [reference_outputs[0]] * 2
    assert outputs[0].num_cached_tokens == 0
    # The second was admitted in the same step and hit the first one's blocks.
    assert outputs[1].num_cached_tokens == (len(prompt["prompt_token_ids"]) - 1) // 16 * 16
    assert outputs[1].metrics.steps_to_first_token == 1
    assert_nothing_leaked(engine_llm)


def test_n_samples_share_the_prompt_blocks_with_ref_cnt_n(llm, prompts):
    engine = llm.llm_engine
    seen_ref_cnts = []

    def on_event(event):
        if isinstance(event, StepFinished) and event.step == engine.num_steps and not seen_ref_cnts:
            table = engine.kv_cache_manager.req_to_blocks[event.num_scheduled_tokens[0][0]]
            seen_ref_cnts.extend(block.ref_cnt for block in table)

    engine.add_listener(on_event)
    try:
        outputs = llm.generate([prompts[1]], SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=1))
    finally:
        engine.remove_listener(on_event)
    num_full = (len(prompts[1]["prompt_token_ids"]) - 1) // 16
    assert seen_ref_cnts[:num_full] == [3] * num_full  # every full prompt block shared by all 3
    assert len(outputs) == 1 and [c.index for c in outputs[0].outputs] == [0, 1, 2]
    assert_nothing_leaked(llm)


def test_seeded_sampling_is_reproducible(llm, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=7)
    first = texts(llm.generate([prompts[2]], params))
    again = texts(llm.generate([prompts[2], prompts[0]], [params, SamplingParams(temperature=1.0, seed=3)]))[0]
    assert first[0] == again
    other = texts(llm.generate([prompts[2]], SamplingParams(temperature=2.0, max_tokens=8, seed=8)))
    assert other != first


def test_top_k_0_means_no_top_k_as_in_vllm(llm, prompts):
    """vLLM's default top_k is 0, and 0 or -1 both keep every token."""
    outputs = [
        texts(llm.generate([prompts[2]], SamplingParams(temperature=1.5, top_k=top_k, max_tokens=8, seed=11)))
        for top_k in (0, -1, 1)
    ]
    assert outputs[0] == outputs[1] != outputs[2]


def test_stop_conditions(llm, prompts):
    long_run = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(long_run.outputs[0].token_ids) == 3 and long_run.outputs[0].finish_reason == "length"
    assert long_run.outputs[0].stop_reason is None
    text = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].text
    assert len(text) >= 8
    stop_word = text[len(text) // 2 : len(text) // 2 + 3]
    never = "\x00never\x00"
    stopped = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=30, stop=[never, stop_word]))[0]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop_word  # which stop string ended it, as vLLM reports
    assert stop_word not in stopped.outputs[0].text
    assert text.startswith(stopped.outputs[0].text)


def test_stop_strings_late_in_a_long_output_stop_where_a_whole_decode_would(llm, prompts):
    """The stop check decodes only the newest tokens (``stop_string_window``): a stop string that
    appears after many tokens, and one longer than a token, still stop the request at its first
    occurrence, with the text a decode of the whole output cut there."""
    from mini_vllm.llm_engine import find_stop_string, stop_string_window

    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    full = llm.generate([prompts[1]], params)[0].outputs[0]
    for stop in (full.text[-20:-12], full.text[-9:-6], full.text[len(full.text) // 3 :][:14]):
        window = stop_string_window([stop])
        stopped = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, stop=stop))
        out = stopped[0].outputs[0]
        assert out.finish_reason == "stop", (stop, window)
        assert out.text == full.text[: find_stop_string(full.text, [stop])]
        assert out.token_ids == full.token_ids[: len(out.token_ids)]
        assert len(out.token_ids) > window or stop == full.text[len(full.text) // 3 :][:14]


# Byte-level tokens of the bundled tokenizer: "a", " ", then the two bytes of "é" and the three of "日".
A, SPACE, E_ACUTE, JAPANESE_DAY = [67], [223], [130, 105], [165, 248, 101]


def scripted_sampler(monkeypatch, token_ids):
    """The engine samples ``token_ids`` in turn (a model that stops mid-character on demand)."""
    script = iter(token_ids)
    monkeypatch.setattr("mini_vllm.llm_engine.sample", lambda logits, params, generator: next(script))


@pytest.mark.parametrize(
    "token_ids",
    [
        A + SPACE + E_ACUTE + JAPANESE_DAY[:1],  # stops after the first of 日's three bytes
        A + JAPANESE_DAY[:2],  # after two of them
        A + E_ACUTE[:1],
        JAPANESE_DAY[:1],  # nothing complete at all
        JAPANESE_DAY[:1] + A,  # a lone byte followed by text stays "\ufffd", as in vLLM
        A + JAPANESE_DAY + SPACE,
    ],
)
def test_a_generation_that_stops_mid_character_shows_no_replacement_character(llm, monkeypatch, token_ids):
    """As vLLM's incremental detokenizer (tokenizers' DecodeStream): the tokens that only began a
    character are not shown; the token ids still are."""
    from tokenizers.decoders import DecodeStream

    tokenizer = llm.get_tokenizer()
    stream = DecodeStream(skip_special_tokens=True)
    vllm_text = "".join(stream.step(tokenizer._tokenizer, token_id) or "" for token_id in token_ids)
    scripted_sampler(monkeypatch, token_ids)
    params = SamplingParams(temperature=0, max_tokens=len(token_ids))
    [output] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)
    assert output.outputs[0].text == vllm_text
    assert output.outputs[0].token_ids == token_ids
    assert not vllm_text.endswith("\ufffd")


def test_cache_salt_separates_tenants(prompts):
    llm = LLM(num_blocks=256, device="cpu")
    token_ids = prompts[0]["prompt_token_ids"]
    llm.generate([{"prompt_token_ids": token_ids, "cache_salt": "alice"}], GREEDY)
    bob = llm.generate([{"prompt_token_ids": token_ids, "cache_salt": "bob"}], GREEDY)[0]
    alice = llm.generate([{"prompt_token_ids": token_ids, "cache_salt": "alice"}], GREEDY)[0]
    assert bob.num_cached_tokens == 0
    assert alice.num_cached_tokens > 0


def test_events_describe_sharing_caching_and_freeing(prompts):
    llm = LLM(num_blocks=256, device="cpu")
    events = []
    llm.llm_engine.add_listener(events.append)
    llm.generate([prompts[0], prompts[1]], SamplingParams(temperature=0, max_tokens=2))
    kinds = {type(e) for e in events}
    assert {
        RequestAdded,
        ComputedBlocksFound,
        BlocksAllocated,
        BlockStored,
        BlocksFreed,
        RequestFinished,
        StepFinished,
    } <= kinds
    found = [e for e in events if isinstance(e, ComputedBlocksFound)]
    assert found[0].block_ids == () and len(found[1].block_ids) > 0  # the second hit the shared system prompt
    cached_ids = {block_id for e in events if isinstance(e, BlockStored) for block_id in e.block_ids}
    assert set(found[1].block_ids) <= cached_ids
    llm.llm_engine.remove_listener(events.append)
    count = len(events)
    llm.generate([prompts[2]], GREEDY)
    assert len(events) == count  # a removed listener hears nothing


def test_events_report_preemption_and_eviction(prompts):
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    tiny = LLM(num_blocks=(longest + 12) // 16 + 3, device="cpu")
    events = []
    tiny.llm_engine.add_listener(events.append)
    tiny.generate(prompts + chat_prompts(tiny, 4, system_index=1), GREEDY)
    assert any(isinstance(e, RequestPreempted) for e in events)
    assert any(isinstance(e, BlockRemoved) for e in events)


def test_reset_prefix_cache_reaches_listeners(prompts):
    llm = LLM(num_blocks=256, device="cpu")
    events = []
    llm.llm_engine.add_listener(events.append)
    llm.generate([prompts[0]], GREEDY)
    assert llm.llm_engine.reset_prefix_cache() is True
    assert isinstance(events[-1], AllBlocksCleared)


BAD_PROMPTS = [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, -5, 2]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1, 10**9]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1, 2.5]}, "must be an int, got float"),
    ({"prompt_token_ids": [1] * 5000}, "max_model_len"),
    ({"prompt_token_ids": [1, 2], "cache_salt": 42}, "cache_salt"),
    ({"prompt_token_ids": [1, 2], "salt": "x"}, "unknown prompt keys"),
    (12, "must be a str or a dict"),
    ("a \ud800 b", "not valid Unicode text: character 2 is a lone surrogate"),
    ({"prompt": "\udfff"}, "lone surrogate"),
]


@pytest.mark.parametrize("bad,message", BAD_PROMPTS)
def test_bad_prompts_raise_value_error_and_the_engine_keeps_serving(llm, prompts, reference_outputs, bad, message):
    with pytest.raises((ValueError, TypeError), match=message):  # TypeError for a wrong type
        llm.generate([prompts[0], bad], GREEDY)
    assert_nothing_leaked(llm)
    assert texts(llm.generate([prompts[0]], GREEDY)) == [reference_outputs[0]]


@pytest.mark.parametrize("prompt_len", [20, 30, 31])
def test_max_model_len_counts_prompt_and_output_as_vllm_does(prompt_len):
    """vLLM's check_stop ends a request at num_tokens >= max_model_len: prompt + output never exceed it.
    A max_tokens above max_model_len is capped, not refused, as vLLM's offline LLM does (its server refuses it)."""
    llm = LLM(device="cpu", max_model_len=32, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": list(range(10, 10 + prompt_len))}], params)[0]
    assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == 32
    assert output.outputs[0].finish_reason == "length"


def test_max_tokens_none_generates_up_to_max_model_len_as_vllm_does():
    """vLLM's input processor: an unset max_tokens is max_model_len - prompt length; the pool check counts it."""
    llm = LLM(device="cpu", max_model_len=32, block_size=16, num_blocks=8)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": list(range(10, 22))}], params)[0]
    assert len(output.outputs[0].token_ids) == 32 - 12 and output.outputs[0].finish_reason == "length"
    small = LLM(device="cpu", max_model_len=64, block_size=16, num_blocks=2)
    with pytest.raises(ValueError, match=r"max_tokens \(None: up to max_model_len, 52\) needs 4 KV-cache blocks"):
        small.generate([{"prompt_token_ids": list(range(10, 22))}], params)
    assert len(small.generate([{"prompt_token_ids": list(range(10, 22))}], SamplingParams(max_tokens=8))) == 1


def test_a_prompt_of_max_model_len_tokens_leaves_no_room_and_is_refused():
    """As vLLM 0.33's input processor: "plus the number of requested output tokens (at least 1) is longer"."""
    llm = LLM(device="cpu", max_model_len=32, block_size=16)
    with pytest.raises(ValueError, match="with at least one output token that is longer than max_model_len=32"):
        llm.generate([{"prompt_token_ids": list(range(10, 42))}], GREEDY)
    assert_nothing_leaked(llm)


def test_a_request_larger_than_the_pool_is_rejected_up_front():
    small = LLM(num_blocks=4, device="cpu")
    with pytest.raises(ValueError, match="KV-cache blocks"):
        small.generate([{"prompt_token_ids": list(range(1, 60))}], GREEDY)
    assert_nothing_leaked(small)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n must"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):  # TypeError for a wrong type
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": -1}, "num_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"dtype": "int8"}, "dtype"),
        ({"attention_backend": "flash"}, "attention_backend"),
    ],
)
def test_invalid_engine_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(device="cpu", **kwargs)


def test_greedy_generation_equals_transformers_generate(llm, prompts, reference_outputs):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    for prompt, expected in zip(prompts[:2], reference_outputs[:2]):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        generated = hf.generate(
            ids, max_new_tokens=GREEDY.max_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
        )
        hf_tokens = generated[0, ids.shape[1] :].tolist()
        # transformers stops at EOS too; compare up to where either stopped.
        assert hf_tokens[: len(expected)] == expected[: len(hf_tokens)]
        assert len(expected) > 0


def test_chat_applies_the_template_and_reports_cached_tokens(llm):
    data = _prompts_file()
    system = {"role": "system", "content": data["system_prompts"][0]}
    first = llm.chat([system, {"role": "user", "content": data["user_requests"][0]}], GREEDY)[0]
    second = llm.chat([system, {"role": "user", "content": data["user_requests"][1]}], GREEDY)[0]
    assert second.num_cached_tokens >= 16 * 4
    assert first.outputs[0].text


def test_generate_returns_only_its_own_requests_when_others_are_queued(llm, prompts, reference_outputs):
    engine = llm.llm_engine
    engine.add_request("queued-elsewhere", prompts[1]["prompt_token_ids"], GREEDY)
    engine.step()
    outputs = llm.generate([prompts[0]], GREEDY)
    assert [o.request_id for o in outputs] == [outputs[0].request_id] and texts(outputs) == [reference_outputs[0]]
    while engine.has_unfinished_requests():  # the other request is still served
        engine.step()
    assert_nothing_leaked(llm)


def test_llm_reset_prefix_cache_forgets_hits(prompts):
    llm = LLM(num_blocks=64, device="cpu")
    llm.generate([prompts[0]], GREEDY)
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompts[0]], GREEDY)[0].num_cached_tokens == 0


def test_generate_ids_never_collide_with_an_id_already_queued(prompts, reference_outputs):
    llm = LLM(num_blocks=64, device="cpu")
    engine = llm.llm_engine
    finished = []
    engine.add_listener(lambda event: isinstance(event, RequestFinished) and finished.append(event))
    engine.add_request("0-1", prompts[0]["prompt_token_ids"], GREEDY)  # the id of the first call's second prompt
    outputs = llm.generate([prompts[1], prompts[2]], GREEDY)
    assert [o.request_id for o in outputs] == ["1-0", "1-1"]  # batch 0's ids were taken: the next batch's
    assert texts(outputs) == reference_outputs[1:3]
    while engine.has_unfinished_requests():
        engine.step()
    # The user's request was served along (generate steps the whole engine), never aborted.
    assert [(e.request_id, e.finish_reason) for e in finished if e.request_id == "0-1"] == [("0-1", "length")]
    assert_nothing_leaked(llm)


def test_max_model_len_past_the_models_positions_is_refused_as_vllm_does():
    """vLLM refuses a max_model_len longer than the model was trained for; it was silently lowered."""
    limit = LLM(device="cpu", num_blocks=8).llm_engine.model_config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_model_len={limit + 1} is longer than this model's {limit} positions"):
        LLM(device="cpu", num_blocks=8, max_model_len=limit + 1)
    assert LLM(device="cpu", num_blocks=8, max_model_len=limit).llm_engine.max_model_len == limit


def test_leaked_blocks_stop_the_engine_with_an_error_not_an_endless_loop():
    """Blocks that never come back (a learner's free_blocks that loses some) leave a request that can
    never be admitted; LLM.generate used to step forever. The scheduler says why, and nothing is left queued."""
    llm = LLM(device="cpu", num_blocks=16, block_size=16)
    engine = llm.llm_engine
    pool = engine.kv_cache_manager.block_pool
    leaked = pool.get_new_blocks(14)  # held by no request, never freed
    with pytest.raises(RuntimeError, match=r"cannot make progress.*14 of the pool's 16 blocks are in use.*leaked"):
        llm.generate({"prompt_token_ids": list(range(1, 60))}, SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()  # generate's own requests were taken back
    pool.free_blocks(leaked)
    out = llm.generate({"prompt_token_ids": list(range(1, 60))}, SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4  # the same engine serves again once the blocks are back
    assert_nothing_leaked(engine)


def test_a_schedule_waiting_that_admits_nothing_is_named():
    from mini_vllm.engine_parts import EngineParts

    llm = LLM(device="cpu", num_blocks=16, parts=EngineParts(schedule_waiting=lambda scheduler, budget, output: budget))
    with pytest.raises(RuntimeError, match="Every block is free, so schedule_waiting admitted nothing"):
        llm.generate("Once upon a time", SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()
