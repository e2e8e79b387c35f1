"""Engine settings, validated in one place (chapter 08)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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
    num_blocks: Optional[int] = None
    kv_cache_memory_gb: Optional[float] = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None
    attention_backend: str = "auto"
    hash_algo: str = "sha256"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks <= 0):
            raise ValueError(f"num_blocks must be a positive integer or None, got {self.num_blocks!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            raise ValueError(f"max_model_len must be a positive integer or None, got {self.max_model_len!r}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
