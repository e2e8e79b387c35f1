"""What a router asks of a replica before it routes: the prompt's token ids (vLLM's scale-out render endpoints).

A KV-aware router (``vllm-router --policy kv_aware``) hashes a request's
prompt into block hashes and looks them up in what each replica's KV events
said it cached. To hash the prompt exactly as the replica will, it asks a
replica to render it: ``POST /v1/chat/completions/render`` (the chat template
applied, then tokenized) or ``POST /v1/completions/render``, which answer
vLLM's ``GenerateRequest`` (``token_ids``, the ``sampling_params`` the request
would run with, ``cache_salt``, ...) without running anything. The token ids are
the ones the replica's own ``/v1/chat/completions`` would compute: both go
through ``OpenAIServing.chat_prompt`` / ``completion_prompts``.

vLLM serves them with ``vllm serve --enable-scale-out``
(``vllm/entrypoints/scale_out/render/``); without the flag they answer 403,
as here.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from .protocol import ChatCompletionRequest, CompletionRequest, error_body

# vLLM's words when the endpoints are off.
DISABLED_MESSAGE = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
RENDER_PATHS = ("/v1/chat/completions/render", "/v1/completions/render")


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


def register_scale_out_routes(app: FastAPI, serving: Any, enabled: bool, json_only: Any) -> None:
    """The render endpoints on ``app`` (``serving``: the server's ``OpenAIServing``); a 403 each unless ``enabled``."""
    if not enabled:

        async def disabled() -> JSONResponse:
            return JSONResponse(error_body(DISABLED_MESSAGE, "PermissionDeniedError", 403), status_code=403)

        for path in RENDER_PATHS:
            app.add_api_route(path, disabled, methods=["POST"], include_in_schema=False)
        return

    @app.post("/v1/chat/completions/render", dependencies=[Depends(json_only)])
    async def render_chat_completion(body: ChatCompletionRequest) -> dict:
        serving.check_model(body.model)
        serving.check_cache_salt(body.cache_salt)
        serving.check_implemented(body)
        token_ids = await serving.chat_prompt(body)
        params = serving.sampling_params(body, len(token_ids))
        return generate_request(f"chatcmpl-{uuid.uuid4().hex}", token_ids, params, body)

    @app.post("/v1/completions/render", dependencies=[Depends(json_only)])
    async def render_completion(body: CompletionRequest) -> list[dict]:
        serving.check_model(body.model)
        serving.check_cache_salt(body.cache_salt)
        serving.check_implemented(body)
        prompts = await serving.completion_prompts(body)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        return [
            generate_request(
                base_id if len(prompts) == 1 else f"{base_id}-{index}",
                token_ids,
                serving.sampling_params(body, len(token_ids)),
                body,
            )
            for index, token_ids in enumerate(prompts)
        ]
