"""``SamplingParams(logprobs=k)``: each generated token's log-probability, and the k most likely tokens'.

As vLLM's: from the model's raw logits (before temperature, top-k, top-p), a ``Logprob`` with the
token's rank and its decoded text, the generated token first, and ``cumulative_logprob`` their
sum. Checked against ``transformers`` running the same checkpoint on the whole sequence at once
(no cache), and, when ``make vllm`` has installed it, against vLLM on the same requests.
"""

from __future__ import annotations

import pytest
import torch

from mini_vllm import LLM, SamplingParams
from mini_vllm.model import default_model_path
from mini_vllm.tools.compare_vllm import run_mini, run_vllm, vllm_missing_reason, vllm_python
from prerequisites import missing

TOP = 3


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", block_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def transformers_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()


def reference_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each generated token's position: ``[len(generated), vocab]``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOP),
        SamplingParams(temperature=1.5, top_k=5, seed=7, max_tokens=8, ignore_eos=True, logprobs=TOP),
    ],
    ids=["greedy", "sampled: raw logprobs, not the tempered ones"],
)
def test_logprobs_are_the_models_log_softmax_with_ranks_and_decoded_tokens(llm, transformers_model, params):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("Once upon a time, in a small village,")
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    reference = reference_logprobs(transformers_model, prompt, out.token_ids)
    for position, (token, entries) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[position]
        top = row.topk(TOP).indices.tolist()
        assert list(entries)[0] == token  # the generated token first, as vLLM's
        assert set(entries) == {token, *top}
        for token_id, entry in entries.items():
            assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
            assert entry.rank == int((row > row[token_id]).sum()) + 1
            assert entry.decoded_token == tokenizer.decode([token_id])
        if params.temperature == 0:
            assert entries[token].rank == 1
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_logprobs_zero_gives_the_generated_token_alone_and_none_gives_none(llm):
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("Hello there")}
    only = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=0), use_tqdm=False)[0]
    assert [list(entries) for entries in only.outputs[0].logprobs] == [[t] for t in only.outputs[0].token_ids]
    none = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert none.outputs[0].logprobs is None and none.outputs[0].cumulative_logprob is None
    assert none.outputs[0].token_ids == only.outputs[0].token_ids  # asking for them changes nothing else


def test_each_of_n_completions_has_its_own_logprobs(llm):
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("The cat")}
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, logprobs=1)
    completions = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert len(completions) == 3
    for completion in completions:
        assert [next(iter(entries)) for entries in completion.logprobs] == completion.token_ids
    assert len({c.cumulative_logprob for c in completions}) > 1


@pytest.mark.vllm
def test_the_generated_tokens_logprobs_equal_vllms():
    if vllm_python() is None:
        missing("vllm", vllm_missing_reason())  # fails under CI (tests/prerequisites.py)
    llm_tokenizer = LLM(device="cpu").get_tokenizer()
    prompts = [{"prompt_token_ids": llm_tokenizer.encode(text)} for text in ("Once upon a time", "The little fox")]
    sampling = {"temperature": 0.0, "max_tokens": 8, "n": 1, "logprobs": 0, "ignore_eos": True}
    spec = {
        "block_size": 32,
        "num_blocks": 64,
        "workloads": [{"name": "logprobs", "calls": [{"prompts": prompts, "sampling": sampling}]}],
    }
    ours = run_mini(None, [spec])[0]["workloads"][0]["requests"]
    theirs = run_vllm(str(default_model_path()), [spec])["engines"][0]["workloads"][0]["requests"]
    for mine, vllm in zip(ours, theirs, strict=True):
        assert mine["token_ids"] == vllm["token_ids"]
        gaps = [abs(a - b) for a, b in zip(mine["logprobs"][0], vllm["logprobs"][0], strict=True)]
        assert max(gaps) < 1e-3, (mine["logprobs"], vllm["logprobs"])
