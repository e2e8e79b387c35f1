"""Routing requests across engine replicas: round-robin vs prefix-aware (chapter 09b).

Each replica (a separate engine process, usually on its own GPU) has its own
prefix cache: a prompt cached on replica 0 does nothing for a request sent to
replica 1. How requests are spread over replicas therefore decides the hit
rate as much as how the prompts are written.

* ``RoundRobinRouter`` ignores the prompt: every system prompt ends up cached
  on every replica, which costs each replica memory and, under pressure,
  evictions.
* ``PrefixHashRouter`` sends requests whose first block(s) are equal to the
  same replica (a consistent hash of the prefix, like a "prompt cache key").
* ``CacheAwareRouter`` keeps an index of which block hashes each replica
  holds, fed by the replicas' KV-cache events (block stored / block removed,
  like vLLM's ``BlockStored`` / ``BlockRemoved``), and picks the replica with
  the longest cached prefix; ties go to the least-loaded replica.

Replicas are ``CacheReplica`` (the KV-cache bookkeeping of an engine
and nothing else: fast, deterministic), ``LLMReplica`` (a real ``LLM``) or
``HTTPReplica`` (a server process, reached over its OpenAI API).
With ``max_tokens=1`` and requests served one after another, both report the
same cached-token counts.

vLLM itself routes nothing: this is the job of a router in front of it
(vLLM's production stack, llm-d, NVIDIA Dynamo), which subscribes to the
engines' KV events (``--kv-events-config``, ``vllm/distributed/kv_events.py``).
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import DEFAULT_BLOCK_SIZE
from ..events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from ..hashing import BlockHash, hash_request_tokens, none_hash_for
from ..kv_cache_manager import KVCacheManager, longest_cache_hit
from ..request import Request
from ..scheduler import schedule_whole_prompt

WorkItem = Sequence[int] | tuple[Sequence[int], str | None]


# -- replicas ------------------------------------------------------------------------
class Replica(Protocol):
    name: str

    def serve(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Run one request to completion; return its number of cached prompt tokens."""

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call (blocks stored and removed)."""


class CacheReplica:
    """A replica reduced to its KV-cache bookkeeping: one ``KVCacheManager``, no model.

    ``serve`` does what the scheduler does for a request that runs alone:
    look up the cached prefix, allocate blocks for the rest, mark the prompt
    computed, free the request. The model's work is skipped, the cache's
    state afterwards is the engine's.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, name: str = "replica") -> None:
        self.name = name
        self.block_size = block_size
        self.manager = KVCacheManager(num_blocks, block_size, enable_kv_cache_events=True)
        self.num_requests = 0

    def serve(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        request = Request(f"{self.name}-{self.num_requests}", list(token_ids), self.block_size, cache_salt)
        self.num_requests += 1
        num_hit_tokens = schedule_whole_prompt(self.manager, request)
        if num_hit_tokens is None:
            raise ValueError(
                f"{self.name}: a prompt of {request.num_tokens} tokens does not fit in "
                f"{self.manager.num_blocks} blocks of {self.block_size}"
            )
        self.manager.free(request)
        return num_hit_tokens

    def take_events(self) -> list[KVCacheEvent]:
        return self.manager.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget this replica's cached prefixes (its next events start with ``AllBlocksCleared``)."""
        return self.manager.reset_prefix_cache()

    @property
    def hit_rate(self) -> float:
        return self.manager.prefix_cache_stats.hit_rate


class LLMReplica:
    """A real engine as a replica: each request generates one token, greedily."""

    def __init__(self, llm: Any, name: str = "replica") -> None:
        from ..sampling_params import SamplingParams

        self.name = name
        self.llm = llm
        self.params = SamplingParams(temperature=0.0, max_tokens=1)
        self.num_requests = 0
        self._events: list[KVCacheEvent] = []
        llm.llm_engine.add_listener(self._listen)

    def _listen(self, event: Any) -> None:
        # The engine passes the block pool's KV events on unchanged; keep those.
        if isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            self._events.append(event)

    def serve(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        prompt: dict = {"prompt_token_ids": list(token_ids)}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        self.num_requests += 1
        return self.llm.generate([prompt], self.params)[0].num_cached_tokens

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Reset the engine's prefix cache; its ``AllBlocksCleared`` reaches the router like any event."""
        return self.llm.llm_engine.reset_prefix_cache()

    @property
    def hit_rate(self) -> float:
        return self.llm.llm_engine.get_stats().hit_rate


# -- routers -------------------------------------------------------------------------
class Router(Protocol):
    name: str

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The index of the replica that serves this request."""

    def observe(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        """KV-cache events a replica emitted (routers that do not care ignore them)."""


class RoundRobinRouter:
    """Replica 0, 1, 2, ..., 0, 1, ...: balanced load, blind to the prompt."""

    name = "round-robin"

    def __init__(self, num_replicas: int) -> None:
        self._next = itertools.cycle(range(num_replicas))

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return next(self._next)

    def observe(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        pass


class PrefixHashRouter:
    """Replica = hash(first ``num_prefix_blocks`` blocks of tokens, salt) mod ``num_replicas``.

    Requests that share their first block(s) (a system prompt) always land on
    the same replica, so that replica's cache serves them all. Stateless and
    cheap; blind to load and to what each replica really holds.
    """

    name = "prefix-hash"

    def __init__(self, num_replicas: int, block_size: int = DEFAULT_BLOCK_SIZE, num_prefix_blocks: int = 1) -> None:
        self.num_replicas = num_replicas
        self.num_prefix_tokens = block_size * num_prefix_blocks

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        key = (tuple(token_ids[: self.num_prefix_tokens]), cache_salt)
        digest = hashlib.sha256(pickle.dumps(key, protocol=5)).digest()
        return int.from_bytes(digest[:8], "big") % self.num_replicas

    def observe(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        pass


class CacheAwareRouter:
    """Longest cached prefix wins; ties go to the replica that served the fewest requests.

    Owns a mirror of each replica's prefix cache (block hash -> how many
    blocks hold it there: two requests admitted in one step may compute the
    same block twice) kept current from the replicas' KV events. It hashes each incoming prompt the
    way the engines do (same block size, same hash function, same
    ``NONE_HASH``) and counts, per replica, how many leading blocks it holds.
    A replica with an offloading tier (``kv_offload``) sends the tier's events too
    (``medium="CPU"``): its blocks in host memory count like the pool's, since a hit
    there is loaded, not recomputed (vllm-router's ``kv_aware`` gives them less credit).
    """

    name = "cache-aware"

    def __init__(
        self,
        num_replicas: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        block_key: Callable[[BlockHash], Any] | None = None,
        hash_seed: str | None = None,
    ) -> None:
        self.block_size = block_size
        # The replicas' PYTHONHASHSEED when it is not this process's: their NONE_HASH, the first
        # block's parent, comes from it (mini_vllm/hashing.py), and the router must hash as they do.
        self.none_hash = None if hash_seed is None else none_hash_for(hash_seed)
        # How the replicas' events name a block: the hash itself in process; over ZMQ, what vLLM's
        # wire carries (mini_vllm.distributed.kv_events.external_block_hash: its low 64 bits).
        self.block_key = block_key
        self.cached: list[Counter[Any]] = [Counter() for _ in range(num_replicas)]
        self.num_routed = [0] * num_replicas

    def cached_prefix_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """For each replica: how many leading blocks of the prompt it holds (as far as the router knows)."""
        hashes = hash_request_tokens(list(token_ids), self.block_size, cache_salt, none_hash=self.none_hash)
        if self.block_key is not None:
            hashes = [self.block_key(h) for h in hashes]
        return [len(longest_cache_hit(hashes, held.get)) for held in self.cached]

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        counts = self.cached_prefix_blocks(token_ids, cache_salt)
        best = min(range(len(counts)), key=lambda i: (-counts[i], self.num_routed[i], i))
        self.num_routed[best] += 1
        return best

    def observe(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        held = self.cached[replica]
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    held[block_hash] += 1
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    held[block_hash] -= 1
                    if held[block_hash] <= 0:
                        del held[block_hash]
            elif isinstance(event, AllBlocksCleared):
                held.clear()


# -- running a workload ----------------------------------------------------------------
@dataclass
class RoutingResult:
    """What happened to each request: where it went and how many prompt tokens it found cached."""

    router: str
    num_replicas: int
    replica: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        total = sum(self.num_tokens)
        return sum(self.num_cached_tokens) / total if total else 0.0

    @property
    def cumulative_hit_rate(self) -> list[float]:
        """The hit rate over the first 1, 2, ... requests."""
        rates, hits, total = [], 0, 0
        for n, h in zip(self.num_tokens, self.num_cached_tokens):
            hits, total = hits + h, total + n
            rates.append(hits / total)
        return rates

    @property
    def requests_per_replica(self) -> list[int]:
        return [self.replica.count(i) for i in range(self.num_replicas)]

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed across all replicas."""
        return sum(self.num_tokens) - sum(self.num_cached_tokens)

    def summary(self) -> str:
        return (
            f"{self.router:<12} hit rate {self.hit_rate:6.1%}   prefill tokens {self.prefill_tokens:>6}   "
            f"requests per replica {self.requests_per_replica}"
        )


class HTTPReplica:
    """A replica behind an OpenAI-compatible server (``python -m mini_vllm serve``, or vLLM's own).

    Each request is a ``/v1/completions`` call with the token ids as the prompt and
    ``max_tokens=1``; the server's ``usage.prompt_tokens_details.cached_tokens`` (it must
    run with ``--enable-prompt-tokens-details``) is the number of cached tokens. No KV
    events come over HTTP: a server started with ``--kv-events-config`` (vLLM's, or
    ``python -m mini_vllm serve``) publishes them on ZMQ, and ``kv_events`` (a
    ``mini_vllm.distributed.kv_events.KVEventSubscriber`` on its endpoints) reads them, so
    that ``CacheAwareRouter(block_key=external_block_hash)`` routes from the same stream a
    production router reads. Without it, this replica suits the routers that need no
    events: round-robin and the prefix hash.
    """

    def __init__(self, base_url: str, model: str, name: str = "replica", kv_events: Any = None) -> None:
        import httpx

        self.name = name
        self.model = model
        self.num_requests = 0
        self.kv_events = kv_events
        self._client = httpx.Client(base_url=base_url, timeout=300)

    def serve(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        body: dict[str, Any] = {"model": self.model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        response = self._client.post("/v1/completions", json=body)
        response.raise_for_status()
        self.num_requests += 1
        details = response.json()["usage"]["prompt_tokens_details"]
        if details is None:
            raise ValueError(f"{self.name}: the server does not report cached tokens (--enable-prompt-tokens-details)")
        return details["cached_tokens"]

    def take_events(self) -> list[KVCacheEvent]:
        return [] if self.kv_events is None else self.kv_events.take_events()

    def reset_prefix_cache(self) -> bool:
        response = self._client.post("/reset_prefix_cache")
        response.raise_for_status()
        return response.json()["success"]


def _split(item: WorkItem) -> tuple[list[int], str | None]:
    if isinstance(item, tuple) and len(item) == 2 and not isinstance(item[1], int):
        return list(item[0]), item[1]
    return list(item), None


def run_workload(router: Router, replicas: Sequence[Replica], workload: Sequence[WorkItem]) -> RoutingResult:
    """Send each request (token ids, or ``(token_ids, cache_salt)``) where ``router`` says, in order."""
    result = RoutingResult(getattr(router, "name", type(router).__name__), len(replicas))
    for item in workload:
        token_ids, salt = _split(item)
        index = router.route(token_ids, salt)
        replica = replicas[index]
        result.replica.append(index)
        result.num_tokens.append(len(token_ids))
        result.num_cached_tokens.append(replica.serve(token_ids, salt))
        router.observe(index, replica.take_events())
    return result


__all__ = [
    "CacheReplica",
    "LLMReplica",
    "HTTPReplica",
    "RoundRobinRouter",
    "PrefixHashRouter",
    "CacheAwareRouter",
    "RoutingResult",
    "run_workload",
]
