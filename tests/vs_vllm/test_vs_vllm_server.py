"""mini-vLLM's OpenAI server against vLLM's own, through the official ``openai`` client.

Both servers run as subprocesses, the way a user starts them (``python -m mini_vllm
serve`` and vLLM's ``vllm.entrypoints.openai.api_server`` from ``.venv-vllm``), on the
bundled model at block size 32 with the same pool. The same requests go to both;
for every request the prompt tokens, the cached tokens and the greedy text must
be equal. Bad requests must get a 4xx with an OpenAI error body from both.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mini_vllm.tools.compare_servers import (
    SERVED_MODEL_NAME,
    ServerSpec,
    compare_records,
    format_table,
    run_workload,
    start_mini_server,
    start_vllm_server,
    workload_prompts,
)
from mini_vllm.tools.compare_vllm import vllm_missing_reason, vllm_python
from mini_vllm.model import default_model_path
from prerequisites import missing

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if vllm_python() is None:
        missing("vllm", vllm_missing_reason())  # fails under CI (tests/prerequisites.py)
    from openai import OpenAI

    log_dir = tmp_path_factory.mktemp("servers")
    spec = ServerSpec(str(default_model_path()), block_size=32, num_blocks=256)
    mini = start_mini_server(spec, log_dir)
    vllm = start_vllm_server(spec, log_dir)
    try:
        mini.wait_ready(timeout=300)
        vllm.wait_ready(timeout=400)
        clients = {
            name: OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            for name, server in (("mini", mini), ("vllm", vllm))
        }
        yield {"mini": mini, "vllm": vllm, "clients": clients}
    finally:
        mini.stop()
        vllm.stop()


@pytest.fixture(scope="module")
def workload_rows(servers):
    """The side-by-side workload, run on each server in turn (the first thing each server sees)."""
    runs = {name: run_workload(client) for name, client in servers["clients"].items()}
    rows = compare_records(runs["mini"], runs["vllm"])
    print(format_table(rows))
    return rows


def test_same_prompt_tokens_cached_tokens_and_greedy_text_for_every_request(workload_rows):
    assert len(workload_rows) == 13
    for row in workload_rows:
        assert row["same_prompt_tokens"], row
        assert row["same_cached_tokens"], row
        assert row["same_text"], row
        assert row["same_finish_reason"], row
    cached = {row["name"]: row["cached_tokens"][0] for row in workload_rows}
    # The workload exercises what it claims: hits on shared prefixes, none across tenants.
    assert cached["shared system prompt 1"] > 0 and cached["growing chat, turn 2"] > cached["growing chat, turn 1"] > 0
    assert cached["tenant A again"] > 0 and cached["tenant B"] == 0 and cached["tenant A"] == 0
    assert all(c % 32 == 0 for c in cached.values())


def _chat_both_ways(client, messages, **kwargs):
    whole = client.chat.completions.create(model=SERVED_MODEL_NAME, messages=messages, **kwargs)
    chunks = list(
        client.chat.completions.create(
            model=SERVED_MODEL_NAME, messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, "the usage comes in a last chunk of its own"
    assert all(c.usage is None for c in chunks[:-1])
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return whole, streamed, chunks[-1].usage, finish


@pytest.mark.parametrize("stop", [None, ["."]])
def test_streaming_equals_non_streaming_on_both_servers(servers, workload_rows, stop):
    users = workload_prompts()["users"]
    messages = [{"role": "user", "content": users[1]}]
    texts = {}
    for name, client in servers["clients"].items():
        whole, streamed, streamed_usage, finish = _chat_both_ways(
            client, messages, max_tokens=30, temperature=0, stop=stop
        )
        assert streamed == whole.choices[0].message.content, name
        assert streamed_usage.prompt_tokens == whole.usage.prompt_tokens, name
        assert streamed_usage.completion_tokens == whole.usage.completion_tokens, name
        assert finish == [whole.choices[0].finish_reason], name
        choice = whole.choices[0]
        texts[name] = (choice.message.content, whole.usage.prompt_tokens_details.cached_tokens, choice.stop_reason)
    assert texts["mini"] == texts["vllm"]  # text, cached tokens and stop_reason (the stop string, or None)


def test_sixteen_concurrent_clients_are_all_served_with_vllms_answers(servers, workload_rows):
    users = workload_prompts()["users"]
    conversations = [[{"role": "user", "content": users[i % len(users)]}] for i in range(16)]
    answers = {}
    for name, client in servers["clients"].items():

        def ask(messages, client=client):
            reply = client.chat.completions.create(
                model=SERVED_MODEL_NAME, messages=messages, max_tokens=12, temperature=0
            )
            return reply.choices[0].message.content, reply.usage.prompt_tokens

        with ThreadPoolExecutor(16) as pool:
            answers[name] = list(pool.map(ask, conversations))
        assert len(answers[name]) == 16 and all(text for text, _ in answers[name])
    assert [p for _, p in answers["mini"]] == [p for _, p in answers["vllm"]]
    assert [t for t, _ in answers["mini"]] == [t for t, _ in answers["vllm"]]


OK_MESSAGES = [{"role": "user", "content": "Tell me a story."}]
BAD_REQUESTS = {
    "missing messages": {"model": SERVED_MODEL_NAME},
    "empty messages": {"model": SERVED_MODEL_NAME, "messages": []},
    "negative max_tokens": {"model": SERVED_MODEL_NAME, "messages": OK_MESSAGES, "max_tokens": -1},
    "string max_tokens": {"model": SERVED_MODEL_NAME, "messages": OK_MESSAGES, "max_tokens": "ten"},
    "temperature < 0": {"model": SERVED_MODEL_NAME, "messages": OK_MESSAGES, "temperature": -0.5},
    "top_p > 1": {"model": SERVED_MODEL_NAME, "messages": OK_MESSAGES, "top_p": 1.5},
    "n = 0": {"model": SERVED_MODEL_NAME, "messages": OK_MESSAGES, "n": 0},
    "non-string cache_salt": {"model": SERVED_MODEL_NAME, "messages": OK_MESSAGES, "cache_salt": 5},
    "prompt longer than the context": {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "story " * 1500}],
    },
    "unknown model": {"model": "no-such-model", "messages": OK_MESSAGES},
    "stream_options without stream": {
        "model": SERVED_MODEL_NAME,
        "messages": OK_MESSAGES,
        "stream_options": {"include_usage": True},
    },
}


@pytest.mark.parametrize("case", [*BAD_REQUESTS, "malformed JSON"])
def test_bad_requests_get_a_4xx_error_body_from_both_and_both_keep_serving(servers, workload_rows, case):
    statuses = {}
    for name in ("mini", "vllm"):
        url = servers[name].url + "/v1/chat/completions"
        if case == "malformed JSON":
            response = httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"})
        else:
            response = httpx.post(url, json=BAD_REQUESTS[case], timeout=60)
        statuses[name] = response.status_code
        assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:300])
        body = response.json()
        assert isinstance(body.get("error", {}).get("message"), str) and body["error"]["message"], (name, body)
    assert statuses["mini"] == statuses["vllm"], statuses
    # Both still answer the next client.
    ok = httpx.post(
        servers["mini"].url + "/v1/chat/completions",
        json={"model": SERVED_MODEL_NAME, "messages": OK_MESSAGES, "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


TOKENIZE_BODIES = {
    "a prompt": {"prompt": "Once upon a time, a fox met a crow.", "return_token_strs": True},
    "a prompt without special tokens": {"prompt": "Tell me a story.", "add_special_tokens": False},
    "messages": {"messages": [{"role": "system", "content": "Be brief."}, *OK_MESSAGES], "return_token_strs": True},
    "messages without the assistant header": {"messages": OK_MESSAGES, "add_generation_prompt": False},
}


@pytest.mark.parametrize("case", TOKENIZE_BODIES)
def test_tokenize_and_detokenize_answer_as_vllms(servers, workload_rows, case):
    answers = {}
    for name in ("mini", "vllm"):
        url = servers[name].url
        tokenized = httpx.post(
            url + "/tokenize", json={"model": SERVED_MODEL_NAME, **TOKENIZE_BODIES[case]}, timeout=60
        )
        assert tokenized.status_code == 200, (name, tokenized.text)
        detokenized = httpx.post(url + "/detokenize", json={"tokens": tokenized.json()["tokens"]}, timeout=60)
        assert detokenized.status_code == 200, (name, detokenized.text)
        answers[name] = (tokenized.json(), detokenized.json())
    assert answers["mini"] == answers["vllm"]
    assert httpx.get(servers["mini"].url + "/ping").status_code == httpx.get(servers["vllm"].url + "/ping").status_code


def _logprob_values(choice_logprobs: dict, chat: bool) -> tuple[list, list]:
    """(the texts, the log-probabilities) of a choice's tokens and their candidates, in order."""
    if chat:
        items = [
            (e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
            for e in choice_logprobs["content"]
        ]
        return [(t, [c for c, _ in top]) for t, _, top in items], [(v, [x for _, x in top]) for _, v, top in items]
    texts = list(zip(choice_logprobs["tokens"], [list(top) for top in choice_logprobs["top_logprobs"]]))
    values = list(
        zip(choice_logprobs["token_logprobs"], [list(top.values()) for top in choice_logprobs["top_logprobs"]])
    )
    return texts + [("offsets", choice_logprobs["text_offset"])], values


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_logprobs_answer_as_vllms(servers, workload_rows, endpoint, stream):
    """The same tokens, token texts, candidates (and text offsets) from both servers; values within 1e-3."""
    chat = endpoint == "chat"
    body = {"model": SERVED_MODEL_NAME, "max_tokens": 6, "temperature": 0, "stream": stream}
    if chat:
        body |= {"messages": OK_MESSAGES, "logprobs": True, "top_logprobs": 2}
    else:
        body |= {"prompt": "Once upon a time, a little", "logprobs": 2}
    answers = {}
    for name in ("mini", "vllm"):
        url = servers[name].url + ("/v1/chat/completions" if chat else "/v1/completions")
        if not stream:
            response = httpx.post(url, json=body, timeout=120)
            assert response.status_code == 200, (name, response.text)
            answers[name] = _logprob_values(response.json()["choices"][0]["logprobs"], chat)
            continue
        parts = []  # each chunk's logprobs, joined: what a streaming client collects
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    if choices and choices[0].get("logprobs"):
                        parts.append(choices[0]["logprobs"])
        joined = {key: [item for part in parts for item in part[key]] for key in parts[0]} if parts else {}
        answers[name] = _logprob_values(joined, chat)
    (mini_texts, mini_values), (vllm_texts, vllm_values) = answers["mini"], answers["vllm"]
    assert mini_texts == vllm_texts
    flat = lambda values: [v for value, top in values for v in (value, *top)]  # noqa: E731
    assert len(flat(mini_values)) == len(flat(vllm_values)) > 6
    assert max(abs(a - b) for a, b in zip(flat(mini_values), flat(vllm_values))) < 1e-3


def test_metrics_have_vllms_prefix_cache_counters_on_both(servers, workload_rows):
    for name in ("mini", "vllm"):
        text = httpx.get(servers[name].url + "/metrics", timeout=30).text
        for metric in (
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
        ):
            assert metric in text, (name, metric)
    mini_lines = httpx.get(servers["mini"].url + "/metrics", timeout=30).text.splitlines()
    hits = next(line for line in mini_lines if line.startswith("vllm:prefix_cache_hits_total"))
    assert float(hits.split()[-1]) > 0


def test_the_workload_table_flags_a_difference():
    """The comparison can fail: a changed cached count or text is reported, not hidden."""
    record = {"name": "r", "prompt_tokens": 10, "completion_tokens": 2, "text": "a", "finish_reason": "stop"}
    mini = [dict(record, cached_tokens=0, ttft_s=0.1)]
    for change in ({"cached_tokens": 32}, {"text": "b"}, {"prompt_tokens": 11}):
        vllm = [{**record, "cached_tokens": 0, "ttft_s": 0.1, **change}]
        row = compare_records(mini, vllm)[0]
        assert not (row["same_cached_tokens"] and row["same_text"] and row["same_prompt_tokens"])
    assert "NO" in format_table(compare_records(mini, [dict(record, cached_tokens=0, ttft_s=0.1, text="b")]))
    with pytest.raises(ValueError):
        compare_records(mini, [dict(record, name="other", cached_tokens=0, ttft_s=0.1)])
    json.dumps(compare_records(mini, mini))  # plain data
