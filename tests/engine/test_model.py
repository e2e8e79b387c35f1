"""mini-vLLM's model == Hugging Face transformers, over a paged KV cache.

Oracles, not examples: the same checkpoint through ``transformers`` and through
``mini_vllm.model`` must give the same logits (max abs difference < 1e-4 in
float32) for a prefill, for decode steps over the paged cache, for a mixed
batch, and for a prefill over a cached prefix. Tiny random Llama and Qwen2
checkpoints (untied embeddings, q/k/v biases, sharded files) cover the other
families; the bundled default model (a tiny Qwen3) covers GQA, q/k norms and
tied embeddings, plus its tokenizer and the quality of its stories.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch a model hub

import pytest
import torch
import transformers

from mini_vllm.attention import AttentionMetadata, TorchAttentionBackend
from mini_vllm.course.one_sequence import contiguous_kv_cache, run_model
from mini_vllm.model import SUPPORTED_ARCHITECTURES, ModelConfig, default_model_path, load_model

ATOL = 1e-4
BLOCK_SIZE = 16


# --------------------------------------------------------------------------- #
# A hand-built paged cache: what the engine's model runner does, in 40 lines
# --------------------------------------------------------------------------- #


class PagedCache:
    """KV cache tensors for every layer plus per-sequence block tables.

    Blocks are handed out from a *shuffled* free list, so a sequence's blocks
    are scattered through the pool: a model that ignored the block table
    (reading the cache as if contiguous) would fail these tests.
    """

    def __init__(self, config: ModelConfig, num_blocks: int = 96, seed: int = 0) -> None:
        shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]):
        """Schedule ``(seq_id, new_token_ids)`` for each sequence; returns the model's inputs."""
        input_ids, positions, slots, seq_lens, cu = [], [], [], [], [0]
        for seq, new_ids in chunks:
            table = self.block_tables.setdefault(seq, [])
            start = self.num_computed.get(seq, 0)
            end = start + len(new_ids)
            while len(table) * BLOCK_SIZE < end:  # allocate blocks for the new tokens
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            input_ids += new_ids
            positions += range(start, end)
            seq_lens.append(end)
            cu.append(cu[-1] + len(new_ids))
            self.num_computed[seq] = end
        width = max(len(self.block_tables[seq]) for seq, _ in chunks)
        tables = [self.block_tables[seq] + [0] * (width - len(self.block_tables[seq])) for seq, _ in chunks]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            max_query_len=max(len(ids) for _, ids in chunks),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(input_ids), torch.tensor(positions), metadata


def run(model, cache: PagedCache, chunks: list[tuple[str, list[int]]]) -> torch.Tensor:
    """Logits ``[num_new_tokens, vocab]`` of one packed forward over the paged cache."""
    input_ids, positions, metadata = cache.step(chunks)
    with torch.no_grad():
        return model.compute_logits(model(input_ids, positions, cache.kv_caches, metadata))


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    diff = (ours - theirs).abs().max().item()
    assert diff < ATOL, f"max abs logit difference {diff:.2e} >= {ATOL}"


# --------------------------------------------------------------------------- #
# The bundled default model (Qwen3: GQA, q/k norms, tied embeddings)
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def default_models():
    path = default_model_path()
    ours = load_model(path, attn_backend=TorchAttentionBackend())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, theirs


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def chat_ids(tokenizer) -> list[int]:
    """A real chat prompt: a long system prompt from prompts.json and a story request."""
    prompts = json.loads((Path(default_model_path()) / "prompts.json").read_text())
    messages = [
        {"role": "system", "content": prompts["system_prompts"][0]},
        {"role": "user", "content": "Tell me a story about a brave dog named Leo."},
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_default_model_config_is_qwen3_with_gqa_and_tied_embeddings():
    config = ModelConfig.from_pretrained(default_model_path())
    assert config.architecture == "Qwen3ForCausalLM"
    assert config.num_kv_heads < config.num_heads  # GQA is exercised
    assert config.qk_norm and config.tie_word_embeddings and not config.qkv_bias


def test_prefill_and_decode_logits_match_transformers(default_models, chat_ids):
    ours, theirs = default_models
    cache = PagedCache(ours.config)
    ids = list(chat_ids)
    assert len(ids) > 5 * BLOCK_SIZE  # the prompt spans many scattered blocks
    assert_close(run(ours, cache, [("a", ids)]), hf_logits(theirs, ids))
    # Decode: one token at a time over the cache; transformers recomputes the
    # whole growing sequence each time, so its answer does not depend on any cache.
    next_id = int(run(ours, PagedCache(ours.config), [("x", ids)])[-1].argmax())
    for _ in range(6):
        ids.append(next_id)
        logits = run(ours, cache, [("a", [next_id])])
        assert logits.shape[0] == 1
        assert_close(logits[0], hf_logits(theirs, ids)[-1])
        next_id = int(logits[0].argmax())


def test_chapter01_one_sequence_forward_matches_transformers_and_the_paged_cache(default_models, chat_ids):
    """Chapter 01's ``run_model`` over a contiguous cache: prefill, then decode steps, as the exercise does."""
    ours, theirs = default_models
    ids = list(chat_ids)
    kv_caches = contiguous_kv_cache(ours.config, len(ids) + 3)
    prefill = run_model(ours, kv_caches, ids, list(range(len(ids))), seq_len=len(ids), all_logits=True)
    assert_close(prefill, run(ours, PagedCache(ours.config), [("a", ids)]))  # scattered blocks, same logits
    next_id = int(prefill[-1].argmax())
    for _ in range(3):
        ids.append(next_id)
        logits = run_model(ours, kv_caches, [next_id], [len(ids) - 1], seq_len=len(ids))
        assert logits.shape == (ours.config.vocab_size,)
        assert_close(logits, hf_logits(theirs, ids)[-1])
        next_id = int(logits.argmax())
    # A decode step that reads one token too few (seq_len off by one) differs: the comparison can fail.
    short = run_model(ours, kv_caches, [ids[-1]], [len(ids) - 1], seq_len=len(ids) - 1)
    assert (short - hf_logits(theirs, ids)[-1]).abs().max().item() > ATOL


def test_mixed_batch_equals_one_by_one(default_models, chat_ids, tokenizer):
    """A prefill and a decode packed in one forward == each run on its own."""
    ours, _ = default_models
    other = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about Mia the curious cat."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    # Separately: sequence B prefill then one decode step; sequence A prefill.
    alone = PagedCache(ours.config, seed=1)
    run(ours, alone, [("b", other)])
    b_decode_alone = run(ours, alone, [("b", [17])])
    a_prefill_alone = run(ours, PagedCache(ours.config, seed=2), [("a", chat_ids)])
    # Together: B is prefilled first, then A's prefill and B's decode share a step.
    together = PagedCache(ours.config, seed=3)
    run(ours, together, [("b", other)])
    mixed = run(ours, together, [("a", chat_ids), ("b", [17])])
    assert mixed.shape[0] == len(chat_ids) + 1
    assert_close(mixed[: len(chat_ids)], a_prefill_alone)
    assert_close(mixed[len(chat_ids) :], b_decode_alone)


def test_prefill_over_cached_prefix_equals_full_prefill(default_models, chat_ids):
    """32 tokens first, the rest as a second chunk over them == one full prefill."""
    ours, theirs = default_models
    full = run(ours, PagedCache(ours.config, seed=4), [("a", chat_ids)])
    cache = PagedCache(ours.config, seed=5)
    run(ours, cache, [("a", chat_ids[:32])])
    rest = run(ours, cache, [("a", chat_ids[32:])])
    assert_close(rest, full[32:])
    assert_close(rest[-1], hf_logits(theirs, chat_ids)[-1])


def test_load_model_casts_to_dtype_and_freezes():
    model = load_model(default_model_path(), dtype=torch.bfloat16, attn_backend=TorchAttentionBackend())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    assert not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after loading


def test_stacked_projections_compute_the_checkpoints_separate_projections():
    """qkv_proj and gate_up_proj, stacked at load, give what q/k/v_proj and gate/up_proj give apart."""
    from safetensors.torch import load_file

    checkpoint = load_file(str(Path(default_model_path()) / "model.safetensors"))
    model = load_model(default_model_path(), attn_backend=TorchAttentionBackend())
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(model.model.layers):
        ckpt = {
            name.removeprefix(f"model.layers.{i}."): t
            for name, t in checkpoint.items()
            if name.startswith(f"model.layers.{i}.")
        }
        attn = layer.self_attn
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        for got, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
            torch.testing.assert_close(got, torch.nn.functional.linear(x, ckpt[f"self_attn.{name}.weight"]))
        gate, up = (torch.nn.functional.linear(x, ckpt[f"mlp.{name}.weight"]) for name in ("gate_proj", "up_proj"))
        expected = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, ckpt["mlp.down_proj.weight"])
        torch.testing.assert_close(layer.mlp(x), expected)


@pytest.mark.parametrize(
    "stacked, right",
    [
        ((("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))), True),
        # Known-wrong stacking orders: same shapes (k and v have as many rows), wrong numbers.
        ((("qkv_proj", ("q_proj", "v_proj", "k_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))), False),
        ((("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("up_proj", "gate_proj"))), False),
    ],
)
def test_a_wrong_stacking_order_is_caught_by_the_transformers_comparison(
    default_models, chat_ids, monkeypatch, stacked, right
):
    import mini_vllm.model

    monkeypatch.setattr(mini_vllm.model, "STACKED_PARAMS", stacked)
    ours = load_model(default_model_path(), attn_backend=TorchAttentionBackend())
    diff = (run(ours, PagedCache(ours.config), [("a", chat_ids)]) - hf_logits(default_models[1], chat_ids)).abs().max()
    assert (diff < ATOL) if right else (diff > 1.0), f"max abs logit difference {diff:.2e}"


# --------------------------------------------------------------------------- #
# Other families: tiny random checkpoints made by transformers itself
# --------------------------------------------------------------------------- #


def _tiny_config(family: str):
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        dtype=torch.float32,
    )
    if family == "llama":  # untied, biases everywhere (attention_bias covers o_proj too)
        return transformers.LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    if family == "qwen2":  # q/k/v biases, untied
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    return transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=True)


def _randomize(hf_model) -> None:
    """Random everything (std 0.2), so biases and norm weights are not 0 / 1 and logits not ~0."""
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_random_checkpoint_matches_transformers(family, tmp_path):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(_tiny_config(family)).eval()
    _randomize(hf_model)
    # Small shards: the loader must gather weights from several files.
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    ours = load_model(tmp_path, attn_backend=TorchAttentionBackend())
    assert ours.config.architecture == type(hf_model).__name__
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = PagedCache(ours.config)
    assert_close(run(ours, cache, [("a", ids[:37])]), hf_logits(hf_model, ids[:37]))
    for t in range(37, 40):  # decode steps over the cache
        assert_close(run(ours, cache, [("a", [ids[t]])])[0], hf_logits(hf_model, ids[: t + 1])[-1])


def test_unsupported_architecture_is_rejected(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_model(tmp_path)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}},
        {"rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 4.0}},
    ],
)
def test_unimplemented_rope_scaling_is_rejected_not_ignored(rope):
    config = _tiny_config("llama").to_dict()
    config.pop("rope_parameters")
    config.update(rope)
    with pytest.raises(ValueError, match="RoPE"):
        ModelConfig.from_dict(config)


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_scaled_rope_matches_transformers(scaling, tmp_path):
    """Llama 3.x checkpoints use "llama3" RoPE scaling: same logits as transformers, past 64 tokens."""
    torch.manual_seed(0)
    config = _tiny_config("llama")
    config.rope_parameters = {**scaling, "rope_theta": 5000.0}
    hf_model = transformers.LlamaForCausalLM(config).eval()
    _randomize(hf_model)
    hf_model.save_pretrained(tmp_path)
    ours = load_model(tmp_path, attn_backend=TorchAttentionBackend())
    assert ours.config.rope_scaling["rope_type"] == scaling["rope_type"]
    ids = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_close(run(ours, PagedCache(ours.config), [("a", ids)]), hf_logits(hf_model, ids))


def test_legacy_rope_theta_is_read():
    config = _tiny_config("qwen2").to_dict()
    config.pop("rope_parameters")
    config["rope_theta"] = 1234.0
    assert ModelConfig.from_dict(config).rope_theta == 1234.0


# --------------------------------------------------------------------------- #
# Tokenizer and quality of the default model
# --------------------------------------------------------------------------- #


def test_tokenizer_loads_offline_with_a_qwen_style_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a story about a brave dog named Leo."},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nTell me a story about a brave dog named Leo.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    config = ModelConfig.from_pretrained(default_model_path())
    assert config.eos_token_id == tokenizer.eos_token_id


def test_prompts_json_has_long_system_prompts(tokenizer):
    prompts = json.loads((Path(default_model_path()) / "prompts.json").read_text())
    lengths = [len(tokenizer(s)["input_ids"]) for s in prompts["system_prompts"]]
    assert len(lengths) >= 4 and all(200 <= n <= 600 for n in lengths), lengths
    assert len(prompts["user_requests"]) >= 10


@pytest.mark.parametrize(
    "request_text, name, animal",
    [
        ("Tell me a story about a brave dog named Leo.", "Leo", "dog"),
        ("Can you tell me a story about a curious owl called Ruby who lives by the river?", "Ruby", "owl"),
        ("Tell me a story about Felix the sleepy turtle.", "Felix", "turtle"),
    ],
)
def test_greedy_story_uses_the_requested_name_and_animal(default_models, tokenizer, request_text, name, animal):
    _, theirs = default_models
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": request_text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    out = theirs.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=160)
    story = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert out[0, -1] == tokenizer.eos_token_id, story  # it ends by itself
    assert name in story and animal in story, story
