"""mini-vLLM: a compact vLLM-style engine with prefix caching, built to be read.

Start with ``LLM`` (the offline API) or read the modules in the order the
course does: ``hashing`` -> ``block_pool`` -> ``request`` ->
``kv_cache_manager`` -> ``scheduler`` -> ``model_runner`` -> ``llm_engine``.
"""

from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .model import default_model_path
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

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
