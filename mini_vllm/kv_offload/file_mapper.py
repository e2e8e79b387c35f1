"""Which file holds a block in a file-system tier: vLLM's ``FileMapper``, the same names byte for byte.

A file-system tier keeps one file per block, named after the block's hash,
in a folder named after everything that makes its bytes what they are (the
model, the block size, the dtype, the layers, the engine): two engines whose
settings differ in any of these never read each other's files::

    <root_dir>/<model>_<sha256 of those settings, 12 hex>/config.json
    <root_dir>/<model>_<sha256 of those settings, 12 hex>_r<rank>/<hhh>/<hh>_g<group>/<block hash hex>.bin

``<model>`` is the model's name with ``/`` replaced by ``_``; ``<hhh>`` and
``<hh>`` are the hash's first three and next two hex digits (so no folder
gets too many entries); ``config.json`` writes the settings out, for a person
to read. Since the hash chain starts from ``NONE_HASH``, which
``PYTHONHASHSEED`` seeds, engines started with the same seed and the same
settings find each other's blocks.

vLLM equivalent: ``vllm/v1/kv_offload/file_mapper.py`` (``FileMapper``, built
with ``parallel_agnostic=True`` by the fs tier: one process here, so the
parallel sizes are 1 and the rank 0). mini-vLLM names itself in
``inference_engine`` ("mini-vllm"): its files hold the pool's bytes in its own
layout, so a vLLM engine on the same ``root_dir`` never reads them.
"""

from __future__ import annotations

import hashlib
import json

from .base import OffloadKey, get_offload_block_hash, get_offload_group_idx

BASE_PATH_HASH_LEN = 12  # hex digits of the settings' sha256 in the folder's name
CONFIG_FILENAME = "config.json"
INFERENCE_ENGINE = "mini-vllm"


class FileMapper:
    """Maps a tier's keys to file names under ``root_dir``, in a folder of its own for these settings."""

    def __init__(
        self,
        root_dir: str,
        model_name: str,
        tokens_per_hash: int,
        dtype: str,
        kv_cache_groups: list[dict],
        blocks_per_file: int = 1,
        inference_engine: str = INFERENCE_ENGINE,
    ) -> None:
        self.rank = 0
        # Keys in vLLM's order and spelling: their JSON is hashed into the folder's name.
        self.fields: dict = {
            "model_name": model_name,
            "tokens_per_hash": tokens_per_hash,
            "blocks_per_file": blocks_per_file,
            "tp_size": 1,
            "pp_size": 1,
            "pcp_size": 1,
            "dcp_size": 1,
            "dtype": str(dtype),
            "kv_cache_groups": kv_cache_groups,
            "inference_engine": inference_engine,
        }
        canonical = json.dumps(self.fields, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:BASE_PATH_HASH_LEN]
        self.base_path = f"{root_dir}/{model_name.replace('/', '_')}_{digest}"

    def get_file_name(self, key: OffloadKey) -> str:
        """``<base>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin``: the file that holds block ``key``."""
        hash_hex = get_offload_block_hash(key).hex()
        return (
            f"{self.base_path}_r{self.rank}/{hash_hex[:3]}/{hash_hex[3:5]}_g{get_offload_group_idx(key)}/{hash_hex}.bin"
        )

    def get_run_config(self) -> dict:
        return dict(self.fields)

    def get_config_file_path(self) -> str:
        return f"{self.base_path}/{CONFIG_FILENAME}"
