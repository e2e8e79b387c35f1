"""The bundled hybrid model (``mini_vllm/hybrid_model/``): its folder, transformers, and real vLLM.

Layers 0 and 2 are sliding-window attention (64 tokens, the query's own
included), layers 1 and 3 full attention. The tests check that

* the folder is the default model's with that attention layout (same tokenizer,
  chat template, generation config and prompts);
* transformers applies the window: its logits equal a hand-written forward
  with the same masks, and differ from the same weights with all layers full;
* real vLLM (``.venv-vllm``, ``model_impl="transformers"``) gives the same
  greedy tokens and log-probabilities as transformers on prompts ~4x longer
  than the window, builds one KV-cache group per kind of layer, and reports the
  prefix-cache hits ``training/check_hybrid_model.py`` explains. Without
  ``.venv-vllm`` these skip (a failure under CI: ``tests/prerequisites.py``).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from mini_vllm.tools.compare_vllm import vllm_missing_reason, vllm_python
from mini_vllm.model import default_model_path, hybrid_model_path
from prerequisites import missing
from training import check_hybrid_model as check

WINDOW = 64
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SAME_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "prompts.json",
)
ATTENTION_KEYS = {"layer_types", "sliding_window", "use_sliding_window"}


def _config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def test_the_folder_is_the_default_model_with_two_sliding_window_layers():
    hybrid, default = _config(hybrid_model_path()), _config(default_model_path())
    assert hybrid["layer_types"] == LAYER_TYPES
    assert hybrid["sliding_window"] == WINDOW and hybrid["use_sliding_window"] is True
    assert hybrid["dtype"] == "float32"
    # transformers ignores max_window_layers when layer_types is given; vLLM's native Qwen3
    # refuses mixed layer types unless it equals num_hidden_layers, and then runs every layer
    # with full attention. Kept at 28, a vLLM without model_impl="transformers" fails loudly.
    assert hybrid["max_window_layers"] != hybrid["num_hidden_layers"]
    differing = {k for k in hybrid.keys() | default.keys() if hybrid.get(k) != default.get(k)}
    assert differing == ATTENTION_KEYS
    for name in SAME_FILES:
        assert (Path(hybrid_model_path()) / name).read_bytes() == (Path(default_model_path()) / name).read_bytes(), name
    report = json.loads((Path(hybrid_model_path()) / "training_report.json").read_text())
    assert report["attention"] == {"layer_types": LAYER_TYPES, "sliding_window": WINDOW}
    assert report["init_from"] == "mini_vllm/default_model"
    from safetensors import safe_open

    with safe_open(str(Path(hybrid_model_path()) / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.float32}


# --------------------------------------------------------------------------- #
# transformers applies the window
# --------------------------------------------------------------------------- #


@torch.no_grad()
def manual_logits(model, ids: torch.Tensor, windows: list[int | None]) -> torch.Tensor:
    """The Qwen3 forward written out, attention and its masks by hand (``windows``: per layer,
    how many keys a query sees, its own included; None: all before it). Norms, projections and
    the MLP are the model's modules; the masks, RoPE and softmax attention are computed here."""
    cfg, inner = model.config, model.model
    n, head_dim = len(ids), cfg.head_dim
    num_heads, num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    theta = cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x):  # [heads, n, head_dim], rotate-half convention
        half = head_dim // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    query_pos, key_pos = torch.arange(n)[:, None], torch.arange(n)[None, :]
    hidden = inner.embed_tokens(ids)
    for layer, window in zip(inner.layers, windows):
        attn, x = layer.self_attn, layer.input_layernorm(hidden)
        q = rope(attn.q_norm(attn.q_proj(x).view(n, num_heads, head_dim)).transpose(0, 1))
        k = rope(attn.k_norm(attn.k_proj(x).view(n, num_kv_heads, head_dim)).transpose(0, 1))
        v = attn.v_proj(x).view(n, num_kv_heads, head_dim).transpose(0, 1)
        k = k.repeat_interleave(num_heads // num_kv_heads, 0)
        v = v.repeat_interleave(num_heads // num_kv_heads, 0)
        allowed = key_pos <= query_pos
        if window is not None:
            allowed &= query_pos - key_pos < window
        scores = (q @ k.transpose(1, 2) / math.sqrt(head_dim)).masked_fill(~allowed, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, num_heads * head_dim)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden))


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(2)
    hybrid, tokenizer = check.load()
    full, _ = check.load(all_full=True)
    return hybrid, full, tokenizer


@pytest.fixture(scope="module")
def input_200(models):
    _, _, tokenizer = models
    ids = check.greedy_prompts(tokenizer)[0][:200]
    assert len(ids) == 200
    return torch.tensor(ids)


def test_transformers_takes_the_layer_types_as_given(models):
    hybrid, full, _ = models
    assert hybrid.config.layer_types == LAYER_TYPES and hybrid.config.sliding_window == WINDOW
    assert [layer.self_attn.sliding_window for layer in hybrid.model.layers] == [WINDOW, None, WINDOW, None]
    assert [layer.self_attn.sliding_window for layer in full.model.layers] == [None] * 4


def test_transformers_applies_the_window_over_200_tokens(models, input_200):
    hybrid, full, _ = models
    with torch.no_grad():
        windowed = hybrid(input_200[None]).logits[0]
        unwindowed = full(input_200[None]).logits[0]
    # Up to position WINDOW - 1 a query sees everything anyway; after it the window cuts keys off.
    assert (windowed[:WINDOW] - unwindowed[:WINDOW]).abs().max().item() < 1e-4
    assert (windowed[WINDOW:] - unwindowed[WINDOW:]).abs().max().item() > 0.1
    # The hand-written forward: right without a window, right with it, and sensitive to one token of window.
    assert (manual_logits(full, input_200, [None] * 4) - unwindowed).abs().max().item() < 1e-4
    windows = [WINDOW if kind == "sliding_attention" else None for kind in LAYER_TYPES]
    assert (manual_logits(hybrid, input_200, windows) - windowed).abs().max().item() < 1e-4
    for off_by_one in (WINDOW - 1, WINDOW + 1):
        wrong = [off_by_one if w else None for w in windows]
        assert (manual_logits(hybrid, input_200, wrong) - windowed).abs().max().item() > 1e-3


# --------------------------------------------------------------------------- #
# real vLLM (its Transformers backend) against transformers
# --------------------------------------------------------------------------- #

LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def vllm_comparison():
    if vllm_python() is None:
        missing("vllm", vllm_missing_reason())
    torch.set_num_threads(2)
    _, tokenizer = check.load()
    return check.compare(check.run_vllm(check.vllm_job(tokenizer)))


def layer_index(name: str) -> int:
    """``model.layers.2.self_attn.attn`` -> 2."""
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


@pytest.mark.vllm
def test_vllm_builds_one_kv_cache_group_per_kind_of_layer(vllm_comparison):
    kv_cache = vllm_comparison["kv_cache"]
    assert kv_cache["coordinator"] == "HybridKVCacheCoordinator"
    groups = {g["spec"]: g for g in kv_cache["groups"]}
    assert set(groups) == {"SlidingWindowSpec", "FullAttentionSpec"}
    assert groups["SlidingWindowSpec"]["sliding_window"] == WINDOW
    assert [layer_index(name) for name in groups["SlidingWindowSpec"]["layers"]] == [0, 2]
    assert [layer_index(name) for name in groups["FullAttentionSpec"]["layers"]] == [1, 3]


@pytest.mark.vllm
def test_vllm_greedy_tokens_and_logprobs_equal_transformers(vllm_comparison):
    rows = vllm_comparison["greedy"]
    assert len(rows) == check.NUM_PROMPTS
    assert all(row["num_prompt_tokens"] > 4 * WINDOW for row in rows)
    assert all(row["num_generated"] > 10 for row in rows)
    assert [row["tokens_equal"] for row in rows] == [True] * len(rows)
    assert max(row["max_logprob_gap"] for row in rows) < LOGPROB_TOLERANCE
    # ... and the comparison can tell: without the window transformers is far from vLLM.
    assert min(row["max_logprob_gap_without_window"] for row in rows) > 10 * LOGPROB_TOLERANCE


@pytest.mark.vllm
def test_vllm_prefix_cache_hits_on_the_hybrid_model(vllm_comparison):
    cached, lengths = vllm_comparison["num_cached_tokens"], vllm_comparison["num_prompt_tokens"]
    block = check.BLOCK_SIZE
    # The same prompt twice: everything up to the replay boundary (the last prompt token is recomputed).
    first, second = cached["same_prompt_twice"]
    assert first == 0 and second == (lengths["same_prompt_twice"][1] - 1) // block * block
    # Two prompts sharing 250 tokens: the full-attention group has the shared blocks, but the
    # sliding-window group kept the first request's blocks only at its replay boundary (vLLM's
    # default prefix_cache_retention_interval=0), not at the junction: a request's hit is the
    # shortest of its groups' hits, so the second prompt misses.
    assert cached["shared_prefix_two"] == [0, 0]
    # The second request revealed the junction and vLLM kept the sliding group's blocks there:
    # a third prompt with the same prefix hits its whole blocks (224 of the 250 tokens).
    assert cached["shared_prefix_three"] == [0, 0, check.SHARED_PREFIX // block * block]


def test_with_the_hybrid_manager_off_every_layer_is_cached_as_full_attention_and_still_slides():
    """``disable_hybrid_kv_cache_manager``: one full-attention group of the four layers, every full block
    cached (the second prompt hits the 12 blocks it shares), and the same greedy tokens: the
    sliding-window layers still attend over their window only."""
    from mini_vllm import LLM, SamplingParams
    from mini_vllm.model import hybrid_model_path
    from mini_vllm.model_runner import kv_cache_bytes_per_block

    prompts = [{"prompt_token_ids": list(range(10, 305))}, {"prompt_token_ids": list(range(10, 210)) + [3] * 40}]
    params = SamplingParams(temperature=0, max_tokens=8)
    tokens, cached = {}, {}
    for off in (False, True):
        llm = LLM(hybrid_model_path(), device="cpu", block_size=16, num_blocks=60, disable_hybrid_kv_cache_manager=off)
        groups = llm.llm_engine.kv_cache_config.kv_cache_groups
        assert len(groups) == (1 if off else 2)
        # What one block takes, as the pool is sized from a memory budget: the tensors' own bytes per block.
        tensors = {id(key): (key, value) for key, value in llm.llm_engine.model_runner.kv_caches}.values()
        in_tensors = sum(key[0].nbytes + value[0].nbytes for key, value in tensors)
        assert llm.llm_engine._bytes_per_block() == in_tensors
        config = llm.llm_engine.model_config
        assert kv_cache_bytes_per_block(config, 16, torch.float32, disable_hybrid_kv_cache_manager=off) == in_tensors
        outputs = llm.generate(prompts, params)
        tokens[off] = [list(o.outputs[0].token_ids) for o in outputs]
        cached[off] = [o.num_cached_tokens for o in outputs]
    assert tokens[True] == tokens[False]
    assert cached[True] == [0, 12 * 16] and cached[False] == [0, 0]  # retention 0: no run at the junction yet
