"""Two tiers as one: the CPU tier on top, the file-system tier below it, looked up along the same hash chain.

``TieringOffloadingManager`` is what the ``OffloadingConnector`` talks to when
``kv_connector_extra_config`` names a secondary tier (``spec.py``). It is an
``OffloadingManager`` like the CPU tier alone, and passes every call to it
(the *primary* tier, the only one the pool copies to and from), adding:

* **the store path, write-through**: when a store into the CPU tier
  completes (``complete_store``), the same chunks are written to disk
  (``FileSystemTierManager.store``). The chunks cannot be evicted while it
  runs: the write happens before they become idle.
* **the load path, a promotion**: a key the CPU tier misses and the disk
  holds gets a CPU chunk (``prepare_store`` on the CPU tier, for this
  request), its file is read into it, and the store completes: the key is
  now a CPU-tier HIT, and the connector loads it into the pool as any other.
  A file that cannot be read (a truncated one is deleted) gives its chunk
  back and answers MISS: the connector's chain stops there and the request
  recomputes from that block; the blocks before it stay hits.

**Where this differs from vLLM.** vLLM's promotion is asynchronous: the lookup
reserves the CPU chunk and answers ``HIT_PENDING``, the connector makes the
request wait, the disk read is submitted at the end of the step
(``on_schedule_end``) and runs on a thread pool, and on a later step the
request's lookup finds a CPU-tier HIT. Here the read is done in the lookup
itself, so the block is a CPU-tier hit in the same admission. The counters
come out the same: vLLM records a request's external hits only when it is
admitted, by then from the CPU tier. A promotion protects the keys this
request has found so far from eviction (a synchronous chain would otherwise
evict its own first blocks to promote its last ones; vLLM's retries recover
from that instead).

vLLM equivalent: ``vllm/v1/kv_offload/tiering/manager.py``
(``TieringOffloadingManager``, ``CPUPrimaryTierOffloadingManager``), with one
secondary tier of type ``"fs"``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .base import (
    CPULoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from .cpu_manager import CPUOffloadingManager
from .file_mapper import FileMapper
from .fs_tier import FileSystemTierManager


def make_fs_tiering_manager(
    primary_tier: CPUOffloadingManager,
    model_name: str,
    block_size: int,
    dtype: object,
    layer_ids: Sequence[int],
    root_dir: str,
    enable_kv_events: bool = False,
) -> TieringOffloadingManager:
    """``primary_tier`` with an fs tier under ``root_dir``, in the folder of these settings (vLLM's FileMapper fields)."""
    kv_cache_groups = [
        {"tokens_per_block": block_size, "layer_names": [f"model.layers.{i}.self_attn.attn" for i in layer_ids]}
    ]
    file_mapper = FileMapper(root_dir, model_name, block_size, str(dtype), kv_cache_groups)
    return TieringOffloadingManager(primary_tier, FileSystemTierManager(file_mapper, enable_kv_events))


class TieringOffloadingManager(OffloadingManager):
    """The CPU tier (``primary_tier``) with a file-system tier (``secondary_tier``) below it."""

    def __init__(self, primary_tier: CPUOffloadingManager, secondary_tier: FileSystemTierManager) -> None:
        self.primary_tier = primary_tier
        self.secondary_tier = secondary_tier
        self.num_promoted_keys = 0  # keys read back from disk into the CPU tier, for the chapter's widgets

    @property
    def num_chunks(self) -> int:
        return self.primary_tier.num_chunks

    def resident(self) -> dict[OffloadKey, tuple[int, int]]:
        """The CPU tier's keys (the disk's are its files)."""
        return self.primary_tier.resident()

    def _found_keys(self, req_context: ReqContext) -> set[OffloadKey]:
        """The keys this request's lookups found (kept in its notes): a promotion must not evict them."""
        return req_context.notes.setdefault(self, set())

    # -- the scheduler's calls ----------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> None:
        self.primary_tier.on_new_request(req_context)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        result = self.primary_tier.lookup(key, req_context)
        if result is LookupResult.MISS and self.secondary_tier.lookup(key) and self._promote(key, req_context):
            result = LookupResult.HIT
        if result is LookupResult.HIT:
            self._found_keys(req_context).add(key)
        return result

    def _promote(self, key: OffloadKey, req_context: ReqContext) -> bool:
        """Read ``key``'s file into a CPU chunk; False when the CPU tier has no room or the file is bad."""
        output = self.primary_tier.prepare_store([key], req_context, protected=self._found_keys(req_context))
        if output is None:  # every chunk is pinned: the block is unavailable now (vLLM: MISS too)
            return False
        loaded = self.secondary_tier.load(key, output.store_spec.chunk_ids[0])
        self.primary_tier.complete_store([key], req_context, success=loaded)
        self.num_promoted_keys += loaded
        return loaded

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        return self.primary_tier.prepare_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.primary_tier.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.primary_tier.complete_load(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        return self.primary_tier.prepare_store(keys, req_context)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """The CPU stores are done: write them through to disk while their chunks are still being stored."""
        if success:
            resident = self.primary_tier.resident()
            stored = [key for key in keys if key in resident and resident[key][1] < 0]  # in flight until now
            self.secondary_tier.store(stored, [resident[key][0] for key in stored])
        self.primary_tier.complete_store(keys, req_context, success)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.primary_tier.on_request_finished(req_context)

    def set_events_enabled(self, enabled: bool) -> None:
        self.primary_tier.set_events_enabled(enabled)
        self.secondary_tier.set_events_enabled(enabled)

    def take_events(self) -> list[OffloadingEvent]:
        return self.primary_tier.take_events() + self.secondary_tier.take_events()

    def reset_cache(self) -> None:
        """Forget the CPU tier's blocks; the files stay (vLLM's reset does not delete a shared disk either)."""
        self.primary_tier.reset_cache()
