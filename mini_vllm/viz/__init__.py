"""Live widgets of the KV cache: what the engine really does, drawn from its own state.

* ``PoolView`` — every physical block: free / in use / cached, ref_cnt, owners,
  short hash, its place in the free queue (the next eviction marked).
* ``BlockTableView`` — per request: logical → physical blocks, prefix-cache
  hits, shared blocks, the partial tail.
* ``FreeQueueView`` — the free queue head → tail (LRU order).
* ``HashChainView`` — a prompt cut into blocks with chained hashes, each a hit
  or a miss against the cache now, and where the chain breaks.
* ``EngineDashboard`` — all of them with Step / Run / Reset buttons, a metrics
  line and a hit-rate plot, following the engine live.

The views take an ``LLM``/``LLMEngine`` or, for the early chapters, a bare
``KVCacheManager`` (plus the scenario's requests). Each renders as static HTML
and deterministic text too, so notebooks show it without a kernel. On a
hybrid model (chapter 08b) they show every KV-cache group: one block-table
row per group (∅ where a block left the sliding window), each block's group.
"""

from .dashboard import EngineDashboard
from .hash_chain import HashChainView
from .state import BlockInfo, CacheSnapshot, KVCacheGroupInfo, RequestInfo, StateSource
from .block_table_view import BlockTableView
from .views import FreeQueueView, PoolView, StaticSnapshot, View

__all__ = [
    "EngineDashboard",
    "PoolView",
    "BlockTableView",
    "FreeQueueView",
    "HashChainView",
    "View",
    "StaticSnapshot",
    "StateSource",
    "CacheSnapshot",
    "BlockInfo",
    "RequestInfo",
    "KVCacheGroupInfo",
]
