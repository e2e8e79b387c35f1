"""Train the bundled default model: tokenizer + a tiny Qwen3, on the story corpus.

    python -m training.train_default_model --out mini_vllm/default_model
    python -m training.train_default_model --out /tmp/smoke --quick   # seconds
    # the hybrid model: fine-tune the default weights with two sliding-window layers
    python -m training.train_default_model --out mini_vllm/hybrid_model \
        --init-from mini_vllm/default_model --max-steps 150 --lr 1e-3 --warmup-steps 10 \
        --layer-types sliding_attention,full_attention,sliding_attention,full_attention --sliding-window 64

Steps (each seeded, so a rerun on the same machine gives the same files):

1. draw the training and validation conversations from :mod:`training.corpus`;
2. train a byte-level BPE tokenizer on them (special tokens ``<|endoftext|>``,
   ``<|im_start|>``, ``<|im_end|>``) and wrap it in a
   ``PreTrainedTokenizerFast`` with a Qwen-style chat template;
3. train a ``Qwen3ForCausalLM`` (GQA, q/k norms, tied embeddings) with AdamW and
   a cosine schedule, the loss on the assistant's tokens only;
4. evaluate: validation loss, and greedy stories for held-out requests (does
   each story use the requested name and animal?);
5. save model + tokenizer (``save_pretrained``, safetensors, float32),
   ``training_report.json`` and ``prompts.json``.

Why the loss covers only the assistant's tokens: the system prompts are five
fixed texts repeated thousands of times and the user turns are random draws
(a name the model cannot predict), so their loss is either memorisation or
noise. The model still reads them -- its answers depend on both -- and the
reported loss measures what we care about: the stories.

Hybrid models (``--layer-types`` / ``--sliding-window``): the layers named
``sliding_attention`` attend to the last ``sliding_window`` tokens only (the
query's own included), the others to everything. ``--init-from`` starts from a
trained model folder (its weights and its tokenizer) instead of from scratch.
Shared-prefix training stays exact with sliding layers: transformers' cache
keeps a sliding layer's last ``sliding_window - 1`` prefix keys/values and masks
by position, which is all a suffix token can see (the tests check it).

Why batches are grouped by length: sequences range from ~30 tokens (a request
without system prompt) to ~800 (a system prompt and two turns). Batching
similar lengths keeps padding -- wasted compute on two CPU cores -- small.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from training.corpus import SYSTEM_ENDINGS, SYSTEM_PROMPTS, Example, make_corpus, sample_requests

# What ``tokenizer.save_pretrained`` writes (copied as they are with --init-from).
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen's chat format without the tool-calling parts:
#   <|im_start|>{role}\n{content}<|im_end|>\n   ... then <|im_start|>assistant\n
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class TrainConfig:
    """Everything that determines the result (written into training_report.json)."""

    seed: int = 0
    num_train: int = 22000
    num_val: int = 300
    vocab_size: int = 2048
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_steps: int = 700
    tokens_per_batch: int = 3072  # padded tokens per step, after the shared system turn
    max_batch_size: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 40
    weight_decay: float = 0.01
    num_eval_requests: int = 24
    num_two_turn_evals: int = 6
    max_new_tokens: int = 160
    # A hybrid model: per-layer "full_attention" / "sliding_attention" (None: all full).
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # tokens a sliding layer sees, the query's own included
    init_from: str | None = None  # a trained model folder: start from its weights and tokenizer

    @classmethod
    def quick(cls) -> "TrainConfig":
        """A smoke-test configuration: tiny everything, a few seconds."""
        return cls(
            num_train=300,
            num_val=20,
            vocab_size=400,
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            head_dim=32,
            intermediate_size=128,
            max_steps=8,
            tokens_per_batch=4096,
            warmup_steps=2,
            num_eval_requests=2,
            num_two_turn_evals=1,
            max_new_tokens=8,
        )


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


def render(messages: list[dict[str, str]]) -> str:
    """The chat template, in Python (the tests check it matches the Jinja one)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer wrapped for ``AutoTokenizer`` (saved with the model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte can be encoded
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


@dataclass
class Encoded:
    """One tokenized conversation.

    ``prefix_len`` tokens at the start are the system turn (0 without one):
    identical for every conversation with the same ``system_index``, so a
    training batch computes them once (see :func:`batch_loss`).
    """

    ids: list[int]
    labels: list[int]
    system_index: int | None
    prefix_len: int

    @property
    def suffix_len(self) -> int:
        return len(self.ids) - self.prefix_len


def encode_example(tokenizer, example: Example) -> Encoded:
    """Token ids and labels (``-100`` except on the assistant's content and its ``<|im_end|>``)."""
    text = render(example.messages)
    # Mark the characters the loss should cover, then map them to tokens by offset.
    trained = bytearray(len(text))
    pos = 0
    for m in example.messages:
        header = f"<|im_start|>{m['role']}\n"
        start = pos + len(header)
        end = start + len(m["content"]) + len("<|im_end|>")
        if m["role"] == "assistant":
            trained[start:end] = b"\x01" * (end - start)
        pos = end + 1  # the "\n" after <|im_end|>
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids = enc["input_ids"]
    labels = [i if trained[a] else -100 for i, (a, _) in zip(ids, enc["offset_mapping"])]
    prefix_len = 0
    if example.system_index is not None:
        # The system turn ends in "<|im_end|>\n" and the next turn starts with a
        # special token, so its tokens are the same alone as inside the chat.
        prefix = tokenizer(render(example.messages[:1]), add_special_tokens=False)["input_ids"]
        assert ids[: len(prefix)] == prefix, "system turn tokenizes differently inside the chat"
        prefix_len = len(prefix)
    return Encoded(ids, labels, example.system_index, prefix_len)


def make_batches(
    encoded: list[Encoded], tokens_per_batch: int, max_batch_size: int, rng: random.Random, share_prefix: bool = True
) -> list[list[int]]:
    """Group conversations into batches of about ``tokens_per_batch`` padded tokens.

    Within a batch all conversations have the same system prompt (or none)
    and similar lengths. With ``share_prefix`` the budget counts only the
    tokens after the shared system turn, which is computed once per batch.
    """

    def group(i: int) -> int:
        s = encoded[i].system_index
        return -1 if s is None or not share_prefix else s

    def length(i: int) -> int:
        return encoded[i].suffix_len if share_prefix else len(encoded[i].ids)

    order = sorted(range(len(encoded)), key=lambda i: (group(i), length(i), rng.random()))
    batches, current, longest = [], [], 0
    for i in order:
        n = length(i)
        if current and (
            group(i) != group(current[0])
            or max(longest, n) * (len(current) + 1) > tokens_per_batch
            or len(current) == max_batch_size
        ):
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` from ``(ids, labels)`` rows."""
    width = max(len(x) for x, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for row, (x, y) in enumerate(rows):
        ids[row, : len(x)] = torch.tensor(x)
        mask[row, : len(x)] = 1
        labels[row, : len(y)] = torch.tensor(y)
    return ids, mask, labels


def batch_loss(
    model, encoded: list[Encoded], batch: list[int], pad_id: int, share_prefix: bool = True
) -> tuple[torch.Tensor, int]:
    """Mean loss over the batch's assistant tokens, and the number of tokens computed.

    Shared-prefix training -- prefix caching, for training: when every
    conversation in the batch starts with the same system turn, run that turn
    once (batch of 1), repeat its keys/values for each row, and run only the
    rest of each conversation on top of them. The result (and its gradient)
    equals the full forward -- the system tokens carry no loss, and their K/V
    are the same in every row -- at a fraction of the cost, because the system
    prompts are most of the tokens. The tests check the equality.
    """
    first = encoded[batch[0]]
    if not share_prefix or first.prefix_len == 0:
        ids, mask, labels = collate([(encoded[i].ids, encoded[i].labels) for i in batch], pad_id)
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss, int(mask.sum())
    p = first.prefix_len
    prefix = torch.tensor([first.ids[:p]])
    cache = model(input_ids=prefix, use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(batch))  # [1, ...] -> [B, ...]; gradients flow back
    ids, mask, labels = collate([(encoded[i].ids[p:], encoded[i].labels[p:]) for i in batch], pad_id)
    full_mask = torch.cat([torch.ones(len(batch), p, dtype=mask.dtype), mask], dim=1)
    # The first suffix token's label would need the prefix's last logits, but it
    # is "<|im_start|>" of the user turn: never trained. So the loss is complete.
    out = model(input_ids=ids, attention_mask=full_mask, past_key_values=cache, labels=labels, use_cache=True)
    return out.loss, p + int(mask.sum())


# --------------------------------------------------------------------------- #
# Model, training, evaluation
# --------------------------------------------------------------------------- #


def attention_layout(cfg: TrainConfig) -> dict:
    """The config keys that make layers sliding-window or full attention (empty: all full).

    ``layer_types`` is given explicitly, so transformers takes it as is (it derives
    it from ``max_window_layers`` only when it is missing); ``use_sliding_window``
    must be true or ``Qwen3Config`` drops ``sliding_window``.
    """
    if cfg.layer_types is None:
        if cfg.sliding_window is not None:
            raise ValueError("--sliding-window needs --layer-types (which layers slide)")
        return {}
    if len(cfg.layer_types) != cfg.num_layers:
        raise ValueError(f"{len(cfg.layer_types)} layer types for {cfg.num_layers} layers")
    unknown = set(cfg.layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unknown layer types {sorted(unknown)}: use full_attention / sliding_attention")
    sliding = "sliding_attention" in cfg.layer_types
    if sliding and not cfg.sliding_window:
        raise ValueError("sliding_attention layers need --sliding-window")
    return {
        "layer_types": list(cfg.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window if sliding else None,
    }


def load_init_model(cfg: TrainConfig):
    """``cfg.init_from``'s model and tokenizer, with ``cfg``'s attention layout; ``cfg`` takes its sizes."""
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(cfg.init_from)
    config = AutoConfig.from_pretrained(cfg.init_from)
    cfg.vocab_size = config.vocab_size
    cfg.hidden_size = config.hidden_size
    cfg.num_layers = config.num_hidden_layers
    cfg.num_heads = config.num_attention_heads
    cfg.num_kv_heads = config.num_key_value_heads
    cfg.head_dim = config.head_dim
    cfg.intermediate_size = config.intermediate_size
    for key, value in attention_layout(cfg).items():
        setattr(config, key, value)
    model = Qwen3ForCausalLM.from_pretrained(cfg.init_from, config=config, dtype=torch.float32)
    return model, tokenizer


def build_model(cfg: TrainConfig, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,  # fewer KV heads than query heads: GQA
        head_dim=cfg.head_dim,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=torch.float32,
        **attention_layout(cfg),
    )
    return Qwen3ForCausalLM(config)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


@torch.no_grad()
def evaluate_loss(model, encoded: list[Encoded], pad_id: int, tokens_per_batch: int) -> float:
    """Mean loss per assistant token over ``encoded`` (full forward, no prefix sharing)."""
    model.eval()
    total, count = 0.0, 0
    for batch in make_batches(encoded, tokens_per_batch, 64, random.Random(0), share_prefix=False):
        ids, mask, labels = collate([(encoded[i].ids, encoded[i].labels) for i in batch], pad_id)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        targets = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        total += loss.item()
        count += int((targets != -100).sum())
    model.train()
    return total / max(1, count)


@torch.no_grad()
def greedy_story(model, tokenizer, messages, max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def ending_ok(story: str, system_index: int | None) -> bool:
    """The story ends with the closing line its system prompt asks for, and with none otherwise.

    Two system prompts ask for one ("The end." / "Good night, sleep tight."); the
    model must read the system prompt -- hundreds of tokens back -- to get it right.
    """
    wanted = SYSTEM_ENDINGS[system_index] if system_index is not None else ""
    found = [e for e in SYSTEM_ENDINGS if e and story.endswith(e)]
    return found == [wanted] if wanted else not found


def evaluate_quality(model, tokenizer, cfg: TrainConfig) -> dict:
    """Greedy stories for held-out requests: how many use the requested name / animal?

    Half of the requests go without a system prompt, half with one (cycling
    through the variants), so both ways the course uses the model are covered.
    """
    model.eval()
    results = []
    for k, req in enumerate(sample_requests(cfg.num_eval_requests, seed=cfg.seed + 1234)):
        messages = [{"role": "user", "content": req["request"]}]
        system_index = None
        if k % 2 == 1:
            system_index = (k // 2) % len(SYSTEM_PROMPTS)
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPTS[system_index]})
        text = greedy_story(model, tokenizer, messages, cfg.max_new_tokens)
        results.append(
            {
                "system_prompt": system_index,
                "request": req["request"],
                "story": text,
                "name_ok": req["name"] in text,
                "animal_ok": req["animal"] in text,
                "adjective_ok": req["adjective"] is None or req["adjective"] in text,
                "place_ok": req["place"] is None or req["place"] in text,
                "ending_ok": ending_ok(text, system_index),
            }
        )
    # Two-turn chats: the model's own first story stays in the context, and the
    # second request must be answered about the *second* character.
    two_turn = []
    specs = sample_requests(2 * cfg.num_two_turn_evals, seed=cfg.seed + 4321)
    for k in range(cfg.num_two_turn_evals):
        first, second = specs[2 * k], specs[2 * k + 1]
        messages = [
            {"role": "system", "content": SYSTEM_PROMPTS[k % len(SYSTEM_PROMPTS)]},
            {"role": "user", "content": first["request"]},
        ]
        messages.append({"role": "assistant", "content": greedy_story(model, tokenizer, messages, cfg.max_new_tokens)})
        messages.append({"role": "user", "content": "Another one, please! " + second["request"]})
        text = greedy_story(model, tokenizer, messages, cfg.max_new_tokens)
        two_turn.append(
            {"messages": messages, "story": text, "ok": second["name"] in text and second["animal"] in text}
        )
    n = len(results)
    model.train()
    return {
        "two_turn_requests": len(two_turn),
        "two_turn_name_and_animal_correct": sum(t["ok"] for t in two_turn),
        "two_turn_samples": two_turn[:2],
        "num_requests": n,
        "name_correct": sum(r["name_ok"] for r in results),
        "animal_correct": sum(r["animal_ok"] for r in results),
        "adjective_correct": sum(r["adjective_ok"] for r in results),
        "place_correct": sum(r["place_ok"] for r in results),
        "all_correct": sum(r["name_ok"] and r["animal_ok"] and r["adjective_ok"] and r["place_ok"] for r in results),
        "ending_correct": sum(r["ending_ok"] for r in results),
        "samples": results,
    }


def train(cfg: TrainConfig, out_dir: Path, log=print) -> dict:
    t_start = time.time()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(2)
    rng = random.Random(cfg.seed)

    # 1. Data (train and validation from different seeds: no shared draws).
    train_set = make_corpus(cfg.num_train, seed=cfg.seed)
    val_set = make_corpus(cfg.num_val, seed=cfg.seed + 10_000)

    # 2. Tokenizer, trained on the training conversations as the model will see them
    #    (or the one of the model we start from).
    if cfg.init_from:
        model, tokenizer = load_init_model(cfg)
    else:
        tokenizer = train_tokenizer([render(ex.messages) for ex in train_set], cfg.vocab_size)
    encoded = [encode_example(tokenizer, ex) for ex in train_set]
    val_encoded = [encode_example(tokenizer, ex) for ex in val_set]
    num_tokens = sum(len(e.ids) for e in encoded)
    num_target = sum(sum(1 for t in e.labels if t != -100) for e in encoded)
    log(
        f"tokenizer: {len(tokenizer)} tokens; corpus: {len(encoded)} conversations, "
        f"{num_tokens} tokens ({num_target} trained) [{time.time() - t_start:.0f}s]"
    )

    # 3. Model and training loop.
    initial = None
    if cfg.init_from:
        # Where we start: the loaded weights, run with this attention layout.
        initial_quality = evaluate_quality(model, tokenizer, cfg)
        initial = {
            "val_loss": round(evaluate_loss(model, val_encoded, tokenizer.pad_token_id, cfg.tokens_per_batch), 4),
            "greedy_quality": {k: v for k, v in initial_quality.items() if not k.endswith("samples")},
        }
        log(f"before training: {initial} [{time.time() - t_start:.0f}s]")
    else:
        model = build_model(cfg, tokenizer)
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: {num_params / 1e6:.2f}M parameters")
    decay = [p for p in model.parameters() if p.dim() >= 2]  # no decay on norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    pad_id = tokenizer.pad_token_id
    batches: list[list[int]] = []
    step, epoch, seen_tokens = 0, 0, 0  # seen: tokens actually computed
    t_train = time.time()
    train_loss = float("nan")
    while step < cfg.max_steps:
        if not batches:  # a new pass over the corpus, in a new (seeded) order
            batches = make_batches(encoded, cfg.tokens_per_batch, cfg.max_batch_size, rng)
            epoch += 1
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss, computed = batch_loss(model, encoded, batches.pop(), pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        train_loss = loss.item() if step == 0 else 0.95 * train_loss + 0.05 * loss.item()
        seen_tokens += computed
        step += 1
        if step % 50 == 0 or step == cfg.max_steps:
            log(
                f"step {step}/{cfg.max_steps} epoch {epoch} loss {train_loss:.3f} "
                f"lr {lr_at(step, cfg):.2e} [{time.time() - t_train:.0f}s]"
            )
    train_seconds = time.time() - t_train

    # 4. Evaluation.
    val_loss = evaluate_loss(model, val_encoded, pad_id, cfg.tokens_per_batch)
    log(f"val loss {val_loss:.3f}")
    quality = evaluate_quality(model, tokenizer, cfg)
    log(
        f"greedy: name {quality['name_correct']}/{quality['num_requests']}, "
        f"animal {quality['animal_correct']}/{quality['num_requests']}, "
        f"all {quality['all_correct']}/{quality['num_requests']}"
    )

    # 5. Save: model (safetensors, float32), tokenizer, report, prompts.
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = model.config.bos_token_id
    model.save_pretrained(out_dir)
    if cfg.init_from:
        # The same tokenizer: copy its files (saving a loaded one adds load-time keys).
        for name in TOKENIZER_FILES:
            if (Path(cfg.init_from) / name).exists():
                shutil.copyfile(Path(cfg.init_from) / name, out_dir / name)
    else:
        tokenizer.save_pretrained(out_dir)
    weights = sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))
    report = {
        "command": "python -m training.train_default_model " + " ".join(sys.argv[1:]),
        "seed": cfg.seed,
        "config": asdict(cfg),
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "corpus": {
            "train_conversations": len(encoded),
            "val_conversations": len(val_encoded),
            "train_tokens": num_tokens,
            "train_target_tokens": num_target,
        },
        "vocab_size": len(tokenizer),
        "num_parameters": num_params,
        "weights_dtype": "float32",
        "weights_mb": round(weights / 1e6, 2),
        "attention": {
            "layer_types": list(model.config.layer_types),
            "sliding_window": model.config.sliding_window,
        },
        "init_from": cfg.init_from,
        "before_training": initial,
        "steps": step,
        "epochs_started": epoch,
        "tokens_seen": seen_tokens,
        "final_train_loss": round(train_loss, 4),
        "final_val_loss": round(val_loss, 4),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "loss_note": "mean cross-entropy per assistant token (the loss is on assistant tokens only)",
        "greedy_quality": {k: v for k, v in quality.items() if not k.endswith("samples")},
        "greedy_sample": quality["samples"][0] if quality["samples"] else None,
        "greedy_samples": quality["samples"],
        "two_turn_samples": quality["two_turn_samples"],
    }
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    prompts = {
        "system_prompts": SYSTEM_PROMPTS,
        "user_requests": [r["request"] for r in sample_requests(16, seed=cfg.seed + 1234)],
        "requests": sample_requests(16, seed=cfg.seed + 1234),
    }
    (out_dir / "prompts.json").write_text(json.dumps(prompts, indent=2) + "\n")
    log(f"saved to {out_dir} ({weights / 1e6:.1f} MB of weights) in {time.time() - t_start:.0f}s")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="output folder (default: a temp dir with --quick)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3)")
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--init-from", default=None, help="start from this model folder's weights and tokenizer")
    parser.add_argument(
        "--layer-types",
        default=None,
        help="comma-separated full_attention / sliding_attention, one per layer (default: all full)",
    )
    parser.add_argument("--sliding-window", type=int, default=None, help="tokens a sliding layer sees")
    args = parser.parse_args(argv)
    cfg = TrainConfig.quick() if args.quick else TrainConfig()
    cfg.seed = args.seed
    for name in ("max_steps", "lr", "warmup_steps", "init_from", "sliding_window"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if args.layer_types is not None:
        cfg.layer_types = [t.strip() for t in args.layer_types.split(",")]
    if cfg.init_from is None:
        try:
            attention_layout(cfg)
        except ValueError as err:
            parser.error(str(err))
    if args.out is None:
        if not args.quick:
            parser.error("--out is required (e.g. --out mini_vllm/default_model)")
        args.out = tempfile.mkdtemp(prefix="mini_vllm_quick_")
    train(cfg, Path(args.out), log=lambda msg: print(msg, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
