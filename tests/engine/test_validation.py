"""Every bad input is refused up front, on every entry point, and the engine keeps serving.

A refusal is a ValueError (TypeError for a wrong type) whose message names the
field and the value; nothing is queued or allocated, and the next good request
is served as if nothing had happened.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_invariants import assert_nothing_leaked

from mini_vllm import LLM, SamplingParams, default_model_path
from mini_vllm.config import EngineConfig
from mini_vllm.llm_engine import LLMEngine
from mini_vllm.sampling_params import MAX_N, MAX_SEED

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [1, 566, 201, 434, 401, 1305, 12, 40, 41, 42]}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=32, device="cpu")


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def assert_untouched_and_serving(llm, reference):
    assert_nothing_leaked(llm)
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == reference


# -- SamplingParams ---------------------------------------------------------------

BAD_SAMPLING_PARAMS = [
    ({"temperature": math.nan}, ValueError, "temperature must be a finite number, got nan"),
    ({"temperature": math.inf}, ValueError, "temperature must be a finite number, got inf"),
    ({"temperature": 2.5}, ValueError, r"temperature must be in \[0, 2.0\], got 2.5"),
    ({"temperature": "hot"}, TypeError, "temperature must be a number, got str 'hot'"),
    ({"temperature": True}, TypeError, "temperature must be a number, got bool True"),
    ({"top_p": math.nan}, ValueError, "top_p must be a finite number"),
    ({"top_p": True}, TypeError, "top_p must be a number, got bool"),
    ({"n": True}, TypeError, "n must be an integer, got bool True"),
    ({"n": 2.0}, TypeError, "n must be an integer, got float 2.0"),
    ({"n": MAX_N + 1}, ValueError, f"n must be at most {MAX_N}, got {MAX_N + 1}"),
    ({"n": 10**6}, ValueError, f"n must be at most {MAX_N}"),
    ({"max_tokens": True}, TypeError, "max_tokens must be an integer, got bool True"),
    ({"max_tokens": 0}, ValueError, "max_tokens must be an integer >= 1, got 0"),
    ({"top_k": False}, TypeError, "top_k must be an integer, got bool False"),
    ({"top_k": -2}, ValueError, r"top_k must be 0 or -1 \(disabled\), or at least 1, got -2"),
    ({"seed": True}, TypeError, "seed must be an integer, got bool True"),
    ({"seed": 1.5}, TypeError, "seed must be an integer, got float 1.5"),
    ({"seed": MAX_SEED + 1}, ValueError, f"seed must be at most {MAX_SEED}"),
    ({"seed": -(2**63) - 1}, ValueError, "seed must be an integer >= "),
    ({"seed": MAX_SEED, "n": 2}, ValueError, "completion k samples with seed \\+ k"),
    ({"ignore_eos": 1}, TypeError, "ignore_eos must be a bool, got int 1"),
    ({"stop": 42}, TypeError, "stop must be a str or a list of str, got int 42"),
    ({"stop": ["ok", ""]}, ValueError, "stop must be a non-empty string"),
    ({"logprobs": 21}, ValueError, "logprobs must be at most 20, got 21"),
    ({"logprobs": -1}, ValueError, "logprobs must be an integer >= 0, got -1"),
    ({"logprobs": True}, TypeError, "logprobs must be an integer, got bool True"),
    ({"stop_token_ids": 2}, TypeError, "stop_token_ids must be a list of ints, got int 2"),
    ({"stop_token_ids": [2, -1]}, ValueError, r"stop_token_ids\[1\] must be an integer >= 0, got -1"),
    ({"stop_token_ids": ["2"]}, TypeError, r"stop_token_ids\[0\] must be an integer, got str"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_SAMPLING_PARAMS, ids=[str(k) for k, _, _ in BAD_SAMPLING_PARAMS])
def test_bad_sampling_params_are_refused_when_built(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_the_limits_themselves_are_accepted():
    assert SamplingParams(n=MAX_N).n == MAX_N
    assert SamplingParams(seed=MAX_SEED).seed == MAX_SEED
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(temperature=2.0).temperature == 2.0
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"


def test_a_denormal_temperature_is_raised_to_the_minimum_as_vllm_does(llm):
    params = SamplingParams(temperature=5e-324, max_tokens=4, ignore_eos=True)
    assert params.temperature == 0.01
    tokens = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert len(tokens) == 4 and all(0 <= t < llm.llm_engine.model_config.vocab_size for t in tokens)


@pytest.mark.parametrize(
    "bad", [{"temperature": 0}, "greedy", [GREEDY, {"max_tokens": 3}]], ids=["dict", "str", "list-with-dict"]
)
def test_sampling_params_of_the_wrong_type_are_refused(llm, reference, bad):
    with pytest.raises(TypeError, match="sampling_params.* must be a SamplingParams"):
        llm.generate([PROMPT, PROMPT] if isinstance(bad, list) else [PROMPT], bad)
    assert_untouched_and_serving(llm, reference)


# -- SamplingParams changed after they were built -----------------------------------

# A field set after construction skips __post_init__; the engine checks its own copy when the request is added.
MUTATIONS = [
    ("n", 2000),
    ("n", 0),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("temperature", -1),
    ("temperature", 3),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 2.5),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", "5"),
    ("max_tokens", True),
    ("seed", 1.5),
    ("seed", MAX_SEED + 1),
    ("stop", 42),
    ("stop", ["ok", ""]),
    ("ignore_eos", 1),
]
GREEDY_FIELDS = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


def error_when_built(field: str, value) -> BaseException:
    """The error constructing SamplingParams with ``field=value`` raises (what a mutated object must get too)."""
    with pytest.raises((ValueError, TypeError)) as caught:
        SamplingParams(**{**GREEDY_FIELDS, field: value})
    return caught.value


def mutated(field: str, value) -> SamplingParams:
    params = SamplingParams(**GREEDY_FIELDS)
    setattr(params, field, value)
    return params


@pytest.mark.parametrize("field,value", MUTATIONS, ids=[f"{f}={v!r}" for f, v in MUTATIONS])
def test_sampling_params_changed_after_construction_are_refused_at_submission(llm, reference, field, value):
    expected = error_when_built(field, value)
    engine = llm.llm_engine
    # LLM.generate (and chat, which goes through it): exactly the constructor's error, and nothing queued.
    with pytest.raises(type(expected)) as caught:
        llm.generate([PROMPT, PROMPT], mutated(field, value))
    assert str(caught.value) == str(expected)
    assert_untouched_and_serving(llm, reference)
    with pytest.raises(type(expected)) as caught:
        llm.chat([{"role": "user", "content": "hi"}], mutated(field, value))
    assert str(caught.value) == str(expected)
    assert_nothing_leaked(llm)
    # LLMEngine.add_request.
    with pytest.raises(type(expected)) as caught:
        engine.add_request("mutated", PROMPT["prompt_token_ids"], mutated(field, value))
    assert str(caught.value) == str(expected)
    assert_nothing_leaked(llm)
    # LLMEngine.add_requests with one SamplingParams per prompt: the good first prompt is not queued either.
    with pytest.raises(type(expected)) as caught:
        engine.add_requests([PROMPT, PROMPT], [GREEDY, mutated(field, value)])
    assert str(caught.value) == f"sampling_params[1]: {expected}"
    assert_untouched_and_serving(llm, reference)


def test_the_mutation_test_catches_an_engine_that_trusts_the_object(llm, monkeypatch):
    """Without the engine's own check, a mutated max_tokens=0 is queued: the test above would fail."""
    import mini_vllm.input_processor as input_processor
    import mini_vllm.llm_engine as llm_engine

    monkeypatch.setattr(input_processor, "validated_sampling_params", lambda params: params)
    monkeypatch.setattr(llm_engine, "validated_sampling_params", lambda params: params)
    engine = llm.llm_engine
    engine.add_request("trusted", PROMPT["prompt_token_ids"], mutated("max_tokens", 0))  # no error: queued
    assert "trusted" in engine.requests
    engine.abort_request("trusted")
    assert_nothing_leaked(llm)


def test_a_request_keeps_its_own_checked_copy_of_the_sampling_params(llm, reference):
    """Changing the object after submission changes nothing queued; derived fields and normalisations are redone."""
    engine = llm.llm_engine
    params = SamplingParams(**GREEDY_FIELDS)
    params.stop = "never-in-the-output"  # set after construction: stop_strings must follow
    params.seed = -1  # vLLM's "no seed" -> None
    request = engine.add_request("own-copy", PROMPT["prompt_token_ids"], params)
    queued = request.sampling_params
    assert queued is not params
    assert queued.stop_strings == ["never-in-the-output"] and queued.seed is None
    params.max_tokens, params.temperature, params.stop = 1, 2.0, "x"  # after submission: no effect
    params.stop_strings.append("x")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.outputs[0].token_ids for o in outputs if o.request_id == "own-copy"] == [reference]
    assert queued.max_tokens == 4 and queued.temperature == 0 and queued.stop_strings == ["never-in-the-output"]
    assert_nothing_leaked(llm)
    # A caller's stop list is copied too, not shared.
    stops = ["never-in-the-output"]
    request = engine.add_request("own-list", PROMPT["prompt_token_ids"], SamplingParams(**GREEDY_FIELDS, stop=stops))
    stops.append(".")
    assert request.sampling_params.stop == ["never-in-the-output"]
    engine.abort_request("own-list")
    assert_nothing_leaked(llm)


def test_a_tiny_temperature_set_after_construction_is_raised_to_the_minimum(llm):
    params = SamplingParams(max_tokens=2)
    params.temperature = 1e-6
    request = llm.llm_engine.add_request("tiny", PROMPT["prompt_token_ids"], params)
    assert request.sampling_params.temperature == 0.01 and params.temperature == 1e-6
    llm.llm_engine.abort_request("tiny")
    assert_nothing_leaked(llm)


def test_n_changed_after_construction_is_checked_and_served_as_n_children(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=1.0, max_tokens=2, seed=7)
    params.n = 3
    ids = engine.add_requests([PROMPT], params, request_ids=["grown"])
    assert ids == {"grown": ["grown-0", "grown-1", "grown-2"]}
    children = [engine.requests[rid].sampling_params for rid in ids["grown"]]
    assert [(c.n, c.seed) for c in children] == [(1, 7), (1, 8), (1, 9)]
    params.seed = MAX_SEED  # seed + k would overflow for k = 1, 2
    with pytest.raises(ValueError, match="completion k samples with seed \\+ k"):
        engine.add_requests([PROMPT], params, request_ids=["overflow"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_leaked(llm)


# -- prompts and token ids ---------------------------------------------------------

BAD_PROMPTS = [
    (
        {"prompt": {"prompt": "Once upon a time", "cache_salt": "B"}},
        TypeError,
        r"prompt\['prompt'\] must be a str, got dict",
    ),
    ({"prompt_token_ids": [1, 2.0]}, TypeError, r"prompt_token_ids\[1\] must be an int, got float 2.0"),
    ({"prompt_token_ids": [True, 2]}, TypeError, r"prompt_token_ids\[0\] must be an int, got bool True"),
    ({"prompt_token_ids": [1, "2"]}, TypeError, r"prompt_token_ids\[1\] must be an int, got str '2'"),
    (
        {"prompt_token_ids": [1, np.int64(2)]},
        TypeError,
        r"prompt_token_ids\[1\] must be an int, got numpy.int64.*tolist",
    ),
    ({"prompt_token_ids": np.array([1, 2])}, TypeError, "must be a list of ints, got numpy.ndarray"),
    ({"prompt_token_ids": torch.tensor([1, 2])}, TypeError, "must be a list of ints, got torch.Tensor"),
    ({"prompt_token_ids": range(1, 5)}, TypeError, "must be a list of ints, got range"),
    ({"prompt_token_ids": "1 2 3"}, TypeError, "must be a list of ints, got str"),
    ({"prompt_token_ids": [1, 10**9]}, ValueError, r"prompt_token_ids\[1\] = 1000000000 is outside the vocabulary"),
    ({"prompt_token_ids": []}, ValueError, "the prompt is empty"),
    ({"prompt_token_ids": [1, 2], "cache_salt": 7}, TypeError, "cache_salt must be a str or None, got int 7"),
    ({"prompt_token_ids": [1, 2], "salt": "x"}, ValueError, "unknown prompt keys"),
    ([1, 2, 3], TypeError, "a prompt must be a str or a dict"),
]


@pytest.mark.parametrize("bad,error,message", BAD_PROMPTS, ids=[f"prompt{i}" for i in range(len(BAD_PROMPTS))])
def test_bad_prompts_are_refused_on_every_entry_point(llm, reference, bad, error, message):
    from mini_vllm.viz import EngineDashboard

    engine = llm.llm_engine
    # LLM.generate: the good prompt before the bad one is not queued either; the message names the bad one.
    with pytest.raises(error, match="prompt 1: .*" + message):
        llm.generate([PROMPT, bad], GREEDY)
    assert_untouched_and_serving(llm, reference)
    # LLMEngine.add_requests, and the dashboard, which queues through it.
    with pytest.raises(error, match=message) as raised:
        engine.add_requests([bad], GREEDY)
    assert not str(raised.value).startswith("prompt 0"), "one prompt: there is no index to name"
    dashboard = EngineDashboard(llm, k_norm=False)
    try:
        with pytest.raises(error, match=message):
            dashboard.add_requests([PROMPT, bad], GREEDY)
    finally:
        dashboard.close()
    assert_untouched_and_serving(llm, reference)
    # LLMEngine.add_request takes token ids directly.
    if isinstance(bad, dict) and "prompt_token_ids" in bad and set(bad) <= {"prompt_token_ids", "cache_salt"}:
        with pytest.raises(error, match=message):
            engine.add_request("direct", bad["prompt_token_ids"], GREEDY, cache_salt=bad.get("cache_salt"))
        assert_untouched_and_serving(llm, reference)


def test_n_above_one_is_refused_by_add_request_and_served_by_add_requests(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, max_tokens=2, seed=3)
    with pytest.raises(ValueError, match="n=2: use add_requests"):
        engine.add_request("one", PROMPT["prompt_token_ids"], params)
    assert engine.add_requests([PROMPT], params, request_ids=["two"]) == {"two": ["two-0", "two-1"]}
    with pytest.raises(ValueError, match="'two-0' is already in use"):
        engine.add_requests([PROMPT], params, request_ids=["two"])
    with pytest.raises(TypeError, match="request_id must be a str, got int 5"):
        engine.add_request(5, PROMPT["prompt_token_ids"], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache_manager.check_invariants()


def test_the_id_of_an_n_above_one_prompt_is_in_use_while_a_completion_runs(llm):
    """``abort_request`` takes the prompt's id, so no other request may take it (nor a prompt a running completion's)."""
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, max_tokens=2, seed=3)
    assert engine.add_requests([PROMPT], params, request_ids=["parent"]) == {"parent": ["parent-0", "parent-1"]}
    with pytest.raises(ValueError, match="'parent' is already in use"):
        engine.add_request("parent", PROMPT["prompt_token_ids"], GREEDY)
    with pytest.raises(ValueError, match="'parent' is already in use"):
        engine.add_requests([PROMPT], GREEDY, request_ids=["parent"])
    with pytest.raises(ValueError, match="'parent-0' is already in use"):
        engine.add_requests([PROMPT], params, request_ids=["parent-0"])
    with pytest.raises(ValueError, match="request ids repeat within the batch"):
        engine.add_requests([PROMPT, PROMPT], [params, GREEDY], request_ids=["twin", "twin"])
    assert sorted(engine.requests) == ["parent-0", "parent-1"]
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("parent", PROMPT["prompt_token_ids"], GREEDY)  # free again once its completions ended
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache_manager.check_invariants()


def test_a_prompt_that_exactly_fills_the_pool_is_accepted_with_max_tokens_1():
    small = LLM(num_blocks=4, device="cpu")  # 64 token slots
    fills_the_pool = {"prompt_token_ids": [1] + [566] * 63}
    output = small.generate([fills_the_pool], SamplingParams(temperature=0, max_tokens=1))[0]
    assert len(output.outputs[0].token_ids) == 1  # the sampled token needs no slot: it is never computed
    with pytest.raises(ValueError, match=r"max_tokens \(2\) needs 5 KV-cache blocks, but the pool has only 4"):
        small.generate([fills_the_pool], SamplingParams(temperature=0, max_tokens=2))
    with pytest.raises(ValueError, match="needs 5 KV-cache blocks"):
        small.generate([{"prompt_token_ids": [1] * 65}], SamplingParams(temperature=0, max_tokens=1))
    small.llm_engine.kv_cache_manager.check_invariants()
    assert small.llm_engine.kv_cache_manager.get_num_free_blocks() == 4


# -- chat ----------------------------------------------------------------------------

BAD_CHATS = [
    ([{"role": "user"}], ValueError, "message 0 has no 'content'"),
    ([{"content": "hi"}], ValueError, "message 0 has no 'role'"),
    (
        [{"role": "user", "content": 42}],
        TypeError,
        "message 0: 'content' must be a str or a list of text parts, got int 42",
    ),
    (
        [{"role": "system", "content": "a"}, {"role": None, "content": "b"}],
        TypeError,
        "message 1: 'role' must be a str, got NoneType",
    ),
    ([{"role": "user", "content": "a"}, "hello"], TypeError, "message 1 must be a dict"),
    (
        [[{"role": "user", "content": "a"}], [{"role": "user", "content": ["parts"]}]],
        TypeError,
        "conversation 1, message 0: content part 0 must be {'type': 'text', 'text': str}",
    ),
    ([[{"role": "user", "content": "a"}], []], TypeError, "conversation 1, a conversation must be a non-empty list"),
    ([], TypeError, "messages must be a non-empty list"),
    (
        [{"role": "user", "content": "a\udc00"}],  # a JSON escape of half a character: the tokenizer raised TypeError
        ValueError,
        "message 0: 'content' is not valid Unicode text: character 1 is a lone surrogate",
    ),
]


@pytest.mark.parametrize("messages,error,message", BAD_CHATS, ids=[f"chat{i}" for i in range(len(BAD_CHATS))])
def test_bad_chat_messages_name_the_message(llm, reference, messages, error, message):
    with pytest.raises(error, match=message):
        llm.chat(messages, GREEDY)
    assert_untouched_and_serving(llm, reference)


def test_a_template_that_rejects_a_conversation_raises_value_error(llm, reference):
    with pytest.raises(ValueError, match="the chat template rejected the conversation"):
        llm.chat(
            [{"role": "user", "content": "hi"}],
            GREEDY,
            chat_template_kwargs={"chat_template": "{{ raise_exception('no') }}"},
        )
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template_kwargs="x")
    assert_untouched_and_serving(llm, reference)


def test_role_markers_typed_in_chat_content_become_control_tokens_as_in_vllm(llm):
    """vLLM renders the template to text and tokenizes it with special tokens recognized; so does mini-vLLM."""
    tokenizer = llm.get_tokenizer()
    marker = "<|im_start|>"
    marker_id = tokenizer.convert_tokens_to_ids(marker)
    assert marker_id != tokenizer.unk_token_id
    plain = llm.apply_chat_template([{"role": "user", "content": "hello"}])
    typed = llm.apply_chat_template([{"role": "user", "content": f"hello{marker}system"}])
    assert typed.count(marker_id) == plain.count(marker_id) + 1


# -- seeded n > 1 ----------------------------------------------------------------------


def test_seeded_completions_differ_and_completion_k_uses_seed_plus_k(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    completions = [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs]
    assert len({tuple(c) for c in completions}) == 3  # not n identical completions (one seed for all)
    for k, tokens in enumerate(completions):
        alone = SamplingParams(temperature=1.0, max_tokens=8, seed=11 + k, ignore_eos=True)
        assert llm.generate([PROMPT], alone)[0].outputs[0].token_ids == tokens
    assert [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs] == completions  # reproducible


# -- the engine's settings ------------------------------------------------------------------

BAD_SETTINGS = [
    ({"hash_algo": "md5"}, ValueError, "hash_algo must be one of \\['sha256', 'xxhash'\\], got 'md5'"),
    ({"seed": True}, TypeError, "seed must be an integer, got bool True"),
    ({"seed": 1.5}, TypeError, "seed must be an integer, got float"),
    ({"seed": 2**40}, ValueError, r"seed must be an integer with abs\(seed\) < 2\*\*32"),
    ({"block_size": True}, TypeError, "block_size must be a positive integer, got bool"),
    ({"num_blocks": 2.0}, TypeError, "num_blocks must be a positive integer, got float"),
    ({"enable_prefix_caching": "yes"}, TypeError, "enable_prefix_caching must be True or False"),
    ({"kv_cache_memory_gb": math.inf}, ValueError, "kv_cache_memory_gb must be positive and finite"),
    ({"device": "gpu"}, ValueError, "device must be 'auto' or a torch device such as .*, got 'gpu' \\(torch: "),
    ({"device": ""}, ValueError, "device must be 'auto' or a torch device .*, got '' \\(torch: "),
    ({"device": "cuda:x"}, ValueError, "device must be 'auto' or a torch device .*, got 'cuda:x'"),
    ({"device": 5}, TypeError, "device must be a str such as 'auto', 'cpu' or 'cuda:0', got int 5"),
    ({"device": None}, TypeError, "device must be a str .*, got NoneType None"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_SETTINGS, ids=[str(k) for k, _, _ in BAD_SETTINGS])
def test_bad_engine_settings_are_refused_by_the_constructor(kwargs, error, message, monkeypatch):
    def no_model_load(*args, **kwargs):  # proves the refusal comes before anything is loaded
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mini_vllm.llm_engine.load_model", no_model_load)
    with pytest.raises(error, match=message):
        EngineConfig(**kwargs)
    with pytest.raises(error, match=message):
        LLM(**kwargs)


def torch_accepts(name: str) -> bool:
    try:
        torch.device(name)
    except RuntimeError:
        return False
    return True


# Every spelling decided by torch itself: "CPU" is whatever torch.device("CPU") says (today: refused).
DEVICE_NAMES = [
    "cpu",
    "cpu:0",
    "CPU",
    "cuda",
    "cuda:0",
    "cuda:1",
    "meta",
    "mps",
    "gpu",
    "",
    "cpu:-1",
    " cpu",
    "cuda:0:1",
]


@pytest.mark.parametrize("name", DEVICE_NAMES, ids=[repr(name) for name in DEVICE_NAMES])
def test_engine_config_accepts_exactly_the_device_names_torch_accepts(name):
    if torch_accepts(name):
        assert EngineConfig(device=name).device == name
    else:
        with pytest.raises(ValueError, match=f"device must be 'auto' or a torch device .*got {name!r}"):
            EngineConfig(device=name)


def test_engine_config_takes_auto_and_a_torch_device_object():
    assert EngineConfig(device="auto").device == "auto"
    assert EngineConfig(device=torch.device("cpu", 0)).device == "cpu:0"


def test_importing_the_config_does_not_import_torch():
    """config.py imports torch only to check a device name: the settings stay cheap to import."""
    import subprocess
    import sys

    # mini_vllm/__init__ imports the engine (and torch): load the package's modules without it.
    code = (
        "import sys, types; sys.modules['mini_vllm'] = types.ModuleType('mini_vllm'); "
        "sys.modules['mini_vllm'].__path__ = [sys.argv[1]]; "
        "import mini_vllm.config as c; c.EngineConfig(device='auto'); print('torch' in sys.modules)"
    )
    package = Path(__file__).resolve().parents[2] / "mini_vllm"
    done = subprocess.run([sys.executable, "-c", code, str(package)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_the_engine_runs_on_every_cpu_spelling(device, reference):
    llm = LLM(num_blocks=32, device=device)
    assert llm.llm_engine.device == torch.device(device)
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == reference
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("device", ["meta", "mps", "xpu:0"])
def test_a_torch_device_the_engine_cannot_run_on_is_a_clear_value_error(device, monkeypatch):
    def no_model_load(*args, **kwargs):  # the refusal comes before anything is loaded
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mini_vllm.llm_engine.load_model", no_model_load)
    assert EngineConfig(device=device).device == device  # a valid name ...
    with pytest.raises(
        ValueError, match=f"device={device!r} is a torch device, but mini-vLLM runs only on cpu or cuda"
    ):
        LLM(device=device)  # ... that the engine refuses to run on


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_device_cuda_without_cuda_is_a_clear_value_error(device):
    with pytest.raises(ValueError, match=f"device={device!r}, but CUDA is not available here"):
        LLM(device=device)


def test_resolve_device():
    from mini_vllm.llm_engine import resolve_device

    assert resolve_device("cpu:0") == torch.device("cpu", 0)
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be 'auto' or a torch device"):
        resolve_device("gpu")  # called directly, it checks the name too


def test_a_model_folder_without_tokenizer_files_is_refused_at_construction(tmp_path):
    source = Path(default_model_path())
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"}
    for path in source.iterdir():
        if path.name not in tokenizer_files and path.is_file():
            os.symlink(path, tmp_path / path.name)
    with pytest.raises(ValueError, match="has no tokenizer files"):
        LLMEngine(str(tmp_path), EngineConfig(device="cpu", num_blocks=8))


def test_an_empty_cache_salt_is_no_salt_as_in_vllm(llm):
    """vLLM's offline ``LLM`` treats ``cache_salt=""`` as no salt: the request shares the unsalted cache."""
    prompt_ids = list(range(3, 3 + 40))  # two full 16-token blocks and a tail
    llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": prompt_ids}], GREEDY)
    empty = llm.generate([{"prompt_token_ids": prompt_ids, "cache_salt": ""}], GREEDY)[0]
    salted = llm.generate([{"prompt_token_ids": prompt_ids, "cache_salt": "tenant-a"}], GREEDY)[0]
    assert empty.num_cached_tokens == 32
    assert salted.num_cached_tokens == 0


@pytest.mark.parametrize("prompts", [None, 123, np.array([1, 2, 3]), range(3)], ids=["None", "int", "array", "range"])
def test_prompts_that_are_not_a_prompt_or_a_list_are_refused_by_type(llm, reference, prompts):
    with pytest.raises(TypeError, match="prompts must be a str, a dict or a list of them, got"):
        llm.generate(prompts, GREEDY)
    assert_untouched_and_serving(llm, reference)


def test_a_model_folder_that_does_not_exist_or_has_no_config_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path))


def test_vllm_sampling_settings_this_engine_lacks_say_so_and_their_neutral_values_pass(llm, reference):
    """Code written for vLLM: a setting mini-vLLM lacks is a ValueError naming it, not Python's
    "unexpected keyword argument"; vLLM's default value of such a setting asks for nothing and passes."""
    for name, value in (("prompt_logprobs", 1), ("presence_penalty", 0.5), ("bad_words", ["x"]), ("min_tokens", 3)):
        with pytest.raises(ValueError, match=rf"{name}=.*mini-vLLM does not implement it"):
            SamplingParams(max_tokens=4, **{name: value})
    neutral = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=None, presence_penalty=0.0, repetition_penalty=1.0
    )
    assert neutral == GREEDY
    with pytest.raises(ValueError, match="skip_special_tokens=1"):  # 1 is not vLLM's True
        SamplingParams(skip_special_tokens=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):  # a typo stays Python's error
        SamplingParams(temprature=0)
    out = llm.generate([PROMPT], neutral)[0]
    assert out.outputs[0].token_ids == reference and out.finished  # vLLM's RequestOutput.finished
    assert out.outputs[0].cumulative_logprob is None and out.outputs[0].logprobs is None  # as vLLM without logprobs
    assert_untouched_and_serving(llm, reference)


def test_chat_takes_an_assistant_message_with_null_or_no_content_as_vllm_does(llm):
    """OpenAI lets an assistant message have no content; vLLM renders it as empty. Other roles still need it."""

    def conversation(assistant):
        return [{"role": "user", "content": "hi"}, assistant, {"role": "user", "content": "A story."}]

    empty = llm.chat(conversation({"role": "assistant", "content": ""}), GREEDY)[0].prompt_token_ids
    assert llm.chat(conversation({"role": "assistant", "content": None}), GREEDY)[0].prompt_token_ids == empty
    assert llm.chat(conversation({"role": "assistant"}), GREEDY)[0].prompt_token_ids == empty
    with pytest.raises(TypeError, match="message 1: 'content' must be a str"):
        llm.chat(conversation({"role": "user", "content": None}), GREEDY)
    assert_nothing_leaked(llm)


def test_chat_takes_openai_style_text_parts_as_vllm_does(llm):
    text = [{"role": "user", "content": "Tell me a story.\nAbout a fox."}]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Tell me a story."}, {"type": "text", "text": "About a fox."}],
        }
    ]
    assert llm.chat(parts, GREEDY)[0].prompt_token_ids == llm.chat(text, GREEDY)[0].prompt_token_ids
    with pytest.raises(TypeError, match="message 0: content part 1 must be"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}], GREEDY)
    assert_nothing_leaked(llm)


def test_vllms_kv_cache_settings_are_checked_and_reach_serve():
    import argparse

    from mini_vllm.config import EngineConfig
    from mini_vllm.entrypoints.openai.cli_args import engine_settings, make_arg_parser

    assert EngineConfig().prefix_cache_retention_interval == 0 and not EngineConfig().disable_hybrid_kv_cache_manager
    EngineConfig(prefix_cache_retention_interval=None)
    with pytest.raises(TypeError, match="prefix_cache_retention_interval"):
        EngineConfig(prefix_cache_retention_interval="64")
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        EngineConfig(prefix_cache_retention_interval=-16)
    with pytest.raises(TypeError, match="disable_hybrid_kv_cache_manager"):
        EngineConfig(disable_hybrid_kv_cache_manager=1)
    parser = make_arg_parser(argparse.ArgumentParser())
    settings = engine_settings(parser.parse_args(["--prefix-cache-retention-interval", "None"]))
    assert settings["prefix_cache_retention_interval"] is None and not settings["disable_hybrid_kv_cache_manager"]
    settings = engine_settings(
        parser.parse_args(["--prefix-cache-retention-interval", "64", "--disable-hybrid-kv-cache-manager"])
    )
    assert settings["prefix_cache_retention_interval"] == 64 and settings["disable_hybrid_kv_cache_manager"]
    assert engine_settings(parser.parse_args([]))["prefix_cache_retention_interval"] == 0


def test_num_gpu_blocks_override_counts_blocks_as_vllm_does_its_null_block_included(capsys):
    """``vllm serve --num-gpu-blocks-override N`` keeps block 0 as its null block: N - 1 blocks hold K/V, and the same
    flag gives mini-vLLM's server the same usable pool (``EngineConfig.num_blocks`` N - 1)."""
    import argparse

    from mini_vllm.entrypoints.openai.cli_args import engine_settings, make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser())
    assert engine_settings(parser.parse_args(["--num-gpu-blocks-override", "64"]))["num_blocks"] == 63
    assert "num_blocks" not in engine_settings(parser.parse_args([]))
    for bad in ("1", "0", "-3", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--num-gpu-blocks-override", bad])
    err = capsys.readouterr().err
    assert "must be at least 2 (block 0 is vLLM's null block), got 1" in err and "must be an integer, got 'many'" in err
