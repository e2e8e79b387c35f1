"""What a router asks of a replica: ``serve --enable-scale-out`` (the render endpoints) and ``--kv-events-config``.

The render endpoints must give the token ids the same request runs with (a router hashes
them), in vLLM's ``GenerateRequest``; without the flag they answer 403 as vLLM's do. The
server publishes its engine's KV events where ``--kv-events-config`` says.
"""

from __future__ import annotations

import time

import httpx
import pytest

from mini_vllm import LLM
from mini_vllm.distributed.kv_events import BlockStored, KVEventSubscriber, external_block_hash
from mini_vllm.entrypoints.openai.api_server import BackgroundServer, main
from mini_vllm.hashing import hash_request_tokens
from mini_vllm.tools.compare_kv_events import free_port

MODEL = "mini-vllm"
MESSAGES = [{"role": "system", "content": "You tell short stories."}, {"role": "user", "content": "A fox."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", block_size=16, num_blocks=64, max_model_len=512)


@pytest.fixture(scope="module")
def server(llm):
    port = free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{port}")
    with BackgroundServer(llm, served_model_name=MODEL, enable_scale_out=True, kv_events_config=config) as server:
        time.sleep(0.5)  # the subscriber joins before anything is published
        yield server, subscriber
    subscriber.close()


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60, trust_env=False)


def test_chat_render_gives_the_token_ids_the_chat_runs_with(server):
    server, _ = server
    rendered = post(server, "/v1/chat/completions/render", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
    assert rendered.status_code == 200, rendered.text
    body = rendered.json()
    assert body["request_id"].startswith("chatcmpl-") and body["model"] == MODEL and body["cache_salt"] is None
    assert body["sampling_params"]["max_tokens"] == 3 and body["stream"] is False
    tokenized = post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    assert body["token_ids"] == tokenized
    reply = post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}).json()
    assert reply["usage"]["prompt_tokens"] == len(body["token_ids"])


def test_completion_render_gives_one_generate_request_per_prompt(server):
    server, _ = server
    body = {"model": MODEL, "prompt": ["Once upon a time", "A fox"], "max_tokens": 2, "cache_salt": "tenant-a"}
    rendered = post(server, "/v1/completions/render", body)
    assert rendered.status_code == 200, rendered.text
    [first, second] = rendered.json()
    assert first["request_id"].endswith("-0") and second["request_id"].endswith("-1")
    assert first["token_ids"] == post(server, "/tokenize", {"prompt": "Once upon a time"}).json()["tokens"]
    assert first["cache_salt"] == second["cache_salt"] == "tenant-a"


def test_a_bad_request_to_render_is_the_same_4xx_as_to_the_endpoint(server):
    server, _ = server
    bad = {"model": "no-such-model", "messages": MESSAGES}
    rendered, direct = post(server, "/v1/chat/completions/render", bad), post(server, "/v1/chat/completions", bad)
    assert rendered.status_code == direct.status_code == 404
    assert rendered.json()["error"]["param"] == "model"


def test_the_server_publishes_its_engines_kv_events(server):
    server, subscriber = server
    prompt = list(range(200, 240))
    reply = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    received = []
    while (message := subscriber.receive(1.0)) is not None:
        received.append(message)
    stored = [e for _, batch in received for e in batch.events if isinstance(e, BlockStored)]
    expected = [external_block_hash(h) for h in hash_request_tokens(prompt, 16)]
    assert any(e.block_hashes == expected and e.token_ids == prompt[:32] for e in stored), stored


def test_without_the_flag_the_render_endpoints_answer_403_as_vllms(llm):
    with BackgroundServer(llm, served_model_name=MODEL) as server:
        for path, body in (
            ("/v1/chat/completions/render", {"messages": MESSAGES}),
            ("/v1/completions/render", {"prompt": "A fox"}),
        ):
            response = post(server, path, body)
            assert response.status_code == 403
            assert response.json()["error"]["type"] == "PermissionDeniedError"
            assert "--enable-scale-out" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "config, named",
    [('{"enable_kv_cache_events": true, "topik": ""}', "topik"), ('{"publisher": "kafka"}', "publisher")],
)
def test_a_bad_kv_events_config_is_an_argparse_error_naming_the_field(config, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--kv-events-config", config, "--device", "cpu", "--port", "0"])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
