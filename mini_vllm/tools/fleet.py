"""A fleet: N OpenAI servers behind the real ``vllm-router`` (``python -m mini_vllm fleet N``, ``make fleet``).

Each replica is a server process (mini-vLLM's, or real vLLM's from ``.venv-vllm``:
the router cannot tell them apart) started as vLLM is started for a KV-aware
router:

* ``--kv-events-config``: its KV events on a ZMQ socket of its own (PUB, and a
  ROUTER for replays), vLLM's default topic ``""``;
* ``--enable-scale-out``: ``/v1/chat/completions/render`` and
  ``/v1/completions/render``, with which the router turns a request into the
  token ids the replica will hash;
* one ``PYTHONHASHSEED`` for every replica and the router, so that the router's
  block hashes are the replicas' own.

``vllm-router`` (PyPI, a Rust binary; ``make router`` installs it into
``.venv-router``) runs in front with one of its policies: ``kv_aware`` (fed by
every replica's events: ``--kv-event-source``, ``--kv-event-block-size``,
``--kv-event-model``; offline it tokenizes with ``VLLM_ROUTER_TOKENIZER``, the
model's folder), ``cache_aware`` (its own guess from the texts it routed),
``round_robin`` and ``consistent_hash``.

``run_chat_workload`` measures what routing buys: the fleet hit rate (the sum
of every replica's ``vllm:prefix_cache_hits`` over the sum of its
``vllm:prefix_cache_queries``, read from each ``/metrics``), TTFT p50 / p99 as
a client sees it, and the balance (requests per replica).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model import default_model_path
from .compare_servers import (
    SERVED_MODEL_NAME,
    ServerProcess,
    ServerSpec,
    free_port,
    start_mini_server,
    start_vllm_server,
    workload_prompts,
)

ROUTER_POLICIES = ("kv_aware", "cache_aware", "round_robin", "consistent_hash")
ROOT = Path(__file__).resolve().parents[2]


def router_binary() -> str | None:
    """``vllm-router`` from ``.venv-router`` (``make router``), else from PATH; None when neither has it."""
    local = ROOT / ".venv-router" / "bin" / "vllm-router"
    return str(local) if local.exists() else shutil.which("vllm-router")


def router_missing_reason() -> str:
    return "vllm-router is not installed: run `make router` (pip install vllm-router==0.1.17 into .venv-router)"


# -- replicas ------------------------------------------------------------------------------
@dataclass
class Replica:
    """One server of the fleet: its HTTP port and its two ZMQ ports (events, replays)."""

    kind: str  # "mini" or "vllm"
    port: int
    events_port: int
    replay_port: int
    server: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def kv_events_config(self) -> dict[str, Any]:
        """vLLM's ``--kv-events-config`` for this replica (vLLM's defaults but for the ports)."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "",
        }


def router_command(policy: str, replicas: list[Replica], *, host: str, port: int, block_size: int) -> list[str]:
    """``vllm-router``'s command line for ``policy`` in front of ``replicas``, listening on ``host:port``."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(ROUTER_POLICIES)}")
    binary = router_binary()
    if binary is None:
        raise RuntimeError(router_missing_reason())
    command = [
        binary, "--host", host, "--port", str(port),
        "--worker-urls", *(replica.url for replica in replicas),
        "--policy", policy,
        # A dead replica is noticed within a second or two, not the default minute.
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        "--log-level", "warning",
        "--prometheus-port", str(free_port()),  # its own metrics; the default port may be taken
    ]  # fmt: skip
    if policy == "kv_aware":
        for replica in replicas:
            command += ["--kv-event-source", f"{replica.url}={replica.events_endpoint}"]
            command += ["--kv-event-replay-source", f"{replica.url}={replica.replay_endpoint}"]
        command += ["--kv-event-block-size", str(block_size), "--kv-event-model", SERVED_MODEL_NAME]
    return command


class Fleet:
    """Replicas and the router in front of them; ``with Fleet(2) as fleet: fleet.start_router("kv_aware")``."""

    def __init__(
        self,
        num_mini: int = 2,
        num_vllm: int = 0,
        *,
        spec: ServerSpec | None = None,
        hash_seed: str = "0",
        log_dir: Path | None = None,
        startup_timeout_s: float = 600,
        router_host: str = "127.0.0.1",
        router_port: int | None = None,
    ) -> None:
        if num_mini < 0 or num_vllm < 0 or num_mini + num_vllm < 1:
            raise ValueError(f"a fleet needs at least one replica, got {num_mini} mini-vLLM and {num_vllm} vLLM")
        self.spec = spec or ServerSpec(str(default_model_path()), block_size=32, num_blocks=256, max_model_len=1024)
        self.hash_seed = hash_seed
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="mini-vllm-fleet-"))
        self.startup_timeout_s = startup_timeout_s
        kinds = ["mini"] * num_mini + ["vllm"] * num_vllm
        self.replicas = [Replica(kind, free_port(), free_port(), free_port()) for kind in kinds]
        self.router: subprocess.Popen | None = None
        self.router_host = router_host  # "0.0.0.0": the whole room's laptops reach the router
        self.router_port = router_port or free_port()
        self.policy: str | None = None
        try:
            for index in range(len(self.replicas)):
                self._start_replica(index)
            for replica in self.replicas:
                replica.server.wait_ready(self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """The router's address: clients talk to the fleet here."""
        return f"http://127.0.0.1:{self.router_port}"

    def _environment(self) -> dict[str, str]:
        return {"PYTHONHASHSEED": self.hash_seed}

    def _start_replica(self, index: int) -> None:
        replica = self.replicas[index]
        args = ["--enable-scale-out", "--kv-events-config", json.dumps(replica.kv_events_config())]
        start = start_mini_server if replica.kind == "mini" else start_vllm_server
        replica.server = start(self.spec, self.log_dir, args, port=replica.port, env=self._environment())

    # -- the router ----------------------------------------------------------------------------
    def start_router(self, policy: str, timeout_s: float = 60) -> None:
        """(Re)start ``vllm-router`` with ``policy``; returns once it answers."""
        self.stop_router()
        env = dict(os.environ, VLLM_ROUTER_TOKENIZER=self.spec.model, **self._environment())
        log = open(self.log_dir / f"router_{policy}.log", "w")
        command = router_command(
            policy, self.replicas, host=self.router_host, port=self.router_port, block_size=self.spec.block_size
        )
        self.router = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.policy = policy
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"vllm-router exited ({self.router.returncode}): {self._router_log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as response:
                    if response.status == 200:
                        time.sleep(0.5)  # its event subscribers connect right after it listens
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"vllm-router did not answer within {timeout_s:.0f} s: {self._router_log_tail()}")

    def _router_log_tail(self) -> str:
        return (self.log_dir / f"router_{self.policy}.log").read_text(errors="replace")[-3000:]

    def stop_router(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.send_signal(signal.SIGINT)
            try:
                self.router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        self.router = None

    # -- faults and state ----------------------------------------------------------------------
    def kill(self, index: int) -> None:
        """Kill replica ``index`` at once (SIGKILL: no goodbye to the router)."""
        process = self.replicas[index].server.process
        process.kill()
        process.wait()

    def reset_prefix_caches(self) -> None:
        """Every replica forgets its cache; each sends ``AllBlocksCleared``, so the router forgets it too."""
        for replica in self.replicas:
            request = urllib.request.Request(replica.url + "/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(request, timeout=60) as response:
                if not json.loads(response.read() or b"{}").get("success", True):
                    raise RuntimeError(f"{replica.url} refused to reset its prefix cache")

    def counters(self) -> list[dict[str, float]]:
        """Each replica's prefix-cache counters and finished requests, from its ``/metrics``."""
        return [read_counters(replica.url) for replica in self.replicas]

    def stop(self) -> None:
        self.stop_router()
        for replica in self.replicas:
            if replica.server is not None:
                replica.server.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


COUNTERS = {
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:request_success_total": "requests",
}


def read_counters(url: str) -> dict[str, float]:
    """``queries`` / ``hits`` (prefix-cache tokens) and ``requests`` (finished, every reason) from ``url/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = dict.fromkeys(COUNTERS.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS:
            values[COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return values


# -- the workload -------------------------------------------------------------------------------
def tenant_conversations(num_tenants: int, requests_per_tenant: int) -> list[tuple[int, list[dict]]]:
    """A multi-tenant chat: each tenant has its own long system prompt; its users ask one question each.

    Returned interleaved (tenant 0, 1, ..., 0, 1, ...), as requests from many
    tenants arrive: ``[(tenant, messages), ...]``.
    """
    prompts = workload_prompts()
    systems, users = prompts["systems"], prompts["users"]
    conversations = []
    for turn in range(requests_per_tenant):
        for tenant in range(num_tenants):
            system = f"You serve tenant {tenant}. " + " ".join(systems[(tenant + k) % len(systems)] for k in range(3))
            user = users[(tenant * requests_per_tenant + turn) % len(users)]
            conversations.append((tenant, [{"role": "system", "content": system}, {"role": "user", "content": user}]))
    return conversations


def stream_one(client: Any, url: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed chat request: ``{"status", "ttft_s", "cached_tokens", "error"}`` (status 0: no HTTP answer)."""
    body = {
        "model": SERVED_MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result: dict[str, Any] = {"status": 0, "ttft_s": None, "cached_tokens": None, "error": None}
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            result["status"] = response.status_code
            if response.status_code != 200:
                result["error"] = response.read().decode(errors="replace")[:300]
                return result
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result["error"] = str(chunk["error"])[:300]
                if chunk.get("choices") and result["ttft_s"] is None:
                    result["ttft_s"] = time.perf_counter() - start
                if chunk.get("usage"):
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result["cached_tokens"] = details.get("cached_tokens")
    except Exception as error:  # the connection broke: no answer
        result["error"] = f"{type(error).__name__}: {error}"
    return result


def warm_then_route(fleet: Fleet, index: int, conversations: list[list[dict]]) -> tuple[list[dict], list[int]]:
    """Send the first conversation straight to replica ``index`` (past the router), the others through the
    router; returns the routed requests' results and how many each replica served of them."""
    import httpx

    with httpx.Client(timeout=300, trust_env=False) as client:
        warm = stream_one(client, fleet.replicas[index].url, conversations[0], max_tokens=1)
        if warm["status"] != 200:
            raise RuntimeError(f"replica {index} did not answer: {warm}")
        time.sleep(0.3)  # its BlockStored events reach the router
        before = fleet.counters()
        results = [stream_one(client, fleet.url, messages, max_tokens=1) for messages in conversations[1:]]
    served = [int(a["requests"] - b["requests"]) for a, b in zip(fleet.counters(), before)]
    return results, served


@dataclass
class FleetRun:
    """What one workload did through the router."""

    policy: str
    results: list[dict[str, Any]]
    per_replica: list[dict[str, float]]  # counters' growth during the run
    kinds: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        queries = sum(r["queries"] for r in self.per_replica)
        return sum(r["hits"] for r in self.per_replica) / queries if queries else 0.0

    @property
    def requests_per_replica(self) -> list[int]:
        return [int(r["requests"]) for r in self.per_replica]

    def ttft_ms(self, quantile: float) -> float:
        times = sorted(r["ttft_s"] for r in self.results if r["ttft_s"] is not None)
        if not times:
            return float("nan")
        if len(times) == 1:
            return times[0] * 1000
        return statistics.quantiles(times, n=100, method="inclusive")[round(quantile * 100) - 1] * 1000

    def row(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "fleet hit rate": round(self.hit_rate, 3),
            "TTFT p50 ms": round(self.ttft_ms(0.5), 1),
            "TTFT p99 ms": round(self.ttft_ms(0.99), 1),
            "requests per replica": self.requests_per_replica,
            "errors": sum(1 for r in self.results if r["status"] != 200 or r["error"]),
        }


def run_chat_workload(
    fleet: Fleet, num_tenants: int = 5, requests_per_tenant: int = 4, max_tokens: int = 4
) -> FleetRun:
    """The multi-tenant chat through the router, one request at a time, from empty caches."""
    import httpx

    fleet.reset_prefix_caches()
    time.sleep(0.3)  # the replicas' AllBlocksCleared reach the router
    before = fleet.counters()
    results = []
    with httpx.Client(timeout=300, trust_env=False) as client:
        for _, messages in tenant_conversations(num_tenants, requests_per_tenant):
            results.append(stream_one(client, fleet.url, messages, max_tokens))
            time.sleep(0.05)  # the replica's events of this request reach the router before the next
    after = fleet.counters()
    grown = [{key: a[key] - b[key] for key in a} for a, b in zip(after, before)]
    return FleetRun(fleet.policy or "", results, grown, [r.kind for r in fleet.replicas])


def run_course_router(
    fleet: Fleet, num_tenants: int = 5, requests_per_tenant: int = 4, max_tokens: int = 4
) -> FleetRun:
    """The same chat routed by the course's ``CacheAwareRouter`` (chapter 09b) from the replicas' ZMQ events.

    What ``vllm-router --policy kv_aware`` does, in Python: each prompt rendered to token ids
    by a replica (``/v1/chat/completions/render``), hashed as the replicas hash (their
    ``PYTHONHASHSEED``), looked up in each replica's mirror (kept from its ``BlockStored`` /
    ``BlockRemoved`` / ``AllBlocksCleared`` on ZMQ, in vLLM's wire form), sent to the longest hit.
    Each result also names the replica it went to.

    A replica's cache changes only when it serves a request (rendering caches nothing) or resets:
    every mirror is brought up to date after the resets, then only the replica that answered,
    after its answer (reading a stream waits for it to fall silent, ``take_events``' ``settle_s``).
    """
    import httpx

    from ..companions.router import CacheAwareRouter
    from ..distributed.kv_events import KVEventSubscriber, external_block_hash

    router = CacheAwareRouter(
        len(fleet.replicas), fleet.spec.block_size, block_key=external_block_hash, hash_seed=fleet.hash_seed
    )
    subscribers = [KVEventSubscriber(r.events_endpoint, r.replay_endpoint) for r in fleet.replicas]

    def observe(index: int) -> None:
        router.observe(index, subscribers[index].take_events())

    try:
        fleet.reset_prefix_caches()
        for index in range(len(subscribers)):  # each replica's AllBlocksCleared
            observe(index)
        before = fleet.counters()
        results = []
        with httpx.Client(timeout=300, trust_env=False) as client:
            for _, messages in tenant_conversations(num_tenants, requests_per_tenant):
                body = {"model": SERVED_MODEL_NAME, "messages": messages}
                rendered = client.post(fleet.replicas[0].url + "/v1/chat/completions/render", json=body)
                rendered.raise_for_status()
                index = router.route(rendered.json()["token_ids"])
                result = stream_one(client, fleet.replicas[index].url, messages, max_tokens)
                results.append({**result, "replica": index})
                observe(index)  # what serving it stored, and evicted, there
        after = fleet.counters()
    finally:
        for subscriber in subscribers:
            subscriber.close()
    grown = [{key: a[key] - b[key] for key in a} for a, b in zip(after, before)]
    return FleetRun("course CacheAwareRouter", results, grown, [r.kind for r in fleet.replicas])


def format_runs(runs: list[FleetRun]) -> str:
    rows = [run.row() for run in runs]
    columns = list(rows[0])
    widths = [max(len(str(c)), *(len(str(row[c])) for row in rows)) for c in columns]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths)) for row in rows]
    return "\n".join(lines)


# -- the command line ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mini_vllm fleet",
        description="N mini-vLLM servers (and real vLLM ones) behind vllm-router (make fleet).",
    )
    parser.add_argument("num_replicas", type=int, help="mini-vLLM replicas")
    parser.add_argument("--vllm-replicas", type=int, default=0, help="real vLLM replicas beside them (make vllm)")
    parser.add_argument("--policy", default="kv_aware", choices=ROUTER_POLICIES, help="(default: %(default)s)")
    parser.add_argument(
        "--block-size", type=int, default=32, help="(default: %(default)s; vLLM on a CPU needs a multiple of 32)"
    )
    parser.add_argument("--model", default=None, help="a model folder (default: the bundled model)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="where the router listens (0.0.0.0: a room; default: %(default)s)"
    )
    parser.add_argument("--port", type=int, default=None, help="the router's port (default: a free one)")
    parser.add_argument(
        "--compare-policies",
        action="store_true",
        help="run the multi-tenant chat workload under every policy, print the table, and stop",
    )
    parser.add_argument("--tenants", type=int, default=5, help="tenants of the workload (default: %(default)s)")
    parser.add_argument("--requests-per-tenant", type=int, default=4, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    if router_binary() is None:
        parser.error(router_missing_reason())
    spec = ServerSpec(args.model or str(default_model_path()), block_size=args.block_size, num_blocks=256)
    print(f"starting {args.num_replicas} mini-vLLM and {args.vllm_replicas} vLLM replicas ...", flush=True)
    try:
        fleet = Fleet(args.num_replicas, args.vllm_replicas, spec=spec, router_host=args.host, router_port=args.port)
    except ValueError as error:
        parser.error(str(error))
    with fleet:
        if args.compare_policies:
            runs = []
            for policy in ROUTER_POLICIES:
                fleet.start_router(policy)
                runs.append(run_chat_workload(fleet, args.tenants, args.requests_per_tenant))
            print(format_runs(runs))
            return 0
        fleet.start_router(args.policy)
        for replica in fleet.replicas:
            print(f"  {replica.kind:5} replica {replica.url}  KV events {replica.events_endpoint}")
        print(f"vllm-router ({args.policy}) serves {SERVED_MODEL_NAME!r} on {fleet.url}/v1; Ctrl-C stops the fleet")
        print(f"logs: {fleet.log_dir}", flush=True)
        try:
            while fleet.router.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
