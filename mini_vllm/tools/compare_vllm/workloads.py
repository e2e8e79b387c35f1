"""The comparison's workloads, as token ids, and what both engines are built with.

A workload is ``{"name", "description", "calls": [{"prompts", "sampling"}]}``;
a call is one ``generate`` with all its prompts (the same grouping in both
engines). Both engines get the same ids, so tokenizers cannot differ. vLLM's
counterpart: ``benchmarks/benchmark_dataset.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

WORKLOAD_NAMES = (
    "shared_system_prompt",
    "multi_turn_chat",
    "n_greater_than_1",
    "exact_block_multiple",
    "repeated_prompt",
    "eviction_and_preemption",
    "cache_salt_tenants",
)
DEFAULT_NUM_BLOCKS = 24  # per engine; the eviction workload is built to overflow it
MAX_NUM_SEQS = 32
MAX_NUM_BATCHED_TOKENS = 2048
CACHE_SETTINGS = ("prefix_cache_retention_interval", "disable_hybrid_kv_cache_manager")
"""Settings an engine spec may carry to both engines, under vLLM's names (default: each engine's own)."""


def engine_max_model_len(block_size: int, num_blocks: int) -> int:
    """The ``max_model_len`` every engine of a comparison gets: the pool's capacity, at most 1024 tokens."""
    return min(1024, block_size * num_blocks)


def _prompt_data() -> dict:
    from ...model import default_model_path

    return json.loads((Path(default_model_path()) / "prompts.json").read_text())


def _chat_ids(tokenizer, system: str | None, user: str) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _long_text(tokenizer, texts: Sequence[str], min_tokens: int, start: int = 0) -> str:
    """``texts`` joined (cycling from ``start``) until the result has at least ``min_tokens`` tokens."""
    parts: list[str] = []
    index = start
    while len(tokenizer.encode(" ".join(parts), add_special_tokens=False)) < min_tokens:
        parts.append(texts[index % len(texts)])
        index += 1
    return " ".join(parts)


def _ids_of_length(tokenizer, texts: Sequence[str], length: int, start: int) -> list[int]:
    ids = tokenizer.encode(_long_text(tokenizer, texts, length, start), add_special_tokens=False)
    return ids[:length]


def _call(prompts: list[dict], max_tokens: int = 8, n: int = 1) -> dict:
    """One ``generate`` call. Greedy; vLLM refuses n > 1 with temperature 0, so samples of
    n > 1 use temperature 1 with top_k=1, which is greedy too (only the best token survives)."""
    if n == 1:
        return {"prompts": prompts, "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "n": 1}}
    return {"prompts": prompts, "sampling": {"temperature": 1.0, "top_k": 1, "max_tokens": max_tokens, "n": n}}


def _ids(token_ids: list[int], cache_salt: str | None = None) -> dict:
    prompt: dict = {"prompt_token_ids": list(token_ids)}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def _chosen(names: Sequence[str] | None, known: Sequence[str]) -> list[str]:
    """``names`` (None: every one of ``known``); a ValueError names the first unknown one."""
    names = list(known if names is None else names)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown workload {unknown[0]!r}; choose from {', '.join(known)}")
    return names


def build_workloads(tokenizer, block_size: int, names: Sequence[str] | None = None) -> list[dict]:
    """The comparison's workloads as token ids, sized to ``block_size`` (all greedy).

    Each workload is ``{"name", "description", "calls": [{"prompts", "sampling"}]}``;
    a call is one ``generate`` with all its prompts (the same grouping in both engines).
    """
    names = _chosen(names, WORKLOAD_NAMES)
    data = _prompt_data()
    systems, users = data["system_prompts"], data["user_requests"]
    block = block_size
    # A system prompt of at least 2.5 blocks, whatever the tokenizer: 2 full blocks to share.
    shared_system = _long_text(tokenizer, systems, 2 * block + block // 2)
    workloads = {}

    one_by_one = [_call([_ids(_chat_ids(tokenizer, shared_system, user))]) for user in users[:6]]
    together = _call([_ids(_chat_ids(tokenizer, shared_system, user)) for user in users[6:10]])
    workloads["shared_system_prompt"] = {
        "description": "6 requests one by one, then 4 in one call, all with one long system prompt",
        "calls": one_by_one + [together],
    }

    first_turn = _chat_ids(tokenizer, systems[0], users[0])
    next_turns = [
        _call([{"continue_chat": tokenizer.encode("\n" + user + "\n", add_special_tokens=False)}], max_tokens=16)
        for user in users[1:5]
    ]
    workloads["multi_turn_chat"] = {
        "description": "5 turns; each prompt = the previous prompt + the engine's own reply + a new message",
        "calls": [_call([_ids(first_turn)], max_tokens=16)] + next_turns,
    }

    story = _chat_ids(tokenizer, systems[3], users[5])
    workloads["n_greater_than_1"] = {
        "description": "n=3 (top_k=1: greedy) on a cold prompt, then again on the same, now cached, prompt",
        "calls": [_call([_ids(story)], n=3), _call([_ids(story)], n=3)],
    }

    exact = _ids_of_length(tokenizer, systems, 4 * block, start=1)
    longer = _ids_of_length(tokenizer, systems, 4 * block + 1, start=1)
    workloads["exact_block_multiple"] = {
        "description": f"a prompt of exactly 4 blocks ({4 * block} tokens) twice, then one token longer, one shorter",
        "calls": [_call([_ids(exact)]), _call([_ids(exact)]), _call([_ids(longer)]), _call([_ids(exact[:-1])])],
    }

    repeated = _chat_ids(tokenizer, systems[2], users[7])
    workloads["repeated_prompt"] = {
        "description": "the same prompt 3 times one by one, then twice in one call",
        "calls": [_call([_ids(repeated)]) for _ in range(3)] + [_call([_ids(repeated)] * 2)],
    }

    # 8 distinct prompts of 3 blocks minus 2 tokens: together they fill the 24-block pool,
    # and their third decode token needs a 4th block each, so requests are preempted.
    distinct = [_ids_of_length(tokenizer, users[i : i + 1] + systems, 3 * block - 2, start=0) for i in range(8)]
    workloads["eviction_and_preemption"] = {
        "description": f"8 distinct prompts of {3 * block - 2} tokens in one call (more than the pool holds "
        f"once they decode), the same 8 again, then the first 2",
        "calls": [
            _call([_ids(p) for p in distinct]),
            _call([_ids(p) for p in distinct]),
            _call([_ids(p) for p in distinct[:2]]),
        ],
    }

    # 5 blocks minus 3 tokens: the three copies (salt a, salt b, no salt) fit in the pool together.
    tenant_prompt = _ids_of_length(tokenizer, users[9:10] + systems, 5 * block - 3, start=0)
    salts = ["tenant-a", "tenant-b", "tenant-a", None, "tenant-b", None]
    workloads["cache_salt_tenants"] = {
        "description": "one prompt from tenants a, b, a, no salt, b, no salt: a salt shares only with itself",
        "calls": [_call([_ids(tenant_prompt, salt)]) for salt in salts],
    }
    return [{"name": name, **workloads[name]} for name in names]


HYBRID_WORKLOAD_NAMES = (
    "junction",
    "longer_than_the_window",
    "shared_system_prompt",
    "multi_turn_chat",
    "eviction_and_preemption",
)


def build_hybrid_workloads(tokenizer, block_size: int, names: Sequence[str] | None = None) -> list[dict]:
    """Workloads for a hybrid model (chapter 08b): prompts longer than its window, with shared prefixes.

    ``junction``: a long prompt P, then a prompt sharing P's first ~8 blocks and
    diverging (the full-attention group hits, the sliding-window group cached
    only P's last blocks, so the request's hit is 0 and the junction is pinned),
    then a third with the same ~8 blocks (now a hit), then P again (the blocks
    at P's replay boundary). ``longer_than_the_window``: a prompt of 12 blocks
    decoding 40 tokens (blocks leave the window), then the same prompt. The
    other three are ``build_workloads``' of the same names.
    """
    names = _chosen(names, HYBRID_WORKLOAD_NAMES)
    data = _prompt_data()
    systems, users = data["system_prompts"], data["user_requests"]
    block = block_size
    long_prompt = _ids_of_length(tokenizer, systems, 10 * block - 5, start=0)
    shared = long_prompt[: 8 * block - 6]
    second = shared + _ids_of_length(tokenizer, users, block + 7, start=3)
    third = shared + _ids_of_length(tokenizer, users, 2 * block + 1, start=6)
    workloads = {
        "junction": {
            "description": "P, then two prompts sharing P's first 8 blocks (the second pins the junction, "
            "the third hits it), then P again",
            "calls": [_call([_ids(prompt)]) for prompt in (long_prompt, second, third, long_prompt)],
        },
        "longer_than_the_window": {
            "description": "a 12-block prompt decoding 40 tokens (its first blocks leave the window), then again",
            "calls": [
                _call([_ids(prompt)], max_tokens=40)
                for prompt in [_ids_of_length(tokenizer, systems, 12 * block, start=2)] * 2
            ],
        },
    }
    plain = [name for name in names if name not in workloads]
    for workload in build_workloads(tokenizer, block_size, plain) if plain else []:
        workloads[workload["name"]] = {key: value for key, value in workload.items() if key != "name"}
    return [{"name": name, **workloads[name]} for name in names]


class PromptDoesNotFit(ValueError):
    """A prompt of yours (``--prompt``) that leaves no room for the output within the comparison's max_model_len."""


def your_prompts_workload(
    tokenizer, texts: Sequence[str], max_tokens: int = 16, max_model_len: int | None = None
) -> dict:
    """A workload of your own prompts (``--prompt``): each one by one, then all of them in one call.

    The texts are tokenized once, here, with the model's tokenizer (no special
    tokens added), and both engines get the same token ids. A prompt that leaves
    no room for ``max_tokens`` within ``max_model_len`` is a ValueError here,
    before either engine starts.
    """
    if not texts or any(not isinstance(text, str) or not text for text in texts):
        raise ValueError(f"prompts must be non-empty strings, got {list(texts)!r:.200}")
    prompts = [_ids(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    for index, prompt in enumerate(prompts):
        num_tokens = len(prompt["prompt_token_ids"])
        if max_model_len is not None and num_tokens + max_tokens > max_model_len:
            raise PromptDoesNotFit(
                f"prompt {index} has {num_tokens} tokens: with {max_tokens} output tokens that is more than this "
                f"comparison's max_model_len of {max_model_len} (the pool's capacity, at most 1024: raise --num-blocks)"
            )
    return {
        "name": "your_prompts",
        "description": f"your {len(prompts)} prompt(s) one by one, then all in one call",
        "calls": [_call([prompt], max_tokens) for prompt in prompts] + [_call(prompts, max_tokens)],
    }
