"""Engine settings, validated in one place (chapter 08).

``EngineConfig`` is the one source of the settings' names, defaults and
checks: ``LLM(...)``, ``LLMEngine`` and the command line (``cli.py``) all take
them from here.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any

from .attention import attention_backend_names
from .hashing import HASH_FUNCTIONS
from .kv_offload.spec import eviction_policy
from .validation import check_block_size, check_positive_int, one_of

DEFAULT_BLOCK_SIZE = 16  # tokens per KV-cache block; vLLM's default on GPUs too


def check_device_name(device: Any) -> None:
    """ValueError unless ``device`` is "auto" or a string ``torch.device()`` accepts ("cpu:0", "cuda:1", "meta", ...).

    Only the name is checked here; whether the engine can run there (CUDA
    present, a device type it supports) is ``resolve_device``'s question
    (``llm_engine.py``). torch is imported only for a name other than "auto",
    so importing this module stays light.
    """
    if not isinstance(device, str):
        raise TypeError(
            f"device must be a str such as 'auto', 'cpu' or 'cuda:0', got {type(device).__name__} {device!r}"
        )
    if device == "auto":
        return
    import torch  # here, not at the top: this module does not need torch otherwise

    try:
        torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise ValueError(
            f"device must be 'auto' or a torch device such as 'cpu', 'cpu:0', 'cuda' or 'cuda:1', "
            f"got {device!r} (torch: {error})"
        ) from None


@dataclass
class EngineConfig:
    """Everything ``LLM(...)`` accepts besides the model path; ValueError (TypeError for a wrong type) names a bad field.

    ``LLM(model, **settings)`` passes its keywords here, so the names and
    defaults below are the only ones: ``LLM(num_blocks=64)`` is
    ``LLM(config=EngineConfig(num_blocks=64))``.

    Attributes:
        device: "auto" (CUDA when available, else CPU) or any name ``torch.device``
            accepts ("cpu", "cpu:0", "cuda", "cuda:1", ...); the engine runs on a
            CPU or a CUDA GPU (``resolve_device`` refuses other types).
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
        attention_backend: "auto", "torch", "triton" or "cpu" (or another registered with
            ``register_attention_backend``, ``mini_vllm/attention/__init__.py``).
        hash_algo: "sha256" (default) or "xxhash" (fast, not collision-resistant).
        seed: seeds sampling for requests without their own seed.
        kv_offloading_size: GiB of host memory for a second KV-cache tier below the
            pool (KV-cache offloading, ``mini_vllm/kv_offload/``): full prompt blocks
            are copied there and loaded back on a later hit. None: no tier. Not
            ``--cpu-offload-gb``, which moves model weights.
        kv_offloading_backend: "native", the CPU tier (vLLM's default; its "lmcache"
            is not built here).
        kv_transfer_config: vLLM's ``KVTransferConfig`` as a dict, for the tier's
            eviction policy: ``{"kv_connector_extra_config": {"eviction_policy":
            "arc"}}`` ("lru" when left out); only with ``kv_offloading_size``
            (``mini_vllm/kv_offload/spec.py`` says what else is refused).
        prefix_cache_retention_interval: which full blocks a sliding-window group
            caches (vLLM's setting, chapter 08b): 0 (vLLM's default) only those
            under the window at a boundary a later request resumes from (the
            prompt's end, a shared-prefix junction); None every block; a positive
            multiple of block_size N also those before every N-th token.
        disable_hybrid_kv_cache_manager: cache a hybrid model's every layer as full
            attention, in one KV-cache group (vLLM's setting): no block leaves a
            table early, no memory saved, every full block cached.
    """

    device: str = "auto"
    dtype: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    attention_backend: str = "auto"
    hash_algo: str = "sha256"
    seed: int = 0
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    kv_transfer_config: dict[str, Any] | None = None
    prefix_cache_retention_interval: int | None = 0
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None or name not in ("num_blocks", "max_model_len"):  # those two may be None
                check_positive_int(name, value)
        for name in ("kv_cache_memory_gb", "kv_offloading_size"):
            gb = getattr(self, name)
            if gb is not None:
                if isinstance(gb, bool) or not isinstance(gb, (int, float)):
                    raise TypeError(f"{name} must be a number or None, got {type(gb).__name__} {gb!r}")
                if not 0 < gb < math.inf:
                    raise ValueError(f"{name} must be positive and finite, got {gb!r}")
        if self.kv_offloading_backend != "native":
            raise ValueError(
                f"kv_offloading_backend must be 'native' (the CPU tier), got {self.kv_offloading_backend!r}"
            )
        eviction_policy(self.kv_transfer_config)  # a TypeError / ValueError naming what the tier does not have
        if self.kv_transfer_config is not None and self.kv_offloading_size is None:
            raise ValueError(
                "kv_transfer_config configures the KV-cache offloading tier here: give kv_offloading_size too"
            )
        for name in ("enable_prefix_caching", "disable_hybrid_kv_cache_manager"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        retention = self.prefix_cache_retention_interval
        if retention is not None and (isinstance(retention, bool) or not isinstance(retention, int)):
            raise TypeError(f"prefix_cache_retention_interval must be None or an integer, got {retention!r}")
        if retention is not None and retention < 0:
            raise ValueError(f"prefix_cache_retention_interval must be >= 0 or None, got {retention}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an integer, got {type(self.seed).__name__} {self.seed!r}")
        if not abs(self.seed) < 2**32:
            raise ValueError(f"seed must be an integer with abs(seed) < 2**32, got {self.seed!r}")
        if self.hash_algo not in HASH_FUNCTIONS:
            raise ValueError(f"hash_algo must be one of {sorted(HASH_FUNCTIONS)}, got {self.hash_algo!r}")
        if type(self.device).__module__ == "torch" and type(self.device).__name__ == "device":
            self.device = str(self.device)  # a torch.device is taken by its name
        check_device_name(self.device)
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {self.dtype!r}")
        backends = attention_backend_names()  # "auto" and every registered backend
        if self.attention_backend not in backends:
            raise ValueError(f"attention_backend must be {one_of(backends)}, got {self.attention_backend!r}")


def make_engine_config(config: EngineConfig | None, settings: dict[str, Any]) -> EngineConfig:
    """``config`` as given, or an ``EngineConfig`` of the keyword ``settings`` (``LLM(num_blocks=64)``).

    A keyword that is not a field is a TypeError naming it and listing the
    valid ones (as Python's own error for an unknown keyword would name it);
    so is a call that gives both keywords and ``config``.
    """
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    unknown = [name for name in settings if name not in names]
    if unknown:
        raise TypeError(
            f"LLM() got an unexpected keyword argument {unknown[0]!r}; the settings are EngineConfig's: {', '.join(names)}"
        )
    if config is None:
        return EngineConfig(**settings)
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    if settings:
        raise TypeError(
            f"LLM() takes the settings as keywords or as config=EngineConfig(...), not both: got {sorted(settings)}"
        )
    return config


def signature_with_settings(function) -> inspect.Signature:
    """``function``'s signature with its ``**settings`` spelled out as EngineConfig's fields and defaults.

    ``LLM.__init__`` takes the settings as ``**settings``; giving it this
    signature lets ``help(LLM)``, ``inspect.signature`` and Jupyter's
    Shift-Tab list every setting with its default, read from the one place
    they are defined.
    """
    parameters = [p for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
    parameters += [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(EngineConfig)
    ]
    return inspect.Signature(parameters, return_annotation=inspect.signature(function).return_annotation)
