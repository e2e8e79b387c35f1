"""``/v1/chat/completions/render`` and ``/v1/completions/render``: what a router asks of a replica before it routes.

A KV-aware router (``vllm-router --policy kv_aware``) hashes a request's prompt
into block hashes and looks them up in what each replica's KV events said it
cached (``mini_vllm/distributed/kv_events.py``). To hash the prompt exactly as
the replica will, it has a replica render it: the request checked and turned
into token ids and sampling parameters, nothing run. The answer is vLLM's
``GenerateRequest`` (``token_ids``, ``sampling_params``, ``cache_salt``, ...).
The token ids are the ones the same request to ``/v1/chat/completions`` or
``/v1/completions`` would run with: both go through the endpoint's own
``OpenAIServing.prepare``.

vLLM serves them with ``vllm serve --enable-scale-out``
(``vllm/entrypoints/scale_out/render/serving.py``, ``ServingRender``); without
the flag each answers 403, as here.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .serving_engine import OpenAIServing

# vLLM's words when the endpoints are off.
DISABLED_MESSAGE = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."


def generate_request(request_id: str, token_ids: list[int], params: Any, body: Any) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` as its render endpoints return it (the fields mini-vLLM has; the rest None)."""
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init},
        "model": body.model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": bool(body.stream),
        "stream_options": body.stream_options.model_dump() if body.stream and body.stream_options else None,
        "cache_salt": body.cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


class OpenAIServingRender:
    """Renders chat and completion requests with the endpoints' own serving objects (``enabled``: the flag)."""

    def __init__(self, chat: OpenAIServing, completion: OpenAIServing, enabled: bool) -> None:
        self.chat = chat
        self.completion = completion
        self.enabled = enabled

    def check_enabled(self) -> None:
        if not self.enabled:
            raise APIError(403, DISABLED_MESSAGE, error_type="PermissionDeniedError")

    async def render_chat(self, body: ChatCompletionRequest) -> dict[str, Any]:
        self.check_enabled()
        [token_ids], [params] = await self.chat.prepare(body)
        return generate_request(f"chatcmpl-{uuid.uuid4().hex}", token_ids, params, body)

    async def render_completion(self, body: CompletionRequest) -> list[dict[str, Any]]:
        self.check_enabled()
        prompts, params = await self.completion.prepare(body)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        return [
            generate_request(base_id if len(prompts) == 1 else f"{base_id}-{index}", token_ids, p, body)
            for index, (token_ids, p) in enumerate(zip(prompts, params))
        ]
