"""The training pipeline of the default model: corpus, tokenization, shared-prefix loss, smoke run."""

from __future__ import annotations

import json
import os
import random
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from mini_vllm.attention import AttentionMetadata, TorchAttentionBackend
from mini_vllm.model import load_model
from training import corpus
from training.train_default_model import (
    TrainConfig,
    batch_loss,
    build_model,
    encode_example,
    main,
    make_batches,
    render,
    train_tokenizer,
)


def test_corpus_is_reproducible_and_stories_follow_the_request():
    first = corpus.make_corpus(200, seed=3)
    assert [ex.messages for ex in first] == [ex.messages for ex in corpus.make_corpus(200, seed=3)]
    assert [ex.messages for ex in first] != [ex.messages for ex in corpus.make_corpus(200, seed=4)]
    rng = random.Random(0)
    for _ in range(300):
        spec = corpus.random_spec(rng)
        text = corpus.story(spec, rng)
        assert spec.name in text and f" {spec.animal} " in text
        if spec.adjective:
            assert spec.adjective in text
        if spec.place:
            assert spec.place in text
        assert 3 <= len(re.findall(r"[.!?](?: |$)", text)) <= 6, text


def test_corpus_has_system_prompts_and_two_turn_chats():
    examples = corpus.make_corpus(300, seed=0)
    assert any(ex.system_index is None for ex in examples)
    assert {ex.system_index for ex in examples} >= set(range(len(corpus.SYSTEM_PROMPTS)))
    assert any(sum(m["role"] == "assistant" for m in ex.messages) == 2 for ex in examples)
    # A system prompt that asks for a closing line gets it.
    for ex in examples:
        ending = corpus.SYSTEM_ENDINGS[ex.system_index] if ex.system_index is not None else ""
        if ending:
            assert all(m["content"].endswith(ending) for m in ex.messages if m["role"] == "assistant")


def _small_setup():
    examples = corpus.make_corpus(120, seed=0)
    tokenizer = train_tokenizer([render(ex.messages) for ex in examples], 400)
    return examples, tokenizer


def test_python_render_matches_the_jinja_chat_template_and_labels_cover_the_answers():
    examples, tokenizer = _small_setup()
    ex = next(e for e in examples if e.system_index is not None)
    assert tokenizer.apply_chat_template(ex.messages, tokenize=False) == render(ex.messages)
    enc = encode_example(tokenizer, ex)
    trained = tokenizer.decode([t for t in enc.labels if t != -100])
    answers = "".join(m["content"] + "<|im_end|>" for m in ex.messages if m["role"] == "assistant")
    assert trained == answers
    assert enc.prefix_len > 0 and all(t == -100 for t in enc.labels[: enc.prefix_len])


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]], ids=["full", "hybrid"])
def test_shared_prefix_loss_and_gradients_equal_the_full_forward(layer_types):
    """Computing the system turn once per batch is an optimisation, not an approximation --
    with sliding-window layers too (the prefix's cache keeps only their last window - 1 tokens)."""
    torch.manual_seed(0)
    examples, tokenizer = _small_setup()
    encoded = [encode_example(tokenizer, ex) for ex in examples]
    cfg = TrainConfig.quick()
    if layer_types:
        cfg.layer_types, cfg.sliding_window = layer_types, 16  # far shorter than the ~640-token prefix
    model = build_model(cfg, tokenizer)
    if layer_types:
        assert model.model.layers[0].self_attn.sliding_window == 16
    batches = make_batches(encoded, 2048, 8, random.Random(0))
    batch = next(b for b in batches if encoded[b[0]].prefix_len > 0 and len(b) > 1)
    params = list(model.parameters())
    shared, shared_tokens = batch_loss(model, encoded, batch, tokenizer.pad_token_id, share_prefix=True)
    full, full_tokens = batch_loss(model, encoded, batch, tokenizer.pad_token_id, share_prefix=False)
    assert shared_tokens < full_tokens
    assert abs(shared.item() - full.item()) < 1e-5
    for a, b in zip(torch.autograd.grad(shared, params), torch.autograd.grad(full, params)):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
def test_quick_training_run_writes_a_loadable_model(tmp_path):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    for name in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "training_report.json",
        "prompts.json",
        "generation_config.json",
    ]:
        assert (tmp_path / name).exists(), name
    report = json.loads((tmp_path / "training_report.json").read_text())
    assert report["steps"] == TrainConfig.quick().max_steps and report["final_val_loss"] > 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ours = load_model(tmp_path, attn_backend=TorchAttentionBackend())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.vocab_size == len(tokenizer)
    # One sequence in contiguous blocks 0, 1, ... (tests/engine/test_model.py does the paged cases).
    n, block_size, config = len(ids), 16, ours.config
    num_blocks = (n + block_size - 1) // block_size
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.no_grad():
        logits = ours.compute_logits(ours(torch.tensor(ids), torch.arange(n), caches, metadata))
        expected = theirs(torch.tensor([ids])).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4


@pytest.mark.slow  # make test runs it; make test-fast leaves it out
def test_quick_fine_tune_of_a_trained_model_into_a_hybrid_one(tmp_path):
    """--init-from + --layer-types/--sliding-window: the default model's way to the hybrid one."""
    base, hybrid = tmp_path / "base", tmp_path / "hybrid"
    assert main(["--quick", "--out", str(base)]) == 0
    args = ["--layer-types", "sliding_attention,full_attention", "--sliding-window", "16"]
    assert main(["--quick", "--out", str(hybrid), "--init-from", str(base), *args]) == 0
    config = json.loads((hybrid / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == 16 and config["use_sliding_window"] is True
    for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "prompts.json"]:
        assert (hybrid / name).read_bytes() == (base / name).read_bytes(), name
    report = json.loads((hybrid / "training_report.json").read_text())
    assert report["init_from"] == str(base) and report["before_training"]["val_loss"] > 0
    assert report["attention"] == {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}
    model = transformers.AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.float32)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [16, None]


def test_layer_types_must_fit_the_model():
    with pytest.raises(SystemExit):
        main(["--quick", "--layer-types", "sliding_attention", "--sliding-window", "16"])  # 2 layers
    with pytest.raises(SystemExit):
        main(["--quick", "--layer-types", "sliding_attention,full_attention"])  # no window
