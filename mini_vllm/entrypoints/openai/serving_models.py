"""What the server serves, and how: the model's names and folder, the context it serves, the sampling
defaults, the operator's choices (``ServerSettings``), and ``GET /v1/models``.

``ServerSettings.for_engine`` reads what the engine decides (its model, the longest sequence its
KV-cache pool holds, the model's ``generation_config.json``); the rest comes from the flags
(``cli_args.py``) or ``BackgroundServer``'s arguments.

vLLM equivalent: ``vllm/entrypoints/openai/serving_models.py`` (``OpenAIServingModels``: the
served names, ``show_available_models``) and ``--generation-config auto``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .protocol import APIError, now

logger = logging.getLogger("mini_vllm")

# Sampling settings a model's generation_config.json may set as defaults (vLLM: --generation-config auto).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k")


@dataclass
class ServerSettings:
    # The names clients may send as "model" (vLLM's --served-model-name takes several); responses,
    # /metrics and the start-up line report the first, as vLLM's do.
    served_model_names: list[str]
    model_path: str
    max_model_len: int
    enable_prompt_tokens_details: bool = False
    default_sampling: dict[str, Any] | None = None
    # A Jinja template sent with a request runs on the renderer thread (a slow one holds up every prompt):
    # refused unless the operator trusts its clients, as vLLM's --trust-request-chat-template.
    trust_request_chat_template: bool = False
    # vllm serve --enable-scale-out: the render endpoints a router tokenizes requests with (serving_render.py).
    enable_scale_out: bool = False

    @classmethod
    def for_engine(cls, engine, served_model_names: list[str], **options: bool) -> ServerSettings:
        """The settings for serving ``engine`` (an ``LLMEngine``): its model, the longest sequence its
        pool holds, the model's sampling defaults, and the operator's ``options``."""
        return cls(
            served_model_names=served_model_names,
            model_path=engine.model_path,
            max_model_len=servable_model_len(engine),
            default_sampling=default_sampling_from(engine.model_path),
            **options,
        )

    @property
    def served_model_name(self) -> str:
        """The name responses report: the first of ``served_model_names``."""
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """A 404 for a ``model`` the server does not serve (none given: the served one)."""
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")


def servable_model_len(engine) -> int:
    """The server's ``max_model_len``: the engine's, lowered to what its KV-cache pool can hold.

    A request without ``max_tokens`` gets the rest of the context (vLLM's default); with a pool
    smaller than ``max_model_len`` (``--num-gpu-blocks-override``) every such request would be
    refused. vLLM refuses to start then; the server serves the longest sequence the pool holds
    and says so (``/v1/models`` reports it).
    """
    servable = engine.input_processor.longest_sequence_the_pool_holds()
    if servable < engine.max_model_len:
        logger.warning(
            "the KV-cache pool holds at most %d tokens of one request: serving max_model_len=%d (not %d)",
            servable,
            servable,
            engine.max_model_len,
        )
    return servable


def default_sampling_from(model_path: str) -> dict[str, Any]:
    """The sampling defaults a model's ``generation_config.json`` sets (as vLLM's ``--generation-config auto``)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {key: config[key] for key in GENERATION_CONFIG_KEYS if key in config}


def show_available_models(settings: ServerSettings) -> dict[str, Any]:
    """``/v1/models``: every served name, with the model's folder and the ``max_model_len`` served."""
    return {
        "object": "list",
        "data": [
            {
                "id": served_name,
                "object": "model",
                "created": now(),
                "owned_by": "mini-vllm",
                "root": settings.model_path,
                "max_model_len": settings.max_model_len,
            }
            for served_name in settings.served_model_names
        ],
    }
