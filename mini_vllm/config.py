"""Engine settings, validated in one place (chapter 08)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .hashing import HASH_FUNCTIONS


def _is_device_name(device: str) -> bool:
    return device in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", device) is not None


@dataclass
class EngineConfig:
    """Everything ``LLM(...)`` accepts besides the model path; ValueError names a bad field.

    Attributes:
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:1", ...
        dtype: "auto" (the checkpoint's dtype on a GPU, float32 on a CPU),
            "float32", "float16" or "bfloat16".
        block_size: tokens per KV-cache block (vLLM's default is 16 too).
        num_blocks: KV-cache blocks; None sizes the pool from a memory budget.
        kv_cache_memory_gb: that budget when num_blocks is None (None: 90% of
            free GPU memory on CUDA, 0.25 GB on a CPU).
        enable_prefix_caching: reuse the K/V of equal prefixes across requests.
        max_num_seqs: at most this many requests run in one step.
        max_num_batched_tokens: at most this many tokens are computed per step
            (longer prompts are prefilled in chunks).
        max_model_len: longest sequence (prompt + output); None: the model's limit.
        attention_backend: "auto", "torch" or "triton".
        hash_algo: "sha256" (default) or "xxhash" (fast, not collision-resistant).
        seed: seeds sampling for requests without their own seed.
    """

    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    attention_backend: str = "auto"
    hash_algo: str = "sha256"
    seed: int = 0

    def __post_init__(self) -> None:
        # bool is an int subclass in Python: True is refused where a number is meant.
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is None and name in ("num_blocks", "max_model_len"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be a positive integer, got {type(value).__name__} {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        gb = self.kv_cache_memory_gb
        if gb is not None:
            if isinstance(gb, bool) or not isinstance(gb, (int, float)):
                raise TypeError(f"kv_cache_memory_gb must be a number or None, got {type(gb).__name__} {gb!r}")
            if not 0 < gb < math.inf:
                raise ValueError(f"kv_cache_memory_gb must be positive and finite, got {gb!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an integer, got {type(self.seed).__name__} {self.seed!r}")
        if not abs(self.seed) < 2**32:
            raise ValueError(f"seed must be an integer with abs(seed) < 2**32, got {self.seed!r}")
        if self.hash_algo not in HASH_FUNCTIONS:
            raise ValueError(f"hash_algo must be one of {sorted(HASH_FUNCTIONS)}, got {self.hash_algo!r}")
        if not isinstance(self.device, str) or not _is_device_name(self.device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
