"""The file-system tier: one file per block on a disk, below the CPU tier, and the copies to and from it.

``FileSystemTierManager`` is a *secondary* tier: it never touches the pool.
Blocks reach it from the CPU tier's host tensors (a write-through of every
completed CPU store) and go back there (a promotion, when the CPU tier has
lost a block the disk still holds). It owns:

* the folder for these settings, and its ``config.json`` (``file_mapper.py``);
* ``lookup``: does the block's file exist? (vLLM's too: no index, so a second
  engine on the same ``root_dir`` sees the first one's files at once);
* ``store``: a chunk's bytes (layer 0's K and V, layer 1's, ...) written to
  ``<file>.tmp``, then renamed, so a reader never sees half a file; a file
  that exists already is left alone (same hash, same bytes);
* ``load``: a file read back into a chunk. A file of the wrong size is
  corrupt: it is deleted and the load fails (the block is recomputed). A file
  of the right size whose bytes were altered cannot be told apart, in
  vLLM's tier as here (no checksum);
* the ``stored`` events with ``medium="STORAGE"``, when the tier's config
  says ``"enable_kv_events": true`` (vLLM's opt-in).

Files are never evicted: the disk is as large as the file system. Nothing
removes them but a person (or a failed load of a truncated file).

vLLM equivalent: ``vllm/v1/kv_offload/tiering/fs/manager.py``
(``FileSystemTierManager``) and ``fs/io.py`` (``_store_block``,
``_load_block``). vLLM reads and writes on a pool of threads and reports
finished jobs at the next step; here each copy is done at once, in the call
(``tiering.py`` says where that changes what a request sees). Left out:
``O_DIRECT``, the thread counts, backpressure, ``locality``.
"""

from __future__ import annotations

import json
import os

import torch

from .base import Medium, OffloadingEvent, OffloadKey
from .file_mapper import FileMapper

TMP_SUFFIX = ".tmp"


class FileSystemTierManager:
    """Blocks as files under ``file_mapper``'s folder; reads and writes chunks of the CPU tier's host tensors."""

    medium = Medium.STORAGE

    def __init__(self, file_mapper: FileMapper, enable_kv_events: bool = False) -> None:
        self.file_mapper = file_mapper
        self.enable_kv_events = enable_kv_events  # the tier's config asks for events; emitted while someone listens
        self.events: list[OffloadingEvent] | None = None
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        config_path = file_mapper.get_config_file_path()
        os.makedirs(os.path.dirname(config_path), exist_ok=True)
        if not os.path.exists(config_path):
            with open(config_path, "w") as f:
                json.dump(file_mapper.get_run_config(), f, indent=2, sort_keys=True)

    def register_host_caches(self, host_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The CPU tier's host tensors (per layer, K and V, one row per chunk): what the files hold."""
        self.host_caches = host_caches

    def chunk_nbytes(self) -> int:
        return sum(k[0].nbytes + v[0].nbytes for k, v in self.host_caches)

    def _chunk_views(self, chunk_id: int) -> list[torch.Tensor]:
        """A chunk's tensors, in the order its file holds them: layer 0's K, layer 0's V, layer 1's K, ..."""
        return [tensor[chunk_id] for pair in self.host_caches for tensor in pair]

    # -- the tiering manager's calls ------------------------------------------------------------
    def lookup(self, key: OffloadKey) -> bool:
        return os.path.exists(self.file_mapper.get_file_name(key))

    def store(self, keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        """Write each key's chunk to its file (unless the file exists), through a temporary file."""
        for key, chunk_id in zip(keys, chunk_ids):
            path = self.file_mapper.get_file_name(key)
            if os.path.exists(path):
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp_path = path + TMP_SUFFIX
            with open(tmp_path, "wb") as f:
                for view in self._chunk_views(chunk_id):
                    f.write(view.contiguous().view(torch.uint8).numpy().tobytes())
            os.replace(tmp_path, path)
        if self.events is not None and keys:
            self.events.append(OffloadingEvent(keys=list(keys), medium=self.medium, removed=False))

    def load(self, key: OffloadKey, chunk_id: int) -> bool:
        """Read ``key``'s file into chunk ``chunk_id``; False (and the file deleted) when it is not a whole block."""
        path = self.file_mapper.get_file_name(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return False
        if len(data) != self.chunk_nbytes():
            os.remove(path)  # vLLM's _load_block: a short file is corruption, removed so no one reads it again
            return False
        offset = 0
        for view in self._chunk_views(chunk_id):
            flat = view.view(torch.uint8).reshape(-1)
            flat.copy_(torch.frombuffer(bytearray(data[offset : offset + flat.numel()]), dtype=torch.uint8))
            offset += flat.numel()
        return True

    # -- events ------------------------------------------------------------------------------
    def set_events_enabled(self, enabled: bool) -> None:
        if enabled and self.enable_kv_events:
            self.events = self.events if self.events is not None else []
        else:
            self.events = None

    def take_events(self) -> list[OffloadingEvent]:
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events
