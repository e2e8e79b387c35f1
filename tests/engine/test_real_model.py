"""mini-vLLM on a real pretrained model: SmolLM2-135M-Instruct (``make real-model``).

The same oracles as ``test_model.py`` and ``test_engine*.py``, on a model people
use (a Llama: 30 layers, 9 query / 3 KV heads, tied embeddings, RoPE base 1e5,
a 49 152-token vocabulary, ChatML): mini-vLLM's logits == transformers' logits,
and greedy tokens are identical with and without prefix caching, batched and
alone, on the torch backend and on the Triton kernels (interpreted on a CPU,
so the Triton prompts and token counts are tiny).

Tolerance of the logit comparison, float32: ``ATOL = 1e-3``. Both sides compute
the same float32 arithmetic in a different order (matmul blocking, attention
over a paged cache vs SDPA over a dense one), which differs by a few ulps per
operation; through 30 residual layers this grows to the ~6e-5 measured here, on
logits as large as ~37 (a relative 2e-6). 1e-3 keeps 15x headroom over that,
while real mistakes move the logits by whole units: the known-wrong variant
below (RoPE base 1e4, Llama's usual default, instead of this checkpoint's 1e5)
is off by more than 1, and so would be a shifted position, a wrong GQA head
mapping or a missing norm. (``test_model.py`` uses 1e-4 on the 4-layer bundled
model, whose logits are small.)

When the model is not installed the tests skip and say how to get it; ``make
test`` installs it first, so there they always run, and under CI (``CI=true``)
a missing model fails them (tests/prerequisites.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch a model hub

import pytest
import torch
import transformers

from mini_vllm import kernels
from mini_vllm import LLM, SamplingParams
from mini_vllm.attention import TorchAttentionBackend
from mini_vllm.model import RotaryEmbedding, load_model, rope_inv_freq
from mini_vllm.tools.real_model import (
    ENV_VAR,
    GGUF_SHA256,
    HOW_TO_GET,
    PROVENANCE_FILE,
    default_install_dir,
    is_complete,
    real_model_path,
    reference_result,
)
from prerequisites import skip_if_missing
from test_model import PagedCache, hf_logits, run

ATOL = 1e-3

REAL_MODEL = real_model_path()
needs_real_model = skip_if_missing(REAL_MODEL is None, "real-model", HOW_TO_GET)  # fails under CI

# Long enough that the system prompt fills two whole 16-token blocks: the
# questions below share them, so prefix caching has something to hit.
SYSTEM = (
    "You are a concise assistant for a geography quiz. Answer every question with one "
    "short sentence, never use lists, and do not add any explanation."
)
QUESTIONS = ["What is the capital of France?", "What is the capital of Italy?", "Name a primary color."]


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


# --------------------------------------------------------------------------- #
# real_model_path(): the folder, the override, the "not installed" answer
# --------------------------------------------------------------------------- #


def test_real_model_path_follows_the_environment_override(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(ValueError, match=ENV_VAR):  # a folder without config.json is refused, by name
        real_model_path()
    (tmp_path / "config.json").write_text("{}")
    assert real_model_path() == str(tmp_path.resolve())
    monkeypatch.setenv(ENV_VAR, "")
    assert real_model_path() in (None, str(default_install_dir()))


def test_a_half_written_folder_is_not_installed(tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    assert not is_complete(tmp_path)  # the provenance file is written last
    (tmp_path / PROVENANCE_FILE).write_text("{}")
    assert is_complete(tmp_path)


def test_how_to_get_it_names_the_command():
    assert "make real-model" in HOW_TO_GET and ENV_VAR in HOW_TO_GET


# What the notebooks' real-model cells show when the model is not installed.
NOTEBOOK_REFERENCE_RESULTS = ["00_chat", "04_token_traps", "09_tips", "10_shared_prefix"]


@pytest.mark.parametrize("name", NOTEBOOK_REFERENCE_RESULTS)
def test_every_real_model_cell_has_a_committed_result_to_fall_back_on(name):
    assert reference_result(name)


def test_an_unknown_reference_result_is_an_error_that_lists_the_known_ones():
    with pytest.raises(KeyError, match="04_token_traps"):
        reference_result("no such result")


# --------------------------------------------------------------------------- #
# The converted folder
# --------------------------------------------------------------------------- #


@needs_real_model
def test_folder_is_a_float32_llama_with_provenance_and_chat_template():
    path = Path(REAL_MODEL)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert "quantization_config" not in config  # transformers would treat it as quantized again
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    provenance = json.loads((path / PROVENANCE_FILE).read_text())
    assert provenance["license"] == "Apache-2.0" and provenance["source_sha256"] == GGUF_SHA256
    assert "Apache License" in (path / "LICENSE").read_text()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- #
# Logits: mini-vLLM == transformers
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def models():
    ours = load_model(REAL_MODEL, attn_backend=TorchAttentionBackend())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(REAL_MODEL, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(REAL_MODEL)
    return ours, theirs, tokenizer


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return (ours - theirs).abs().max().item()


@needs_real_model
def test_prefill_decode_and_cached_prefix_logits_match_transformers(models):
    ours, theirs, tokenizer = models
    ids = chat_ids(tokenizer, QUESTIONS[0])
    assert len(ids) > 2 * 16  # spans several scattered blocks
    cache = PagedCache(ours.config)
    diff = max_diff(run(ours, cache, [("a", ids)]), hf_logits(theirs, ids))
    assert diff < ATOL, f"prefill: max abs logit difference {diff:.2e} >= {ATOL}"
    # Decode over the paged cache, one token at a time; transformers recomputes everything.
    for _ in range(3):
        next_id = int(hf_logits(theirs, ids)[-1].argmax())
        ids = ids + [next_id]
        diff = max_diff(run(ours, cache, [("a", [next_id])])[0], hf_logits(theirs, ids)[-1])
        assert diff < ATOL, f"decode: max abs logit difference {diff:.2e} >= {ATOL}"
    # A second prompt that reuses the first's two system-prompt blocks: prefill
    # only its own tokens over those cached blocks (what a prefix hit does).
    other = chat_ids(tokenizer, QUESTIONS[1])
    shared = 32
    assert other[:shared] == ids[:shared]
    cache.block_tables["b"] = cache.block_tables["a"][:2]
    cache.num_computed["b"] = shared
    diff = max_diff(run(ours, cache, [("b", other[shared:])]), hf_logits(theirs, other)[shared:])
    assert diff < ATOL, f"prefill over a cached prefix: max abs logit difference {diff:.2e} >= {ATOL}"


@needs_real_model
def test_the_tolerance_catches_a_wrong_rope_base(models):
    """The known-wrong variant: RoPE base 1e4 instead of the checkpoint's 1e5 (a config
    parser that missed ``rope_parameters`` would do this). It must fail the comparison."""
    ours, theirs, tokenizer = models
    ids = chat_ids(tokenizer, QUESTIONS[0])
    rotaries = [m for m in ours.modules() if isinstance(m, RotaryEmbedding)]
    right = [m.inv_freq for m in rotaries]
    try:
        for m in rotaries:
            m.inv_freq = rope_inv_freq(ours.config.head_dim, 10000.0)
        diff = max_diff(run(ours, PagedCache(ours.config), [("a", ids)]), hf_logits(theirs, ids))
    finally:
        for m, inv_freq in zip(rotaries, right):
            m.inv_freq = inv_freq
    assert diff > 1.0 > ATOL


# --------------------------------------------------------------------------- #
# Greedy generation: caching on == off, batched == alone == transformers
# --------------------------------------------------------------------------- #

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def transformers_greedy(models) -> list[list[int]]:
    """transformers' own greedy tokens, one prompt at a time (no cache of ours involved)."""
    _, theirs, tokenizer = models
    expected = []
    for question in QUESTIONS:
        ids = chat_ids(tokenizer, question)
        with torch.no_grad():
            out = theirs.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tokenizer.eos_token_id,
            )
        expected.append(out[0, len(ids) :].tolist())
    return expected


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int, batched: bool):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": ids} for ids in prompts]
    if batched:
        return llm.generate(requests, params)
    return [llm.generate([request], params)[0] for request in requests]


@needs_real_model
@pytest.mark.parametrize("enable_prefix_caching", [False, True], ids=["caching_off", "caching_on"])
def test_torch_backend_greedy_equals_transformers_batched_and_alone(models, transformers_greedy, enable_prefix_caching):
    _, _, tokenizer = models
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    llm = LLM(
        REAL_MODEL,
        dtype="float32",
        attention_backend="torch",
        num_blocks=64,
        enable_prefix_caching=enable_prefix_caching,
    )
    alone = greedy(llm, prompts, MAX_TOKENS, batched=False)
    batched = greedy(llm, prompts, MAX_TOKENS, batched=True)
    assert [o.outputs[0].token_ids for o in alone] == transformers_greedy
    assert [o.outputs[0].token_ids for o in batched] == transformers_greedy
    assert "Paris" in alone[0].outputs[0].text  # a real model: it knows the answer
    cached = [o.num_cached_tokens for o in alone + batched]
    if enable_prefix_caching:
        # Alone: the 2nd and 3rd question hit the system prompt's 2 blocks; batched:
        # every prompt hits what the first round left in the cache.
        assert cached[1] >= 32 and cached[2] >= 32 and min(cached[3:]) >= 32
    else:
        assert cached == [0] * len(cached)
    llm.llm_engine.kv_cache_manager.check_invariants()


@needs_real_model
def test_cpu_backend_greedy_equals_transformers_batched_and_alone(models, transformers_greedy):
    """The CPU's fast path on a Llama: decode attention, RMSNorm, RoPE and SwiGLU's gate in C."""
    _, _, tokenizer = models
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    llm = LLM(REAL_MODEL, dtype="float32", attention_backend="cpu", num_blocks=64)
    assert llm.llm_engine.model_runner.model.model.norm.kernel is not None
    alone = greedy(llm, prompts, MAX_TOKENS, batched=False)
    batched = greedy(llm, prompts, MAX_TOKENS, batched=True)
    assert [o.outputs[0].token_ids for o in alone] == transformers_greedy
    assert [o.outputs[0].token_ids for o in batched] == transformers_greedy
    llm.llm_engine.kv_cache_manager.check_invariants()


# Raw text for the interpreted Triton run: short (19 tokens) and sharing one whole block.
TRITON_PREFIX = "The capital of France is Paris. The capital of Italy is Rome. The capital of"
TRITON_PROMPTS = [TRITON_PREFIX + " Spain is", TRITON_PREFIX + " Germany is"]


@needs_real_model
@pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="Triton is not installed")
def test_triton_backend_greedy_equals_transformers_batched_over_a_hit_then_alone(models):
    """Interpreted Triton runs 30 layers slowly (about 10 s a step on a CPU), so two
    short prompts, two tokens, three steps that cover every path: one batched prefill
    where the second prompt hits the first's block in the same step (prefill from
    scratch and over a cached prefix), one batched decode step (paged decode), then
    the first prompt alone again, over its cached block."""
    _, theirs, tokenizer = models
    prompts = [tokenizer.encode(text) for text in TRITON_PROMPTS]
    assert prompts[0][:16] == prompts[1][:16] and max(map(len, prompts)) < 2 * 16
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = theirs.generate(
                torch.tensor([ids]),
                max_new_tokens=2,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tokenizer.eos_token_id,
            )
        expected.append(out[0, len(ids) :].tolist())
    device = "cpu" if kernels.TRITON_INTERPRETED else "cuda"
    llm = LLM(REAL_MODEL, device=device, dtype="float32", attention_backend="triton", num_blocks=16)
    assert llm.llm_engine.model_runner.attn_backend.name == "triton"
    batched = greedy(llm, prompts, 2, batched=True)
    assert [o.outputs[0].token_ids for o in batched] == expected
    assert [o.num_cached_tokens for o in batched] == [0, 16]
    alone = greedy(llm, prompts[:1], 1, batched=False)[0]
    assert (alone.outputs[0].token_ids, alone.num_cached_tokens) == (expected[0][:1], 16)
    llm.llm_engine.kv_cache_manager.check_invariants()


# --------------------------------------------------------------------------- #
# python -m mini_vllm bench --model PATH
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("argv, expected_model", [(["--model", "models/x"], "models/x"), ([], None)])
def test_bench_model_option_sends_that_folder_to_every_benchmark(monkeypatch, tmp_path, argv, expected_model):
    from mini_vllm.tools.bench import cli as bench

    class Stop(Exception):
        pass

    seen = {}

    def run_benchmarks(settings, which, progress):  # stands in for the real run: records, then stops
        seen["settings"] = settings
        raise Stop

    monkeypatch.setattr(bench, "run_benchmarks", run_benchmarks)
    with pytest.raises(Stop):
        bench.main(argv + ["--quick", "--no-plots", "--json", str(tmp_path / "bench.json")])
    assert seen["settings"].model == expected_model
