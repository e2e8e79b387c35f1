"""The bundled hybrid model in transformers and in real vLLM: same tokens, same log-probabilities.

    python -m training.check_hybrid_model            # needs .venv-vllm (make vllm); ~1-2 min
    python -m training.check_hybrid_model --json out.json

``mini_vllm/hybrid_model/`` has two sliding-window layers (0 and 2, 64 tokens)
and two full-attention layers (1 and 3). This script runs the same prompts --
the model's own chat prompts, ~290 tokens each, far longer than the window --
through transformers (this virtualenv) and through vLLM (``.venv-vllm``,
``model_impl="transformers"``: vLLM's native Qwen3 has no per-layer windows and
refuses this config), and prints:

* whether the greedy tokens are equal, and how far apart the two engines'
  log-probabilities of the prompt and generated tokens are -- next to how far
  transformers *without* the window is from vLLM (so a vLLM that ignored the
  window would show);
* the KV-cache groups vLLM built (one per kind of layer);
* ``num_cached_tokens`` of vLLM's prefix cache in three scenarios: the same
  prompt twice; two prompts that share a 250-token prefix and then diverge;
  three such prompts. With a sliding-window group, vLLM (default
  ``prefix_cache_retention_interval=0``) keeps that group's blocks only at the
  points a later request can resume from: a request's replay boundary
  (``num_prompt_tokens - 1``) and a shared-prefix junction that a second request
  revealed -- so the second prompt of a shared prefix misses and the third hits.

``tests/engine/test_hybrid_model.py`` asserts all of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mini_vllm.tools.compare_vllm import run_vllm_job
from mini_vllm.model import hybrid_model_path

NUM_PROMPTS = 4
MAX_TOKENS = 32
SHARED_PREFIX = 250  # tokens the cache scenarios' prompts share
BLOCK_SIZE = 32  # vLLM's CPU attention needs multiples of 32
NUM_BLOCKS = 128


def load(path: str | None = None, all_full: bool = False):
    """``(model, tokenizer)`` from transformers; ``all_full``: the same weights, every layer full attention."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = path or hybrid_model_path()
    config = AutoConfig.from_pretrained(path)
    if all_full:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        config.use_sliding_window = False
        config.sliding_window = None
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def chat_ids(tokenizer, system: str | None, user: str) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def greedy_prompts(tokenizer, path: str | None = None) -> list[list[int]]:
    """The model's own chat prompts: system prompt ``i % 5`` + sample request ``i``."""
    data = json.loads((Path(path or hybrid_model_path()) / "prompts.json").read_text())
    systems, requests = data["system_prompts"], data["user_requests"]
    return [chat_ids(tokenizer, systems[i % len(systems)], requests[i]) for i in range(NUM_PROMPTS)]


def shared_prefix_prompts(tokenizer, path: str | None = None) -> list[list[int]]:
    """Three prompts: the first ``SHARED_PREFIX`` tokens of a system prompt's chat, then a different request each."""
    data = json.loads((Path(path or hybrid_model_path()) / "prompts.json").read_text())
    prefix = chat_ids(tokenizer, data["system_prompts"][0], data["user_requests"][0])[:SHARED_PREFIX]
    tails = [tokenizer.encode(data["user_requests"][i], add_special_tokens=False) for i in (1, 2, 4)]
    assert len({tail[0] for tail in tails}) == len(tails), "the tails must diverge at their first token"
    return [prefix + tail for tail in tails]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """transformers' greedy continuation (stops after ``eos``, which it includes, as vLLM does)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logprobs(model, token_ids: list[int]) -> list[float]:
    """Each token's log-probability given the ones before it (one forward; the first token has none)."""
    logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    chosen = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return chosen.tolist()


def _engine(workloads: list[dict], path: str) -> dict:
    return {
        "model": path,
        "model_impl": "transformers",
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "num_blocks": NUM_BLOCKS,
        "max_model_len": 1024,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 2048,
        "workloads": workloads,
    }


def vllm_job(tokenizer, path: str | None = None) -> dict:
    """One engine (vLLM's Transformers backend), four workloads, each starting with a cold cache."""
    path = path or hybrid_model_path()
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 0, "prompt_logprobs": 0}
    one = {"temperature": 0.0, "max_tokens": 4}
    same = greedy_prompts(tokenizer, path)[0]
    shared = shared_prefix_prompts(tokenizer, path)

    def calls(prompts):  # one generate per prompt, one after another
        return [{"prompts": [{"prompt_token_ids": p}], "sampling": one} for p in prompts]

    workloads = [
        {
            "name": "greedy",
            "calls": [
                {"prompts": [{"prompt_token_ids": p} for p in greedy_prompts(tokenizer, path)], "sampling": greedy}
            ],
        },
        {"name": "same_prompt_twice", "calls": calls([same, same])},
        {"name": "shared_prefix_two", "calls": calls(shared[:2])},
        {"name": "shared_prefix_three", "calls": calls(shared)},
    ]
    return {"threads": 2, "probes": False, "engines": [_engine(workloads, path)]}


def run_vllm(job: dict, timeout_s: int = 900) -> dict:
    """``job`` through ``mini_vllm/tools/vllm_side/run_vllm.py`` in vLLM's virtualenv."""
    return run_vllm_job(job, timeout_s)


def _max_gap(a: list, b: list, start: int = 0) -> float:
    return max(abs(x - y) for x, y in zip(a[start:], b[start:]) if x is not None and y is not None)


def compare(vllm_result: dict, path: str | None = None) -> dict:
    """transformers against vLLM's answers: greedy tokens, log-probability gaps, cache counts."""
    model, tokenizer = load(path)
    full_model, _ = load(path, all_full=True)
    window = model.config.sliding_window
    engine = vllm_result["engines"][0]
    workloads = {w["name"]: w for w in engine["workloads"]}
    rows = []
    for prompt, request in zip(greedy_prompts(tokenizer, path), workloads["greedy"]["requests"]):
        theirs = request["token_ids"][0]
        ours = hf_greedy(model, prompt)
        # Log-probabilities along vLLM's tokens (prompt + generated), by both models in transformers.
        sequence = prompt + theirs
        windowed, full = hf_logprobs(model, sequence), hf_logprobs(full_model, sequence)
        vllm_lp = request["prompt_logprobs"][1:] + request["logprobs"][0]
        rows.append(
            {
                "num_prompt_tokens": len(prompt),
                "tokens_equal": ours == theirs,
                "num_generated": len(theirs),
                "hf_tokens": ours,
                "vllm_tokens": theirs,
                "text": tokenizer.decode(theirs, skip_special_tokens=True),
                # gaps from the first position whose window cuts something off
                "max_logprob_gap": _max_gap(windowed, vllm_lp, window - 1),
                "max_logprob_gap_without_window": _max_gap(full, vllm_lp, window - 1),
                "max_logprob_gap_inside_window": _max_gap(windowed, vllm_lp, 0) if window else None,
            }
        )
    cache = {
        name: [r["num_cached_tokens"] for r in workloads[name]["requests"]]
        for name in ("same_prompt_twice", "shared_prefix_two", "shared_prefix_three")
    }
    prompt_lengths = {
        name: [r["num_prompt_tokens"] for r in workloads[name]["requests"]]
        for name in ("same_prompt_twice", "shared_prefix_two", "shared_prefix_three")
    }
    return {
        "vllm_version": vllm_result["vllm_version"],
        "sliding_window": window,
        "layer_types": list(model.config.layer_types),
        "kv_cache": engine["kv_cache"],
        "greedy": rows,
        "num_cached_tokens": cache,
        "num_prompt_tokens": prompt_lengths,
        "shared_prefix": SHARED_PREFIX,
        "block_size": BLOCK_SIZE,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled hybrid model)")
    parser.add_argument("--json", default=None, help="also write the full result here")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    _, tokenizer = load(args.model)
    result = compare(run_vllm(vllm_job(tokenizer, args.model)), args.model)
    print(f"vLLM {result['vllm_version']}; layer types {result['layer_types']}, window {result['sliding_window']}")
    print(f"KV-cache groups ({result['kv_cache']['coordinator']}):")
    for group in result["kv_cache"]["groups"]:
        print(
            f"  {group['spec']}(window={group['sliding_window']}, block_size={group['block_size']}): {group['layers']}"
        )
    for row in result["greedy"]:
        print(
            f"  prompt {row['num_prompt_tokens']} tokens: greedy tokens equal {row['tokens_equal']} "
            f"({row['num_generated']} generated); max |logprob gap| {row['max_logprob_gap']:.2e} "
            f"(transformers without the window: {row['max_logprob_gap_without_window']:.2e}) {row['text']!r}"
        )
    for name, cached in result["num_cached_tokens"].items():
        print(f"  {name}: num_prompt_tokens {result['num_prompt_tokens'][name]}, num_cached_tokens {cached}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(row["tokens_equal"] for row in result["greedy"]) else 1


if __name__ == "__main__":
    sys.exit(main())
