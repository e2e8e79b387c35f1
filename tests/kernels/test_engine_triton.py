"""The engine on the Triton backend equals the torch reference backend.

On a CPU the kernels run in Triton's interpreter, which is slow: short prompts,
few tokens. On a GPU (TRITON_INTERPRET=0) the same test runs compiled.
"""

from __future__ import annotations

import pytest

from mini_vllm import kernels
from engine_invariants import assert_nothing_leaked
from mini_vllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="Triton is not installed")


def test_triton_backend_gives_the_same_greedy_outputs_as_torch():
    device = "cpu" if kernels.TRITON_INTERPRETED else "cuda"
    torch_llm = LLM(device=device, dtype="float32", num_blocks=64, attention_backend="torch")
    triton_llm = LLM(device=device, dtype="float32", num_blocks=64, attention_backend="triton")
    assert triton_llm.llm_engine.model_runner.attn_backend.name == "triton"
    tokenizer = torch_llm.get_tokenizer()
    shared = tokenizer.encode(
        "Once upon a time there was a little fox who lived near the river. Every morning the fox "
        "ran along the water, said hello to the ducks and looked for shiny stones in the sand."
    )
    assert len(shared) > 2 * 16  # at least two full blocks to share
    prompts = [
        {"prompt_token_ids": shared + tokenizer.encode(" One day the fox")},
        {"prompt_token_ids": shared + tokenizer.encode(" The fox had a friend")},
        {"prompt_token_ids": tokenizer.encode("Tell me a story about a cat.")},
    ]
    # Small token budget: the first prompt is prefilled in chunks, the others hit its
    # cached blocks, and decode steps run as mixed batches.
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, params)]
    got = triton_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert sum(o.num_cached_tokens for o in got) > 0
    assert_nothing_leaked(triton_llm)
