"""``SamplingParams(stop_token_ids=[...])``: a completion ends at the first of those tokens, as at EOS.

As vLLM's: the token stays in ``token_ids`` but not in the text, ``finish_reason`` is "stop" and
``stop_reason`` the token's id; it stops also with ``ignore_eos``. Checked on the engine, over
HTTP, and (with ``make vllm``) against vLLM on the same requests.
"""

from __future__ import annotations

import httpx
import pytest

from mini_vllm import LLM, SamplingParams
from mini_vllm.entrypoints.openai.api_server import BackgroundServer
from mini_vllm.model import default_model_path
from mini_vllm.tools.compare_vllm import run_mini, run_vllm, vllm_missing_reason, vllm_python
from prerequisites import missing

PROMPT = "Once upon a time"


def free_run(llm: LLM, prompt: dict) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_stop_token_ends_the_completion_and_is_left_out_of_the_text():
    llm = LLM(device="cpu")
    tokenizer = llm.get_tokenizer()
    prompt = {"prompt_token_ids": tokenizer.encode(PROMPT)}
    tokens = free_run(llm, prompt)
    stop = tokens[4]
    first = tokens.index(stop)  # the first time it comes
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[0, stop])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.text == tokenizer.decode(tokens[:first])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    with BackgroundServer(llm) as server:
        body = {"model": "mini-vllm", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(server.url + "/v1/completions", json={**body, "stop_token_ids": [stop]}, timeout=60).json()
        choice = answer["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (out.text, "stop", stop)
        refused = httpx.post(server.url + "/v1/completions", json={**body, "stop_token_ids": [-1]}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop_token_ids.0"


@pytest.mark.vllm
def test_stop_token_ids_stop_where_vllm_stops():
    if vllm_python() is None:
        missing("vllm", vllm_missing_reason())  # fails under CI (tests/prerequisites.py)
    llm = LLM(device="cpu")
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode(PROMPT)}
    stop = free_run(llm, prompt)[4]
    sampling = {"temperature": 0.0, "max_tokens": 12, "n": 1, "ignore_eos": True, "stop_token_ids": [stop]}
    workload = {"name": "stop tokens", "calls": [{"prompts": [prompt], "sampling": sampling}]}
    spec = {"block_size": 32, "num_blocks": 64, "workloads": [workload]}
    ours = run_mini(None, [spec])[0]["workloads"][0]["requests"]
    theirs = run_vllm(str(default_model_path()), [spec])["engines"][0]["workloads"][0]["requests"]
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in theirs]
    assert ours[0]["token_ids"][0][-1] == stop and len(ours[0]["token_ids"][0]) < 12
