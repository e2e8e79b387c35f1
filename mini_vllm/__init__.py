"""mini-vLLM: a compact vLLM-style engine with prefix caching, built to be read.

Start with ``LLM`` (the offline API) or read the modules in the order the
course does: ``hashing`` -> ``block_pool`` -> ``request`` ->
``kv_cache_manager`` -> ``scheduler`` -> ``model_runner`` -> ``llm_engine``.

The names below are imported when first used (PEP 562), so that
``import mini_vllm.hashing`` loads neither torch nor transformers and
importing the package changes nothing in the process (no environment
variable is set): ``from mini_vllm import LLM`` imports ``mini_vllm.llm`` then.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each public name -> the module that defines it.
_LAZY_NAMES = {
    "LLM": ".llm",
    "LLMEngine": ".llm_engine",
    "EngineConfig": ".config",
    "SamplingParams": ".sampling_params",
    "RequestOutput": ".outputs",
    "CompletionOutput": ".outputs",
    "RequestMetrics": ".outputs",
    "default_model_path": ".model",
}

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "default_model_path",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY_NAMES:
        # AttributeError lets ``from mini_vllm import hashing`` go on to import the submodule.
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_NAMES[name], __name__), name)
    globals()[name] = value  # the next lookup finds it without calling __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
