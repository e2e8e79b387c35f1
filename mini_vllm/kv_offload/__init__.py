"""KV-cache offloading: a second tier below the pool, in host memory (chapter on offloading).

When the pool evicts a cached block, its prefix is gone; with a tier, a copy
of every full block is kept in host memory, and a later request whose prefix
runs on past the pool's hits, along the same hash chain, into the tier
loads those blocks back instead of recomputing them.

* ``base.py``: the words (``OffloadKey``, ``LookupResult``, ``ReqContext``,
  events with their medium) and the calls a scheduler makes on a tier
  (``OffloadingManager``);
* ``cpu_manager.py``: the CPU tier's bookkeeping (``CPUOffloadingManager``);
* ``cache_policy.py``, ``lru.py``, ``arc.py``: its eviction policies;
* ``spec.py``: which policy the settings choose (vLLM's ``kv_transfer_config``,
  ``{"kv_connector_extra_config": {"eviction_policy": "arc"}}``);
* ``connector.py``: the tier in the engine (``OffloadingConnector``): the
  lookup past the pool's hit at admission, the loads before the forward
  pass, the stores after it (``LLM(kv_offloading_size=...)``);
* ``file_mapper.py``, ``fs_tier.py``, ``tiering.py``: a file-system tier
  below the CPU tier (``FileMapper``, ``FileSystemTierManager``,
  ``TieringOffloadingManager``), written through on every CPU store and read
  back when the CPU tier has lost a block (vLLM's ``secondary_tiers``);
  like ``connector.py`` they use torch, and are imported from their modules.

vLLM equivalent: ``vllm/v1/kv_offload/`` (vLLM 0.33), driven there by the
``OffloadingConnector``.
"""

from .arc import ARCCachePolicy
from .base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from .cache_policy import CachePolicy, ChunkStatus
from .cpu_manager import CACHE_POLICIES, CPUOffloadingManager
from .file_mapper import FileMapper
from .lru import LRUCachePolicy, lru_evict

__all__ = [
    "ARCCachePolicy",
    "CACHE_POLICIES",
    "CPUOffloadingManager",
    "CachePolicy",
    "ChunkStatus",
    "FileMapper",
    "LRUCachePolicy",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "lru_evict",
    "make_offload_key",
]
