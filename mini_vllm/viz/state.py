"""What the widgets show, read from the running engine (or a bare KV-cache manager).

A ``StateSource`` wraps whatever the learner has — an ``LLM``, an
``LLMEngine`` or, in the early chapters, a bare ``KVCacheManager`` plus the
``Request`` objects of a scripted scenario — and turns it into a
``CacheSnapshot``: plain, frozen data (block ids, ref counts, hashes, owners,
free-queue order, block tables) that the views render. The cache itself is
read in one place, ``KVCacheManager.snapshot`` (the pool's part:
``BlockPool.snapshot``); this module adds what the widgets need on top of it
(owners, token text, request progress) and never reaches into the pool.
Reading never changes the engine: no block is touched, no event is taken.

Everything in a snapshot is deterministic for a deterministic run: lists are
in block-id, free-queue or request-insertion order, never in set or hash order.

Every model has one or more KV-cache groups over one pool (a hybrid model,
chapter 08b, has several): the snapshot describes them
(``CacheSnapshot.kv_cache_groups``), gives every request's table in each group
(``RequestInfo.block_ids``, the null block as ``NULL_BLOCK_ID``, -1) and every
block's group (``BlockInfo.group``); owners are counted over every group's
tables. The views run one path for any number of groups: what tells groups
apart (a tag, a colour strip, a row or a column per group) comes from
``CacheSnapshot.labelled_groups``, empty for a single group, which therefore
renders with no group marks at all.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..block_pool import NULL_BLOCK_ID
from ..events import BlockStored
from ..kv_cache_interface import SlidingWindowSpec
from ..kv_cache_manager import KVCacheManager, PrefixCacheStats
from ..request import Request

# Block states, one letter each so they read without colour.
FREE = "F"  # ref_cnt 0, no hash: an empty free block
USED = "U"  # ref_cnt > 0, no hash (yet): a partial block, or caching is off
CACHED = "C"  # ref_cnt 0 with a hash: free, but its K/V can still be hit
USED_CACHED = "UC"  # ref_cnt > 0 with a hash: in use and in the prefix cache


def natural_key(text: str) -> list:
    """Sort key that puts "r2" before "r10" (ids are compared piecewise, numbers as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def short_hash(block_hash: bytes | None, length: int = 4) -> str:
    """The first ``length`` hex digits of a block hash ("" for None)."""
    return block_hash.hex()[:length] if block_hash is not None else ""


@dataclass(frozen=True)
class KVCacheGroupInfo:
    """One KV-cache group: its kind and layers (a single-group engine has one, full attention)."""

    group_id: int
    sliding_window: int | None = None  # None: full attention
    layer_ids: tuple[int, ...] = ()  # the model's layers in the group (() for a bare manager's default group)
    # Where several groups share the spec (Gemma 3's five sliding-window groups): this one's
    # place among them, from 1, and how many they are; (0, 1) when the spec is this group's alone.
    spec_index: int = 0
    spec_count: int = 1

    @property
    def is_sliding_window(self) -> bool:
        return self.sliding_window is not None

    @property
    def kind(self) -> str:
        """``"full attention"`` or ``"sliding window"``."""
        return "sliding window" if self.is_sliding_window else "full attention"

    @property
    def description(self) -> str:
        """``"full attention"`` or ``"sliding window 64 tokens"`` (``"... (2 of 5)"`` among groups of one spec)."""
        kind = f"sliding window {self.sliding_window} tokens" if self.is_sliding_window else "full attention"
        return f"{kind} ({self.spec_index} of {self.spec_count})" if self.spec_count > 1 else kind

    @property
    def tag(self) -> str:
        """A short label for cells and text columns: ``"full"`` or ``"SW64"`` (``"SW64.2"`` among groups of one spec)."""
        tag = f"SW{self.sliding_window}" if self.is_sliding_window else "full"
        return f"{tag}.{self.spec_index}" if self.spec_count > 1 else tag

    @property
    def layers_text(self) -> str:
        """``"layers 1, 3"`` (``""`` when the layers are not known)."""
        if not self.layer_ids:
            return ""
        return ("layer " if len(self.layer_ids) == 1 else "layers ") + ", ".join(map(str, self.layer_ids))


@dataclass(frozen=True)
class BlockInfo:
    """One physical block as the pool sees it (never the null block: it is not in the pool)."""

    block_id: int
    ref_cnt: int
    block_hash: bytes | None
    owners: tuple[str, ...]  # requests whose block table (of any group) holds it
    free_position: int | None  # 0 = head of the free queue (reused first); None = in use
    token_ids: tuple[int, ...] | None  # its tokens, where known
    k_norm: float | None  # ‖K‖ of the block in one layer, where the engine has tensors
    # The KV-cache group whose tables hold it or, once free, that it is cached for;
    # None for a free, empty block. A block belongs to one group at a time.
    group: int | None = None

    @property
    def state(self) -> str:
        if self.ref_cnt > 0:
            return USED_CACHED if self.block_hash is not None else USED
        return CACHED if self.block_hash is not None else FREE

    @property
    def is_shared(self) -> bool:
        return self.ref_cnt > 1


@dataclass(frozen=True)
class RequestInfo:
    """One request's block table and progress."""

    request_id: str
    status: str  # "waiting", "running", "preempted", "finished_..." or "?"
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    # The block table in every KV-cache group, in group order: logical block i of group g lives in
    # physical block block_ids[g][i] (the null block is NULL_BLOCK_ID, -1). One table with one group.
    block_ids: tuple[tuple[int, ...], ...]
    num_hit_blocks: int  # the first logical blocks that came from the prefix cache (in every group)
    token_ids: tuple[int, ...]

    def is_hit(self, index: int, group: int = 0) -> bool:
        """Logical block ``index`` of ``group``'s table is a block that came from the prefix cache.

        The hit covers the first ``num_hit_blocks`` positions of every group;
        a sliding-window group holds the null block at those before its
        window (nothing was taken there), and later the window moves on.
        """
        table = self.block_ids[group]
        return index < self.num_hit_blocks and index < len(table) and table[index] != NULL_BLOCK_ID

    def tokens_in_block(self, index: int, block_size: int) -> int:
        """How many token slots of logical block ``index`` are filled (or reserved for the next token)."""
        covered = min(self.num_tokens, len(self.block_ids[0]) * block_size)
        return max(0, min(block_size, covered - index * block_size))


@dataclass(frozen=True)
class CacheSnapshot:
    """The whole KV-cache state at one moment."""

    block_size: int
    blocks: tuple[BlockInfo, ...]  # by block id
    requests: tuple[RequestInfo, ...]
    free_queue: tuple[int, ...]  # block ids, head (reused first) to tail
    cached: Mapping[bytes, int]  # hash -> the block a lookup returns
    hash_algo: str = "sha256"
    num_steps: int | None = None  # None without an engine
    num_running: int = 0
    num_waiting: int = 0
    # A copy of the manager's counters (re-admissions after preemption apart, as vLLM 0.33 counts).
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_evictions: int = 0
    num_preemptions: int = 0
    # The KV-cache groups, in group order (one, full attention, but in a hybrid model).
    kv_cache_groups: tuple[KVCacheGroupInfo, ...] = (KVCacheGroupInfo(0),)
    # Per group: hash -> the block of that group a lookup returns (``cached`` is group 0's).
    cached_by_group: tuple[Mapping[bytes, int], ...] = ()
    # The free queue's head (the next block popped) and the first cached block from the head
    # (popping it is the next eviction): the pool snapshot's ``next_to_reuse`` / ``next_to_evict``.
    next_to_reuse: int | None = None
    next_to_evict: int | None = None

    @property
    def groups(self) -> tuple[str, ...]:
        """The groups' descriptions: ``("full attention", "sliding window 64 tokens")``."""
        return tuple(group.description for group in self.kv_cache_groups)

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_groups)

    @property
    def labelled_groups(self) -> tuple[KVCacheGroupInfo, ...]:
        """The groups the views tell apart (tag, colour strip, a row or column each): every group when there
        are several; none for a single group, which has nothing to tell apart and shows no group marks."""
        return self.kv_cache_groups if len(self.kv_cache_groups) > 1 else ()

    def group_tag(self, group: int | None) -> str:
        """Group ``group``'s tag (``full``, ``SW64``) where groups are told apart; "" for one group or for None."""
        return self.kv_cache_groups[group].tag if self.labelled_groups and group is not None else ""

    def blocks_in_group(self, group: int) -> int:
        """How many blocks belong to ``group`` now (held in its tables, or cached for it)."""
        return sum(1 for block in self.blocks if block.group == group)

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_stats.hit_rate

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_blocks_in_use(self) -> int:
        return sum(1 for block in self.blocks if block.ref_cnt > 0)


class StateSource:
    """Reads the state of an ``LLM`` / ``LLMEngine`` (live) or a bare ``KVCacheManager``.

    Args:
        source: an ``LLM``, an ``LLMEngine`` or a ``KVCacheManager``.
        requests: for a bare manager, the scenario's ``Request`` objects (a
            dict by id or any iterable); they give token ids, status and hits.
            An engine's own requests are always included.
        tokenizer: turns token ids into text for the tooltips (default: the
            engine's tokenizer; without one tooltips show token ids).

    Owns one cache of ``hash -> token ids`` (pruned to the hashes still in the
    pool), so a cached block keeps its text after its request is gone.
    """

    def __init__(self, source: Any, requests: Any = None, tokenizer: Any = None) -> None:
        self.engine = None
        if hasattr(source, "llm_engine"):  # an LLM
            self.engine = source.llm_engine
        elif hasattr(source, "kv_cache_manager") and hasattr(source, "scheduler"):  # an LLMEngine
            self.engine = source
        if self.engine is not None:
            self.manager: KVCacheManager = self.engine.kv_cache_manager
            self.tokenizer = tokenizer if tokenizer is not None else getattr(self.engine, "tokenizer", None)
            self.hash_algo = self.engine.config.hash_algo
        elif isinstance(source, KVCacheManager):
            self.manager = source
            self.tokenizer = tokenizer
            self.hash_algo = "sha256"
        else:
            raise TypeError(f"a view needs an LLM, an LLMEngine or a KVCacheManager, got {type(source).__name__}")
        self.extra_requests: dict[str, Request] = {}
        self.add_requests(requests)
        # request id -> number of hit blocks, from ComputedBlocksFound events (the dashboard fills it).
        self.hit_blocks: dict[str, int] = {}
        self._tokens_by_hash: dict[bytes, tuple[int, ...]] = {}

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    def observe(self, event: Any) -> None:
        """Remember what a block holds the moment it is cached (live views call this per event).

        Recording at ``BlockStored`` time, not at render time, keeps the
        rendering independent of when the throttled widget happened to redraw:
        a cached block keeps its token text after its request has finished.
        """
        if not isinstance(event, BlockStored):
            return
        size = event.block_size
        for index, block_hash in enumerate(event.block_hashes):
            if block_hash not in self._tokens_by_hash:
                self._tokens_by_hash[block_hash] = tuple(event.token_ids[index * size : (index + 1) * size])

    def add_requests(self, requests: Any) -> None:
        """Make more scenario requests known (a dict by id, or an iterable of ``Request``)."""
        if requests is None:
            return
        items = requests.values() if isinstance(requests, Mapping) else requests
        for request in items:
            self.extra_requests[request.request_id] = request

    def known_requests(self) -> dict[str, Request]:
        """Every request the views can describe: the engine's, then the scenario's."""
        known: dict[str, Request] = {}
        if self.engine is not None:
            known.update(self.engine.requests)
        for request_id, request in self.extra_requests.items():
            known.setdefault(request_id, request)
        return known

    def decode(self, token_ids: Iterable[int]) -> str | None:
        """Token ids as text, or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(token_ids))

    def k_norms(self, layer: int = 0) -> list[float] | None:
        """‖K‖ per physical block in ``layer`` (the model runner's statistic), or None without tensors."""
        runner = getattr(self.engine, "model_runner", None)
        if runner is None or not hasattr(runner, "block_statistic"):
            return None
        return [float(value) for value in runner.block_statistic(layer).tolist()]

    # -- the snapshot ---------------------------------------------------------
    def snapshot(self, k_norm: bool = False, layer: int = 0) -> CacheSnapshot:
        """What the views render, built from the manager's own snapshot (``KVCacheManager.snapshot``)."""
        cache = self.manager.snapshot()
        pool = cache.block_pool
        block_size = self.manager.block_size
        known = self.known_requests()

        owners: dict[int, list[str]] = {}
        held_by_group: dict[int, int] = {}
        tokens_by_block: dict[int, tuple[int, ...]] = {}
        for group_id, tables in enumerate(cache.req_to_block_ids):
            for request_id, table in tables.items():
                request = known.get(request_id)
                for index, block_id in enumerate(table):
                    if block_id == NULL_BLOCK_ID:  # a placeholder, not a block
                        continue
                    owners.setdefault(block_id, []).append(request_id)
                    held_by_group.setdefault(block_id, group_id)
                    if request is not None and block_id not in tokens_by_block:
                        start = index * block_size
                        tokens = tuple(request.all_token_ids[start : start + block_size])
                        if tokens:
                            tokens_by_block[block_id] = tokens

        # Remember what each cached hash holds, from every request we know.
        for request in known.values():
            tokens = request.all_token_ids
            for index, block_hash in enumerate(request.block_hashes):
                if block_hash not in self._tokens_by_hash:
                    self._tokens_by_hash[block_hash] = tuple(tokens[index * block_size : (index + 1) * block_size])
        cached_by_group = [pool.cached_block_ids(group_id) for group_id in range(cache.num_kv_cache_groups)]
        in_pool = set().union(*cached_by_group)
        self._tokens_by_hash = {h: t for h, t in self._tokens_by_hash.items() if h in in_pool}

        position = {block_id: place for place, block_id in enumerate(pool.free_block_queue)}
        norms = self.k_norms(layer) if k_norm else None

        blocks = []
        for block in pool.blocks:
            tokens = tokens_by_block.get(block.block_id)
            if tokens is None and block.block_hash is not None:
                tokens = self._tokens_by_hash.get(block.block_hash)
            group = held_by_group.get(block.block_id)
            if group is None and block.block_hash is not None:
                group = block.kv_cache_group_id
            blocks.append(
                BlockInfo(
                    block_id=block.block_id,
                    ref_cnt=block.ref_cnt,
                    block_hash=block.block_hash,
                    owners=tuple(sorted(owners.get(block.block_id, []), key=natural_key)),
                    free_position=position.get(block.block_id),
                    token_ids=tokens,
                    k_norm=norms[block.block_id] if norms is not None else None,
                    group=group,
                )
            )

        requests = []
        request_ids = list(known)
        for tables in cache.req_to_block_ids:
            request_ids += [rid for rid in tables if rid not in known and rid not in request_ids]
        for request_id in request_ids:
            request = known.get(request_id)
            block_ids = cache.get_block_ids_by_group(request_id)
            if request is None:
                requests.append(RequestInfo(request_id, "?", 0, 0, 0, block_ids, 0, ()))
                continue
            if request_id in self.hit_blocks:
                num_hit_blocks = self.hit_blocks[request_id]
            elif request.num_cached_tokens >= 0:
                num_hit_blocks = request.num_cached_tokens // block_size
            else:
                num_hit_blocks = 0
            requests.append(
                RequestInfo(
                    request_id=request_id,
                    status=request.status.value,
                    num_tokens=request.num_tokens,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_computed_tokens=request.num_computed_tokens,
                    block_ids=block_ids,
                    num_hit_blocks=min(num_hit_blocks, len(block_ids[0])),
                    token_ids=tuple(request.all_token_ids),
                )
            )

        engine = self.engine
        return CacheSnapshot(
            block_size=block_size,
            blocks=tuple(blocks),
            requests=tuple(requests),
            free_queue=pool.free_block_queue,
            cached=cached_by_group[0],
            hash_algo=self.hash_algo,
            num_steps=engine.num_steps if engine is not None else None,
            num_running=len(engine.scheduler.running) if engine is not None else 0,
            num_waiting=len(engine.scheduler.waiting) if engine is not None else 0,
            prefix_cache_stats=cache.prefix_cache_stats,
            num_evictions=cache.num_evictions,
            num_preemptions=engine.scheduler.num_preemptions if engine is not None else 0,
            kv_cache_groups=self.kv_cache_groups(),
            cached_by_group=tuple(cached_by_group),
            next_to_reuse=pool.next_to_reuse,
            next_to_evict=pool.next_to_evict,
        )

    def kv_cache_groups(self) -> tuple[KVCacheGroupInfo, ...]:
        """The manager's KV-cache groups, described (one full-attention group without a ``kv_cache_config``)."""
        config = getattr(self.manager, "kv_cache_config", None)
        if config is None:
            return (KVCacheGroupInfo(0),)
        specs = [group.kv_cache_spec for group in config.kv_cache_groups]
        groups = []
        for group_id, (group, spec) in enumerate(zip(config.kv_cache_groups, specs)):
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            spec_count = specs.count(spec)
            spec_index = specs[: group_id + 1].count(spec) if spec_count > 1 else 0
            groups.append(KVCacheGroupInfo(group_id, window, tuple(group.layer_ids), spec_index, spec_count))
        return tuple(groups)
