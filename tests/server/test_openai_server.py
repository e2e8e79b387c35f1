"""The OpenAI-compatible server (``python -m mini_vllm serve``), through the official ``openai`` client.

Most tests run the server in this process (``BackgroundServer``: uvicorn and the
engine loop in threads) so they can look at the engine afterwards: nothing
leaked, requests batched together. One test starts it as a user does, as a
subprocess from the command line, and stops it with SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import APIStatusError, OpenAI

from engine_invariants import assert_nothing_leaked
from mini_vllm import LLM
from mini_vllm.tools.compare_servers import ServerSpec, free_port, start_mini_server
from mini_vllm.entrypoints.openai.api_server import BackgroundServer
from mini_vllm.events import StepFinished
from mini_vllm.model import default_model_path

MODEL = "mini-vllm"
SYSTEM = {
    "role": "system",
    "content": "You are Pip, a friendly storyteller for young children. Write three short sentences. " * 4,
}


def chat(client, user: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[SYSTEM, {"role": "user", "content": user}], max_tokens=kwargs.pop("max_tokens", 12),
        temperature=kwargs.pop("temperature", 0), **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def served():
    llm = LLM(device="cpu", block_size=32, num_blocks=96, max_model_len=1024)
    with BackgroundServer(llm, served_model_name=MODEL) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield llm, server, client


def wait_idle(llm: LLM, timeout: float = 30) -> None:
    """The engine thread frees an aborted request's blocks before its next step: wait for it."""
    deadline = time.monotonic() + timeout
    while llm.llm_engine.requests and time.monotonic() < deadline:
        time.sleep(0.05)


def test_cached_tokens_as_users_see_them(served):
    llm, server, client = served
    first = chat(client, "Tell me a story about a cat.")
    second = chat(client, "Tell me a story about a dog.")
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # 0 on a miss, not null
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 32 == 0 and cached < second.usage.prompt_tokens
    assert second.usage.total_tokens == second.usage.prompt_tokens + second.usage.completion_tokens
    salted = chat(client, "Tell me a story about a dog.", extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    again = chat(client, "Tell me a story about a dog.", extra_body={"cache_salt": "tenant-b"})
    # Its own blocks: every full block but the one holding the last prompt token (the last-block rule).
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 32 * 32
    assert again.choices[0].message.content == second.choices[0].message.content  # the salt changes nothing else


def test_the_same_answer_as_llm_chat_and_generate(served):
    llm, server, client = served
    reference = LLM(device="cpu", block_size=32)
    from mini_vllm import SamplingParams

    messages = [SYSTEM, {"role": "user", "content": "A story about a fox."}]
    expected = reference.chat(messages, SamplingParams(temperature=0, max_tokens=15))[0]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, temperature=0)
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    expected = reference.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=10))[0]
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert reply.choices[0].text == expected.outputs[0].text


def test_streaming_gives_the_same_text_and_usage_last(served):
    llm, server, client = served
    for stop in (None, [".", "!"]):
        whole = chat(client, "A story about a bear.", max_tokens=30, stop=stop)
        chunks = list(
            chat(
                client,
                "A story about a bear.",
                max_tokens=30,
                stop=stop,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            whole.choices[0].finish_reason
        ]
        ending = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
        assert ending[0].stop_reason == whole.choices[0].stop_reason  # vLLM's field: the stop string, or None
        if stop:
            assert not any(s in text for s in stop) and whole.choices[0].finish_reason == "stop"
            assert whole.choices[0].stop_reason in stop
        else:
            assert whole.choices[0].stop_reason is None
    assert chat(client, "A story about a bear.", extra_body={"top_k": 0}).choices  # 0 means no top-k, as in vLLM
    no_usage = list(chat(client, "A story about a bear.", stream=True))
    assert all(getattr(c, "usage", None) is None for c in no_usage)


def test_a_completion_that_stops_mid_character_ends_without_a_replacement_character(served, monkeypatch):
    """Streamed or whole, the text leaves out the bytes of a character the last tokens only began (vLLM's
    incremental detokenizer); the completion tokens still count them."""
    llm, server, client = served
    a, space, e_acute, japanese_day = [67], [223], [130, 105], [165, 248, 101]  # byte-level tokens
    token_ids = a + space + e_acute + japanese_day[:2]
    for stream in (False, True):
        script = iter(token_ids)
        monkeypatch.setattr("mini_vllm.llm_engine.sample", lambda logits, params, generator: next(script))
        reply = client.completions.create(
            model=MODEL, prompt=[5, 6, 7], max_tokens=len(token_ids), stream=stream,
            stream_options={"include_usage": True} if stream else None,
        )  # fmt: skip
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert chunks[-1].usage.completion_tokens == len(token_ids)
        else:
            text = reply.choices[0].text
            assert reply.usage.completion_tokens == len(token_ids)
        assert text == "a \u00e9", (stream, text)
    wait_idle(llm)


def test_completions_batch_n_and_token_ids(served):
    llm, server, client = served
    reply = client.completions.create(
        model=MODEL, prompt=["Once upon a time", "The farm was"], max_tokens=6, temperature=0.8, seed=7, n=2
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.choices[0].text != reply.choices[1].text or reply.choices[2].text != reply.choices[3].text
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_concurrent_clients_share_engine_steps(served):
    """Continuous batching across HTTP requests: 16 clients at once, steps that hold several of them."""
    llm, server, client = served
    batch_sizes: list[int] = []
    lock = threading.Lock()

    def listener(event):
        if isinstance(event, StepFinished):
            with lock:
                batch_sizes.append(len(event.num_scheduled_tokens))

    llm.llm_engine.add_listener(listener)
    try:
        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda i: chat(client, f"Story number {i}.", max_tokens=16), range(16)))
    finally:
        llm.llm_engine.remove_listener(listener)
    assert len(replies) == 16 and all(r.choices[0].message.content for r in replies)
    assert max(batch_sizes) >= 4, batch_sizes
    assert len(batch_sizes) < 16 * 16  # fewer steps than one request at a time would need
    wait_idle(llm)
    assert_nothing_leaked(llm.llm_engine)


BAD = [
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3.5}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": True}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_salt": 5}, 400, "cache_salt"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_salt": ""}, 400, "cache_salt"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "a/b"}, 400, "cache_salt"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "x" * 129}, 400, "cache_salt"),
    ({"messages": [{"role": "user", "content": "story " * 1100}]}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}, 400, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [3]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),  # vLLM: 4
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**63}, 400, "seed"),  # vLLM's seed is an int64
    ({"messages": [{"role": "user", "content": "hi"}], "seed": -(2**63) - 1}, 400, "seed"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": -2}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 1.5}, 400, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 5}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": True}, 400, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 3}, 400, "min_tokens"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, 400, "continue_final_message"),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        },
        400,
        "stream_options.continuous_usage_stats",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": [5]}, 400, "allowed_token_ids"),
    ({"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True}, 400, "use_beam_search"),
    ({"messages": [{"role": "user", "content": "hi"}], "length_penalty": 2.0}, 400, "length_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "priority": 5}, 400, "priority"),
    ({"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True}, 400, "return_token_ids"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "return_tokens_as_token_ids": True},
        400,
        "return_tokens_as_token_ids",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}, 400, "add_special_tokens"),
    # A template sent with the request runs on the renderer thread: refused unless trusted (vLLM's flag).
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"}, 400, "chat_template"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
        400,
        "chat_template",
    ),
    ({"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_requests_name_the_field_and_leave_nothing_behind(served, body, status, param):
    llm, server, client = served
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param and error["message"], error
    assert_nothing_leaked(llm.llm_engine)
    assert chat(client, "hi", max_tokens=2).choices[0].message.content is not None  # still serving


def test_an_assistant_message_may_have_null_or_no_content_as_in_openai_and_vllm(served):
    """vLLM renders such a message with empty content, as an assistant message whose content is ""."""
    llm, server, client = served
    answers = []
    for assistant in (
        {"role": "assistant", "content": None},
        {"role": "assistant"},
        {"role": "assistant", "content": ""},
    ):
        messages = [{"role": "user", "content": "hi"}, assistant, {"role": "user", "content": "Tell me a story."}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        answers.append((reply.usage.prompt_tokens, reply.choices[0].message.content))
    assert answers[0] == answers[1] == answers[2]


def test_an_explicit_null_means_the_default_where_vllm_declares_the_field_optional(served):
    """vLLM's models declare ``stream`` (both endpoints) and chat's ``n`` ``Optional``: null is the default there;
    ``n`` of completions and ``ignore_eos`` are not Optional in vLLM, and null stays a 400."""
    llm, server, client = served
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    completion_body = {"model": MODEL, "prompt": "once", "max_tokens": 2}
    for path, body, status in (
        ("/v1/chat/completions", {**chat_body, "stream": None}, 200),
        ("/v1/chat/completions", {**chat_body, "n": None}, 200),
        ("/v1/completions", {**completion_body, "stream": None}, 200),
        ("/v1/completions", {**completion_body, "n": None}, 400),
        ("/v1/chat/completions", {**chat_body, "ignore_eos": None}, 400),
    ):
        response = httpx.post(server.url + path, json=body, timeout=60)
        assert response.status_code == status, (body, response.text)
        if status == 200:
            assert len(response.json()["choices"]) == 1  # a whole answer (not a stream), one choice
    assert_nothing_leaked(llm.llm_engine)


def test_chat_template_kwargs_that_the_server_sets_itself_are_overridden_as_vllm_does(served):
    """vLLM merges the request's add_generation_prompt / continue_final_message over chat_template_kwargs, and
    a tokenize there changes only whether the template returns text or ids: the same prompt, a 200 (was
    Python's "got multiple values for keyword argument")."""
    llm, server, client = served
    plain = chat(client, "hi", max_tokens=3)
    for kwargs in ({"add_generation_prompt": False}, {"continue_final_message": True}, {"tokenize": True}):
        reply = chat(client, "hi", max_tokens=3, extra_body={"chat_template_kwargs": kwargs})
        assert reply.usage.prompt_tokens == plain.usage.prompt_tokens, kwargs
        assert reply.choices[0].message.content == plain.choices[0].message.content
    assert_nothing_leaked(llm.llm_engine)


def test_a_number_field_of_the_wrong_type_is_said_to_need_a_number(served):
    llm, server, client = served
    for field, value in (("temperature", "hot"), ("top_p", True), ("temperature", [1])):
        body = {"messages": [{"role": "user", "content": "hi"}], field: value}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == field, response.text
        assert error["message"].startswith(f"{field}: Input should be a valid number"), error
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=1, top_p=1, seed=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length")  # ints are numbers


def test_whole_number_floats_are_integers_as_vllm_takes_them(served):
    """Python's json writes 3.0 for a float; vLLM's pydantic models take it as 3 (3.5 is a 400 above)."""
    llm, server, client = served
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 3, "seed": 1}, timeout=60)
    for floats in ({"max_tokens": 3.0, "seed": 1.0}, {"max_completion_tokens": 3.0, "n": 1.0, "top_k": 0.0}):
        response = httpx.post(server.url + "/v1/chat/completions", json={**body, **floats}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"] == whole.json()["choices"][0]["message"]
        assert response.json()["usage"]["completion_tokens"] == 3
    response = httpx.post(
        server.url + "/v1/completions", json={"prompt": [5.0, 6.0, 7.0], "max_tokens": 2.0, "temperature": 0}
    )
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 3, response.text


def test_bad_json_and_bad_completion_prompts(served):
    llm, server, client = served
    response = httpx.post(
        server.url + "/v1/completions", content=b'{"prompt": "x"', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    for prompt, param in (([], "prompt"), ("", "prompt"), ([10**9], "prompt"), ([["a"]], "prompt")):
        response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert response.status_code == 400, (prompt, response.text)
        assert response.json()["error"]["message"]
    # A batch whose second prompt is bad queues nothing of the first either.
    response = httpx.post(server.url + "/v1/completions", json={"prompt": [[1, 2, 3], [10**9]], "max_tokens": 2})
    error = response.json()["error"]
    assert response.status_code == 400 and "outside the vocabulary" in error["message"]
    assert error["message"].startswith("prompt 1: ") and error["param"] == "prompt"  # the second prompt, named
    # A body not sent as JSON: vLLM's words (its validate_json_request), on both endpoints.
    for path in ("/v1/completions", "/v1/chat/completions"):
        for headers in ({"content-type": "text/plain"}, {}):
            response = httpx.post(server.url + path, content=b'{"prompt": "x"}', headers=headers)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["message"] == "Unsupported Media Type: Only 'application/json' is allowed"
    reply = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": "x", "max_tokens": 1}',
        headers={"content-type": "Application/JSON; charset=utf-8"},
    )
    assert reply.status_code == 200, reply.text
    # FastAPI's own parse failure (a body that is not UTF-8) gets the OpenAI error body too.
    response = httpx.post(
        server.url + "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "could not be parsed" in response.json()["error"]["message"]
    wait_idle(llm)
    assert_nothing_leaked(llm.llm_engine)
    with pytest.raises(APIStatusError) as raised:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=21)
    assert raised.value.status_code == 400 and "greater than max allowed: 20" in raised.value.message


def test_neutral_values_of_fields_the_server_does_not_implement_are_accepted(served):
    """What clients send when they do not use a feature (penalties 0, tool_choice "none", a text response
    format) changes nothing, so it is served; only a value that asks for the feature is refused."""
    llm, server, client = served
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        frequency_penalty=0, presence_penalty=0.0, tool_choice="none", response_format={"type": "text"},
        top_logprobs=0, stop=["x1", "x2", "x3", "x4"], seed=2**63 - 1,
    )  # fmt: skip
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, stop=["x1"]
    )
    assert reply.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(APIStatusError) as raised:
        client.completions.create(model=MODEL, prompt="once", max_tokens=2, suffix="the end")
    assert raised.value.status_code == 400 and raised.value.body["param"] == "suffix"
    # Each endpoint's own add_special_tokens default is neutral; the other value is refused.
    same = client.completions.create(model=MODEL, prompt="once", max_tokens=2, temperature=0)
    for value, status in ((True, 200), (False, 400)):
        response = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "once", "max_tokens": 2, "temperature": 0, "add_special_tokens": value},
        )
        assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == "add_special_tokens"
    reply = chat(client, "hi", max_tokens=3, extra_body={"add_special_tokens": False, "length_penalty": 1.0})
    assert reply.choices[0].message.content == chat(client, "hi", max_tokens=3).choices[0].message.content
    assert same.choices[0].text


def test_a_request_chat_template_is_used_only_when_the_server_trusts_it():
    """vLLM's --trust-request-chat-template: the template a request sends renders its prompt."""
    llm = LLM(device="cpu", num_blocks=32)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    content = "Once upon a time"
    with BackgroundServer(llm, served_model_name=MODEL, trust_request_chat_template=True) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for extra in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2, temperature=0,
                extra_body=extra,
            )  # fmt: skip
            assert reply.usage.prompt_tokens == len(llm.get_tokenizer().encode(content, add_special_tokens=False))
        plain = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2, temperature=0
        )
        assert plain.usage.prompt_tokens > reply.usage.prompt_tokens  # the model's own template, with its headers


def test_max_tokens_past_the_context_is_capped_and_completions_default_to_16(served):
    """As vLLM's get_max_tokens: max_tokens is capped at the rest of max_model_len (1024 here), not refused;
    /v1/completions without max_tokens generates 16 tokens (vLLM's and OpenAI's default), chat the rest.
    A max_tokens greater than max_model_len itself is a 400, in vLLM's words (its TokenizeParams check)."""
    llm, server, client = served
    prompt = list(range(100, 1100))  # 1000 tokens: room for 24
    for max_tokens in (100, 1024):
        capped = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
        assert capped.usage.completion_tokens == 24 and capped.choices[0].finish_reason == "length"
    for field, create in (
        ("max_tokens", lambda **kw: client.completions.create(model=MODEL, prompt="Once", **kw)),
        ("max_tokens", lambda **kw: chat(client, "hi", **kw)),
        ("max_completion_tokens", lambda **kw: chat(client, "hi", **kw)),
    ):
        with pytest.raises(APIStatusError) as raised:
            create(**{field: 1025})
        assert raised.value.status_code == 400 and raised.value.body["param"] == field
        assert raised.value.body["message"] == (
            f"{field}=1025 cannot be greater than max_model_len=1024. Please request fewer output tokens."
        )
    default = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16
    with pytest.raises(APIStatusError) as raised:  # no room for one output token
        client.completions.create(model=MODEL, prompt=list(range(100, 1124)), max_tokens=1)
    assert raised.value.status_code == 400 and raised.value.body["param"] == "prompt"
    wait_idle(llm)
    assert_nothing_leaked(llm.llm_engine)


def test_a_prompt_that_is_not_valid_text_is_a_400_and_the_connection_stays_usable(served):
    """A lone surrogate (a JSON "\\ud800" escape) cannot be tokenized: a 400 naming the prompt, not a
    500 that closes the keep-alive connection under the next request."""
    llm, server, client = served
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = (
            b'{"model": "mini-vllm", "prompt": "a \\ud800 b", "max_tokens": 2}'  # JSON's escape, as a client sends it
        )
        response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prompt" and "lone surrogate" in error["message"]
        again = http.post("/v1/completions", json={"model": MODEL, "prompt": "once upon", "max_tokens": 2})
        assert again.status_code == 200, again.text
    assert_nothing_leaked(llm.llm_engine)


def test_a_huge_prompt_is_refused_before_it_is_tokenized_and_prompts_are_tokenized_off_the_engine_thread(
    served, monkeypatch
):
    """vLLM's _text_len_check: a text longer than max_model_len times the longest token is refused at once
    (tokenizing 4 MB took seconds on the engine's thread, and every other client's stream stopped meanwhile)."""
    llm, server, client = served
    huge = "the cat sat on the mat. " * (4_000_000 // 24)
    bound = 1024 * max(len(token) for token in llm.get_tokenizer().get_vocab())
    for path, body, param in (
        ("/v1/completions", {"prompt": huge}, "prompt"),
        ("/v1/completions", {"prompt": ["once", huge]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
    ):
        started = time.monotonic()
        response = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
        assert time.monotonic() - started < 1.0
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param, response.text
        assert (
            f"characters (more than {bound} characters, which is the upper bound for 1024 input tokens)"
            in (error["message"])
        )
    tokenizer = llm.get_tokenizer()
    threads = []
    real_encode = tokenizer.encode

    def recording_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording_encode)
    assert client.completions.create(model=MODEL, prompt="once upon", max_tokens=2).choices[0].text is not None
    assert chat(client, "hi", max_tokens=2).choices[0].message.content is not None
    assert len(threads) == 2 and "mini-vllm-engine" not in threads, threads
    assert_nothing_leaked(llm.llm_engine)


def test_a_pool_smaller_than_max_model_len_serves_what_it_holds():
    """A request without max_tokens gets the rest of the context; with a pool of 8 blocks of 16 tokens
    the server serves max_model_len = 129 (128 slots: the last sampled token needs none; vLLM would refuse to
    start) instead of refusing every such request."""
    llm = LLM(device="cpu", block_size=16, num_blocks=8, max_model_len=2048)
    with BackgroundServer(llm, served_model_name=MODEL) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert client.models.list().data[0].model_extra["max_model_len"] == 129
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= 129
        wait_idle(llm)
        assert_nothing_leaked(llm.llm_engine)


def test_several_served_model_names_are_all_accepted_and_the_first_is_reported():
    """vLLM's --served-model-name takes several names: any of them may be sent; responses, /v1/models'
    first entry and /metrics' model_name report the first."""
    from mini_vllm.entrypoints.openai.cli_args import make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser())
    assert parser.parse_args(["m", "--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    llm = LLM(device="cpu", num_blocks=32)
    with BackgroundServer(llm, served_model_name=["first", "second"]) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [model.id for model in client.models.list().data] == ["first", "second"]
        for name in ("first", "second"):
            reply = client.completions.create(model=name, prompt="Once", max_tokens=2)
            assert reply.model == "first"
        with pytest.raises(APIStatusError) as raised:
            client.completions.create(model="third", prompt="Once", max_tokens=2)
        assert raised.value.status_code == 404 and raised.value.body["param"] == "model"
        assert 'model_name="first"' in httpx.get(server.url + "/metrics").text


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(served):
    llm, server, client = served
    body = {
        "model": MODEL,
        "messages": [SYSTEM, {"role": "user", "content": "A very long story."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in received)
    wait_idle(llm)
    assert not llm.llm_engine.requests
    assert_nothing_leaked(llm.llm_engine)


def test_a_failing_request_gets_a_500_alone(served, monkeypatch):
    llm, server, client = served
    runner = llm.llm_engine.model_runner
    original = runner.execute_model
    calls = {"n": 0}

    def fail_once(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return original(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", fail_once)
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=60,
    )
    assert response.status_code == 500 and response.json()["error"]["message"]
    assert chat(client, "hello", max_tokens=3).choices[0].message.content is not None
    wait_idle(llm)
    assert_nothing_leaked(llm.llm_engine)


def test_metrics_are_current_when_a_request_ends(served, monkeypatch):
    """A client that reads /metrics as soon as its answer is complete must not see its request running
    (the engine's figures were refreshed after the last delta was published: a race, seen 6 times in 40)."""
    from mini_vllm.entrypoints.async_llm import StreamDelta

    llm, server, client = served
    engine = server.app.state.engine
    running_when_finished = []
    real_init = StreamDelta.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if self.finished:
            running_when_finished.append(engine.stats.num_running)

    monkeypatch.setattr(StreamDelta, "__init__", recording_init)
    chat(client, "A story about a hen.")
    assert running_when_finished == [0]


def metric_values(server) -> dict[str, float]:
    """/metrics as {"vllm:prompt_tokens_total": ..., 'vllm:request_success_total{finished_reason="stop"}': ...}."""
    values = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            reason = name.split('finished_reason="')[1].split('"')[0] if "finished_reason" in name else None
            values[name.split("{")[0] + (f"{{{reason}}}" if reason else "")] = float(value)
    return values


def test_metrics_count_prompt_tokens_at_prefill_and_not_aborts_or_refused_batches(served):
    """As vLLM: a prompt's tokens count once its prefill is done (an aborted request's too); a request the
    client abandons is not a finished request (vLLM's abort_requests records none); a batch refused with a
    400 queues nothing, so none of its prompts is counted."""
    llm, server, client = served
    before = metric_values(server)
    assert before["vllm:request_success_total{abort}"] == 0 and "vllm:request_success_total{repetition}" in before
    body = {"model": MODEL, "prompt": [200 + i for i in range(70)], "max_tokens": 900, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        lines = stream.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        running = metric_values(server)
    assert running["vllm:prompt_tokens_total"] == before["vllm:prompt_tokens_total"] + 70
    wait_idle(llm)
    after = metric_values(server)
    assert after["vllm:prompt_tokens_total"] == before["vllm:prompt_tokens_total"] + 70
    reasons = [name for name in after if name.startswith("vllm:request_success_total")]
    assert all(after[name] == before[name] for name in reasons), (before, after)
    refused = {"model": MODEL, "prompt": [[5, 6, 7] * 100, [8] * 10, [10**7]], "max_tokens": 500, "ignore_eos": True}
    for _ in range(3):
        assert httpx.post(server.url + "/v1/completions", json=refused, timeout=60).status_code == 400
    time.sleep(0.5)
    assert metric_values(server) == after
    assert_nothing_leaked(llm.llm_engine)


def test_models_health_metrics_and_reset(served):
    llm, server, client = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    chat(client, "A story about an owl.")
    chat(client, "A story about an owl.")
    metrics = httpx.get(server.url + "/metrics").text
    values = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:")}
    stats = llm.llm_engine.get_stats()
    assert values["vllm:prefix_cache_queries_total"] == stats.prefix_cache_queries
    assert values["vllm:prefix_cache_hits_total"] == stats.prefix_cache_hits > 0
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
    response = httpx.post(server.url + "/reset_prefix_cache")
    assert response.status_code == 200 and response.json() == {"success": True}
    assert chat(client, "A story about an owl.").usage.prompt_tokens_details.cached_tokens == 0


def test_tokenize_gives_the_tokens_a_request_would_queue_and_detokenize_gives_the_text_back(served):
    llm, server, client = served
    url = server.url
    tokenizer = llm.get_tokenizer()
    text = "Once upon a time, a fox"
    answer = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert answer["count"] == len(answer["tokens"]) and answer["token_strs"] is None
    assert answer["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    completion = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert answer["count"] == completion.usage.prompt_tokens
    # messages: the chat template's tokens, as many as a chat request reports.
    messages = [SYSTEM, {"role": "user", "content": "Tell me a story about a hen."}]
    chat_tokens = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert chat_tokens["tokens"] == llm.apply_chat_template(messages)
    assert chat_tokens["count"] == chat(client, "Tell me a story about a hen.").usage.prompt_tokens
    no_header = httpx.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert 0 < no_header["count"] < chat_tokens["count"]
    assert chat_tokens["tokens"][: no_header["count"]] == no_header["tokens"]  # only the assistant header differs
    with_strs = httpx.post(url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(with_strs["tokens"])
    # No length limit: counting a long text is what /tokenize is for (vLLM's has none either).
    long_text = "story " * 3000
    assert httpx.post(url + "/tokenize", json={"prompt": long_text}).json()["count"] > 1024
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": tokenizer.encode(text)})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(tokenizer.encode(text))}
    bad = {
        "/tokenize": [
            ({"prompt": text, "messages": messages}, None),
            ({}, None),
            ({"prompt": 5}, "prompt"),
            ({"messages": []}, "messages"),
            ({"messages": messages, "continue_final_message": True}, None),
            (b'{"prompt": "\\ud800"}', "prompt"),  # a lone surrogate: not text
            (b'{"messages": [{"role": "user", "content": "a\\udc00"}]}', "messages"),  # it was a 500
            ({"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ],
        "/detokenize": [
            ({"tokens": [1, 10**9]}, "tokens"),
            ({"tokens": [-1]}, "tokens.0"),
            ({"tokens": "1 2"}, "tokens"),
        ],
    }
    for route, cases in bad.items():
        for body, param in cases:
            if isinstance(body, bytes):
                response = httpx.post(url + route, content=body, headers={"content-type": "application/json"})
            else:
                response = httpx.post(url + route, json=body)
            assert response.status_code == 400, (route, body, response.text)
            error = response.json()["error"]
            assert error["message"] and error["param"] == param, (route, body, error)
    refused = httpx.post(url + "/tokenize", json={"messages": messages, "continue_final_message": True}).json()
    assert refused["error"]["message"].startswith("Cannot set both `continue_final_message`")  # no pydantic prefix
    surrogate = b'{"model": "mini-vllm", "messages": [{"role": "user", "content": "a\\udc00"}], "max_tokens": 2}'
    response = httpx.post(url + "/v1/chat/completions", content=surrogate, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "lone surrogate" in response.json()["error"]["message"], response.text
    assert (
        "outside the vocabulary" in httpx.post(url + "/detokenize", json={"tokens": [10**9]}).json()["error"]["message"]
    )
    assert httpx.post(url + "/tokenize", json={"model": "gpt-4", "prompt": text}).status_code == 404
    wait_idle(llm)
    assert_nothing_leaked(llm.llm_engine)


def test_ping_and_version_as_vllm_has_them(served):
    llm, server, client = served
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    version = httpx.get(server.url + "/version").json()["version"]
    assert version and version[0].isdigit()


def test_reset_prefix_cache_while_a_request_runs_answers_as_vllm_and_can_preempt_it(served):
    """vLLM: always a 200 with {"success": bool}; ?reset_running_requests=true preempts the running requests
    (they are recomputed from the waiting queue), so the reset succeeds and the answer is unchanged."""
    llm, server, client = served
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    expected = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    texts = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                break  # the request runs now, holding blocks
        response = httpx.post(server.url + "/reset_prefix_cache")
        assert response.status_code == 200 and response.json() == {"success": False}, response.text
        response = httpx.post(server.url + "/reset_prefix_cache?reset_running_requests=true")
        assert response.status_code == 200 and response.json() == {"success": True}, response.text
        for line in lines:
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(texts) == expected
    wait_idle(llm)
    assert_nothing_leaked(llm.llm_engine)


def test_make_serve_from_the_command_line(tmp_path):
    """``python -m mini_vllm serve`` as a user starts it; SIGTERM stops it cleanly."""
    spec = ServerSpec(str(default_model_path()), block_size=16, num_blocks=64, max_model_len=512)
    with start_mini_server(spec, tmp_path) as server:
        server.wait_ready(timeout=120)
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="mini-vllm-course", messages=[SYSTEM, {"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
        again = client.chat.completions.create(
            model="mini-vllm-course", messages=[SYSTEM, {"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert again.usage.prompt_tokens_details.cached_tokens % 16 == 0
        assert again.usage.prompt_tokens_details.cached_tokens > 0
    # uvicorn shuts down gracefully, then re-raises the signal it caught: exit status -SIGTERM, no traceback.
    log = server.log_path.read_text()
    assert server.process.returncode in (0, -15), log[-2000:]
    assert "Traceback" not in log, log[-2000:]
    json.dumps(reply.model_dump())


def test_a_port_in_use_is_said_so_and_the_server_exits_nonzero_without_claiming_to_serve():
    """The start-up line comes only once the port is bound; a failed bind says what to do and exits 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "mini_vllm", "serve", "--port", str(port), "--num-gpu-blocks-override", "16"]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "serves" not in result.stdout, result.stdout
    assert f"could not listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-2000:]


def test_a_client_that_gives_up_on_a_whole_answer_has_its_request_aborted(served):
    """Non-streaming: the server watches for the disconnect while the engine works (as vLLM's with_cancellation)."""
    llm, server, client = served
    body = {
        "model": MODEL,
        "messages": [SYSTEM, {"role": "user", "content": "A very long story."}],
        "max_tokens": 600,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.5)
    wait_idle(llm)
    assert not llm.llm_engine.requests
    assert_nothing_leaked(llm.llm_engine)


# ``python -m mini_vllm serve`` whose every engine step lasts 30 s, busy in torch as a long forward pass is.
SLOW_STEP_SERVER = """
import sys, time, torch
from mini_vllm.model_runner import ModelRunner
execute_model = ModelRunner.execute_model
def slow_execute_model(self, scheduler_output):
    deadline = time.monotonic() + 30
    x = torch.randn(256, 256)
    while time.monotonic() < deadline:
        x = torch.tanh(x @ x)
    return execute_model(self, scheduler_output)
ModelRunner.execute_model = slow_execute_model
from mini_vllm.entrypoints.openai.api_server import main
sys.exit(main(sys.argv[1:]))
"""


def shutdown_error(status: int, text: str) -> dict:
    """The error a client got at a shutdown: a JSON body, or a stream's error event before its [DONE]."""
    if status != 200:
        return {**json.loads(text)["error"], "status": status}
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", text
    return json.loads(events[-2])["error"]


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
@pytest.mark.parametrize("signals", [["SIGINT"], ["SIGTERM"], ["SIGINT", "SIGINT"]])
def test_a_shutdown_during_a_long_step_answers_every_client_with_a_503_and_exits_cleanly(tmp_path, signals):
    """A step longer than GRACEFUL_SHUTDOWN_S: clients (one mid-step, one queued behind it) get a JSON 503 or a
    final SSE error event at once; the server exits without waiting for the step, and a second Ctrl-C
    exits at once, without the SIGABRT of a teardown under the engine thread."""
    import signal

    port = free_port()
    command = [sys.executable, "-c", SLOW_STEP_SERVER, "--port", str(port), "--num-gpu-blocks-override", "16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "server.log", "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        answers = []

        def ask(stream: bool) -> None:
            body = {"prompt": "Once", "max_tokens": 20, "stream": stream}
            response = httpx.post(url + "/v1/completions", json=body, timeout=60)
            answers.append(shutdown_error(response.status_code, response.text))

        clients = [threading.Thread(target=ask, args=(stream,)) for stream in (True, False)]
        for client in clients:
            client.start()
            time.sleep(0.5)
        time.sleep(1)
        start = time.monotonic()
        for name in signals:
            process.send_signal(getattr(signal, name))
            time.sleep(1)
        for client in clients:
            client.join(timeout=60)
        returncode = process.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        process.kill()
    log = (tmp_path / "server.log").read_text()
    assert len(answers) == 2, log[-3000:]
    for answer in answers:
        assert answer["code"] == 503 and answer["type"] == "ServiceUnavailableError", answer
        assert answer["message"].startswith("the server is shutting down"), answer
    assert returncode in (1, -signal.SIGTERM), (returncode, log[-3000:])  # not -SIGABRT
    assert took < 20, took  # the 30 s step was not waited for
    assert "Traceback" not in log and "terminate called" not in log, log[-3000:]


def test_ctrl_c_stops_the_server_with_a_request_running(tmp_path):
    """A real SIGINT while a long answer streams: the server exits within its grace period, no traceback."""
    import signal

    spec = ServerSpec(str(default_model_path()), block_size=16, num_blocks=64, max_model_len=1024)
    with start_mini_server(spec, tmp_path) as server:
        server.wait_ready(timeout=120)
        body = {"messages": [SYSTEM, {"role": "user", "content": "Go on."}], "max_tokens": 900, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            start = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            server.process.wait(timeout=60)
            took = time.monotonic() - start
        log = server.log_tail(lines=200)
    assert took < 30, took
    assert "Traceback" not in log, log
