"""The words of KV-cache offloading: keys, lookup results, events, a request's context, the manager's interface.

A *tier* below the pool keeps copies of full KV blocks after the pool has
evicted them, so that a later request with the same prefix loads them back
instead of recomputing them. This module owns what every tier shares:

* ``OffloadKey``: how a tier names a block, the block's hash followed by its
  KV-cache group's index in 4 bytes (``make_offload_key``), so a hybrid
  model's two groups never mix up the same hash;
* ``LookupResult`` and ``Medium`` (where a tier keeps its copies: ``CPU``,
  host memory, or ``STORAGE``, a file system);
* ``ReqContext``: what the tier learns about one request, the end-token
  position of each of its keys, and a scratch space where each party (the
  manager, a policy) keeps its own notes about the request;
* ``PrepareStoreOutput`` and ``OffloadingEvent`` (a key stored or removed,
  with its medium: what a KV-aware router listens to);
* ``OffloadingManager``: the calls the scheduler makes on a tier, in the
  order a block lives through them.

A block's life in a tier, as the scheduler sees it::

    prepare_store -> (the worker copies it) -> complete_store   now lookup says HIT
    lookup -> prepare_load -> (the worker copies it back) -> complete_load
    prepare_store of other blocks, when the tier is full -> it is evicted

vLLM equivalent: ``vllm/v1/kv_offload/base.py``. Left out: tier filters,
locality and ownership (several tiers, remote tiers), the lock (one thread
here), metrics and config-info plumbing, and ``LoadStoreSpec``'s subclasses:
a CPU tier's spec is simply the list of its chunk ids (``CPULoadStoreSpec``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from ..hashing import BlockHash

OffloadKey = bytes  # a block hash + its group index (4 bytes, big-endian): see make_offload_key

GROUP_INDEX_BYTES = 4


def make_offload_key(block_hash: BlockHash, group_idx: int) -> OffloadKey:
    """The tier's name for block ``block_hash`` of KV-cache group ``group_idx``."""
    return block_hash + group_idx.to_bytes(GROUP_INDEX_BYTES, "big", signed=False)


def get_offload_block_hash(key: OffloadKey) -> BlockHash:
    """The block hash inside ``key``."""
    return key[:-GROUP_INDEX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index inside ``key``."""
    return int.from_bytes(key[-GROUP_INDEX_BYTES:], "big", signed=False)


class Medium(Enum):
    """Where a tier keeps its copies."""

    CPU = "CPU"  # host memory
    STORAGE = "STORAGE"  # a file system


class LookupResult(Enum):
    """What ``OffloadingManager.lookup`` says about one key."""

    MISS = auto()  # not in the tier
    HIT = auto()  # stored and readable
    HIT_PENDING = auto()  # being stored: not readable yet
    RETRY = auto()  # the tier cannot tell now (an asynchronous tier); the CPU tier never says it


@dataclass
class ReqContext:
    """What the tier knows about one request.

    ``key_positions`` maps each of the request's keys to the position of the
    token that ends its block (the scheduler records them), so the tier can
    put a request's keys in prefix order. ``notes`` is per-request scratch
    space: each party that needs to remember something about the request (the
    manager, a cache policy) keeps it under its own key, itself.
    """

    req_id: str
    key_positions: dict[OffloadKey, int] = field(default_factory=dict)
    notes: dict[object, Any] = field(default_factory=dict, repr=False)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self.key_positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self.key_positions.get(key)


@dataclass
class CPULoadStoreSpec:
    """Where in a CPU tier to read or write: one chunk id (a slot of the tier's host tensors) per key."""

    chunk_ids: list[int]


@dataclass
class PrepareStoreOutput:
    """What ``prepare_store`` decided: which keys to copy (the others are already there), where, and who left."""

    keys_to_store: list[OffloadKey]
    store_spec: CPULoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    """Keys stored in (``removed=False``) or removed from (``removed=True``) a tier on ``medium``.

    ``metadata_only`` marks the removal of keys whose store failed: they were
    never announced as stored, so a listener has nothing to forget.
    """

    keys: list[OffloadKey]
    medium: Medium
    removed: bool
    metadata_only: bool = False


class OffloadingManager(ABC):
    """The scheduler's side of one tier: which keys it holds, and where; it never copies a byte.

    Every call takes the request's ``ReqContext``. The copies themselves are
    the worker's, which copies between the pool's tensors and the tier's.
    """

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> None:
        """A request the scheduler sees for the first time."""

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Is one block in the tier and readable?"""

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        """Pin blocks (all must be HITs) against eviction until ``complete_load``, and say where they are."""

    @abstractmethod
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark blocks as used just now (also blocks that need no load, such as the pool's own hits)."""

    @abstractmethod
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """The loads of ``keys`` are done: unpin them."""

    @abstractmethod
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Make room for the keys not yet in the tier; None when too few blocks can be evicted."""

    @abstractmethod
    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """The stores of ``keys`` are done (readable from now on), or failed (forget them)."""

    @abstractmethod
    def on_request_finished(self, req_context: ReqContext) -> None:
        """The request will make no more calls: count its accesses, in prefix order."""

    @abstractmethod
    def take_events(self) -> list[OffloadingEvent]:
        """The events since the last call."""

    @abstractmethod
    def reset_cache(self) -> None:
        """Forget every block (pinned or not) and every policy state."""
