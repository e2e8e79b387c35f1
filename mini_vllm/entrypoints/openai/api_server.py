"""An OpenAI-compatible HTTP server over the engine: ``python -m mini_vllm serve`` (``make serve``).

    python -m mini_vllm serve --port 8000 --enable-prompt-tokens-details
    # then, from any OpenAI client:
    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    reply = client.chat.completions.create(model="mini-vllm", messages=[...])
    reply.usage.prompt_tokens_details.cached_tokens     # the prefix cache, as users see it

Endpoints, as vLLM's server has them: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both with SSE streaming and
``stream_options.include_usage``), ``POST /tokenize`` and ``POST /detokenize``,
``GET /health`` (and ``/ping``), ``GET /version``, ``GET /metrics``
(Prometheus text with vLLM's metric names) and ``POST /reset_prefix_cache``.

The HTTP layer is FastAPI + uvicorn, as in vLLM. Every request goes to one
``AsyncLLM`` (``mini_vllm/entrypoints/async_llm.py``), whose single engine
loop batches the requests of all clients together. A bad request gets a 4xx
with ``{"error": {"message", "type", "param", "code"}}`` naming the field, and
nothing is queued; a request the engine fails on gets a 500, alone; a client
that disconnects has its request aborted and its blocks freed.

vLLM equivalent: ``vllm/entrypoints/openai/api_server.py`` and its
``serving_chat.py`` / ``serving_completion.py``; flags keep ``vllm serve``'s
names where they exist.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib.metadata
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ...llm import LLM, check_conversation
from ...sampling_params import MAX_LOGPROBS, SamplingParams
from ...validation import check_text
from ..async_llm import SHUTDOWN, AsyncLLM, EngineShutDown, RequestStream, StreamDelta
from .scale_out import register_scale_out_routes
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_logprobs,
    completion_logprobs,
    error_body,
    now,
    random_id,
    usage,
)

logger = logging.getLogger("mini_vllm")

# vLLM 0.33 refuses salts longer than this or containing these characters.
MAX_CACHE_SALT_LENGTH = 128
FORBIDDEN_SALT_CHARACTERS = ("@", "/", "\\", "\0")
# Sampling settings a model's generation_config.json may set as defaults (vLLM: --generation-config auto).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k")
UNION_TAGS = {"str", "int", "float", "bool", "list", "dict"}
# Seconds a shutdown (Ctrl-C, SIGTERM) waits for running requests before aborting them.
GRACEFUL_SHUTDOWN_S = 5
# /v1/completions without max_tokens: 16 tokens (vLLM's CompletionRequest default, as OpenAI's);
# chat without it gets the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# vLLM's FinishReason names: /metrics has vllm:request_success for each from the start (0 until one finishes so).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# Completions that ended without an answer, as the client is told: finish_reason -> (status, error type, message).
FAILED_ENDINGS = {
    "error": (500, "InternalServerError", "the engine failed while computing this request (see the server's log)"),
    SHUTDOWN: (
        503,
        "ServiceUnavailableError",
        "the server is shutting down: this request was stopped before it finished",
    ),
}


class APIError(Exception):
    """An error answered to the client alone: status code, OpenAI error type, message, offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or {400: "BadRequestError", 404: "NotFoundError"}.get(
            status, "BadRequestError" if status < 500 else "InternalServerError"
        )

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.error_type, self.status, self.param), status_code=self.status)


def bad_request(error: Exception) -> APIError:
    """A ValueError/TypeError from the engine's validation as a 400; ``param`` is the field it names first."""
    message = str(error)
    first_word = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":")
    known = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    return APIError(400, message, param=first_word if first_word in known else None)


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


def mini_vllm_version() -> str:
    """The installed package's version (``pyproject.toml``), which ``/version`` reports as vLLM's reports its own."""
    try:
        return importlib.metadata.version("mini-vllm-course")
    except importlib.metadata.PackageNotFoundError:  # a checkout run without pip install
        return "unknown"


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
    # vllm serve --enable-scale-out: the render endpoints a router tokenizes requests with (scale_out.py).
    enable_scale_out: bool = False

    @property
    def served_model_name(self) -> str:
        """The name responses report: the first of ``served_model_names``."""
        return self.served_model_names[0]


def default_sampling_from(model_path: str) -> dict[str, Any]:
    """The sampling defaults a model's ``generation_config.json`` sets (as vLLM's ``--generation-config auto``)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {key: config[key] for key in GENERATION_CONFIG_KEYS if key in config}


class OpenAIServing:
    """Turns OpenAI requests into engine prompts and ``SamplingParams``, and deltas back into responses."""

    def __init__(self, engine: AsyncLLM, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        # Rendering and tokenizing run here, off the engine thread, so that a long prompt never delays
        # the other clients' steps (vLLM's renderer executor: one worker, as its renderer_num_workers).
        self.renderer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mini-vllm-renderer")
        # The most characters a prompt of max_model_len tokens can have: a longer text is refused before it
        # is tokenized (vLLM's _text_len_check), so a huge prompt costs nobody a tokenization.
        vocab = engine.tokenizer.get_vocab()
        self.max_input_chars = settings.max_model_len * max(len(token) for token in vocab)

    async def render(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` (a template rendering, a tokenization) on the renderer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.renderer, fn)

    def check_text_length(self, text: str, param: str) -> None:
        """A 400 for a prompt text longer than any prompt of max_model_len tokens, in vLLM's words."""
        if len(text) > self.max_input_chars:
            limit = self.settings.max_model_len
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{len(text)} characters (more than {self.max_input_chars} characters, which is the upper "
                f"bound for {limit} input tokens). Please reduce the length of the input prompt.",
                param=param,
            )

    # -- requests -> engine -------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.settings.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    @staticmethod
    def check_cache_salt(salt: str | None) -> None:
        if salt is None:
            return
        if not salt:
            raise APIError(400, "cache_salt must be a non-empty string (omit it for no salt)", param="cache_salt")
        if len(salt) > MAX_CACHE_SALT_LENGTH:
            raise APIError(
                400, f"cache_salt is {len(salt)} characters, longer than {MAX_CACHE_SALT_LENGTH}", param="cache_salt"
            )
        if any(character in salt for character in FORBIDDEN_SALT_CHARACTERS):
            raise APIError(400, "cache_salt must not contain '@', '/', '\\' or NUL", param="cache_salt")

    def check_implemented(self, body: Any) -> None:
        """A 400 naming the first field that asks for what this server does not implement (vLLM would honour it)."""
        field = body.not_implemented_field()
        if field is not None:
            raise APIError(400, f"{field} is not supported by mini-vLLM's server", param=field)

    @staticmethod
    def requested_max_tokens(body: Any) -> tuple[str, int | None]:
        """The field that sets the output length and its value: chat's ``max_completion_tokens`` wins over ``max_tokens``."""
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            return "max_completion_tokens", body.max_completion_tokens
        return "max_tokens", body.max_tokens

    def sampling_params(self, body: Any, num_prompt_tokens: int) -> SamplingParams:
        """``SamplingParams`` from the request, the model's defaults filling what it leaves out."""
        limit = self.settings.max_model_len
        max_tokens_name, max_tokens = self.requested_max_tokens(body)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{max_tokens_name} must be an integer >= 1, got {max_tokens}", param=max_tokens_name)
        if max_tokens is not None and max_tokens > limit:
            raise APIError(  # vLLM's TokenizeParams check, in its words
                400,
                f"{max_tokens_name}={max_tokens} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens.",
                param=max_tokens_name,
            )
        if max_tokens is None and isinstance(body, CompletionRequest):
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        if num_prompt_tokens >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{num_prompt_tokens} input tokens, which leaves no room for an output token. "
                "Please reduce the length of the input prompt.",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        # As vLLM's get_max_tokens: what was asked for (or the default), capped at the rest of the context
        # (a prompt of 1000 tokens with max_tokens=100 and max_model_len=1024 gets 24).
        room = limit - num_prompt_tokens
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options can only be given when stream is true", param="stream_options")
        settings = dict(self.settings.default_sampling or {})
        for key in ("temperature", "top_p", "top_k", "seed"):
            if getattr(body, key) is not None:
                settings[key] = getattr(body, key)
        settings["logprobs"] = self.num_logprobs(body)
        settings["stop_token_ids"] = body.stop_token_ids
        try:
            return SamplingParams(
                n=body.n, max_tokens=max_tokens, stop=body.stop, ignore_eos=body.ignore_eos, **settings
            )
        except (ValueError, TypeError) as error:
            raise bad_request(error) from None

    @staticmethod
    def num_logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
        """How many top candidates per token the request asks for (chat: ``top_logprobs`` with
        ``logprobs: true``; completions: ``logprobs``), None for none; a 400 outside 0..MAX_LOGPROBS."""
        name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        try:
            num = body.num_logprobs()
        except ValueError as error:
            raise APIError(400, str(error).removeprefix(f"{name}: "), param=name) from None
        if num is not None and num < 0:
            raise APIError(400, f"`{name}` must be a non-negative integer, got {num}", param=name)
        if num is not None and num > MAX_LOGPROBS:  # vLLM's words
            raise APIError(
                400,
                f"Requested sample logprobs of {num}, which is greater than max allowed: {MAX_LOGPROBS}",
                param=name,
            )
        return num

    async def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        text = await self.conversation_text(body)
        self.check_text_length(text, "messages")
        tokenizer = self.engine.tokenizer
        return await self.render(lambda: tokenizer.encode(text, add_special_tokens=False))

    async def conversation_text(
        self,
        body: ChatCompletionRequest | TokenizeRequest,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """A request's ``messages`` rendered by the chat template, on the renderer thread (chat, and
        ``/tokenize`` of messages: the same text, so the same tokens, for the same conversation)."""
        conversation = [{"role": message.role, "content": message.text()} for message in body.messages]
        llm = self.engine.llm
        template_kwargs = dict(body.chat_template_kwargs or {})
        if body.request_chat_template() is not None:
            if not self.settings.trust_request_chat_template:
                raise APIError(  # vLLM's words
                    400,
                    "Chat template is passed with request, but --trust-request-chat-template is not set. "
                    "Refused request with untrusted chat template.",
                    param="chat_template",
                )
            if body.chat_template is not None:
                template_kwargs["chat_template"] = body.chat_template

        def render() -> str:
            check_conversation(conversation)
            try:
                return llm.render_chat_template(
                    conversation,
                    template_kwargs,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                )
            except Exception as error:  # jinja's TemplateError, a template raising on a role it does not know
                raise ValueError(f"the chat template rejected the conversation: {error}") from error

        try:
            return await self.render(render)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param="messages") from None

    async def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            texts: list[str] | None = [prompt]
        elif prompt and isinstance(prompt[0], str):
            texts = list(prompt)
        else:
            texts = None
        if texts is None:  # token ids: one list, or a list of lists
            prompts = [list(prompt)] if not prompt or isinstance(prompt[0], int) else [list(p) for p in prompt]
        else:
            for index, text in enumerate(texts):
                self.check_text_length(text, "prompt")
                try:
                    check_text(text, f"prompt {index}" if len(texts) > 1 else "prompt")
                except ValueError as error:
                    raise APIError(400, str(error), param="prompt") from None
            tokenizer = self.engine.tokenizer
            prompts = await self.render(lambda: [tokenizer.encode(text, add_special_tokens=True) for text in texts])
        for index, token_ids in enumerate(prompts):
            if not token_ids:
                where = f"prompt {index}" if len(prompts) > 1 else "prompt"
                raise APIError(400, f"{where} is empty: give at least one token", param="prompt")
        return prompts

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """``/tokenize``: the token ids a completion (``prompt``) or a chat (``messages``) request would
        queue, as vLLM's: no length limit (counting a long text is what it is for), ``count``,
        ``max_model_len``, and ``token_strs`` when ``return_token_strs`` asks for them."""
        if body.messages is not None:
            text = await self.conversation_text(body, body.add_generation_prompt, body.continue_final_message)
            add_special_tokens = bool(body.add_special_tokens)  # default False: the template writes them
        else:
            text = body.prompt
            try:
                check_text(text, "prompt")
            except ValueError as error:
                raise APIError(400, str(error), param="prompt") from None
            add_special_tokens = body.add_special_tokens is not False  # default True, as /v1/completions
        tokenizer = self.engine.tokenizer
        token_ids = await self.render(lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return {
            "count": len(token_ids),
            "max_model_len": self.settings.max_model_len,
            "tokens": token_ids,
            "token_strs": tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        """``/detokenize``: the text of token ids, special tokens included, as vLLM's; an id outside the
        vocabulary is a 400 naming it."""
        try:
            self.engine.llm.llm_engine.input_processor.check_token_ids(body.tokens, "tokens")
        except ValueError as error:
            raise APIError(400, str(error), param="tokens") from None
        tokenizer = self.engine.tokenizer
        return {"prompt": await self.render(lambda: tokenizer.decode(body.tokens))}

    async def start(
        self, prompts: list[list[int]], salt: str | None, params: list[SamplingParams], param: str
    ) -> list[RequestStream]:
        """Queue a request's prompts, all or none: the engine validates them all first (a 400 here,
        nothing queued, so no prompt of a refused batch runs or is counted in /metrics).

        The 400 names the request's field (``param``: ``prompt`` or ``messages``); in a batch
        the engine's message names the prompt (``prompt 1: ...``).
        """
        engine_prompts = []
        for token_ids in prompts:
            prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
            if salt is not None:
                prompt["cache_salt"] = salt
            engine_prompts.append(prompt)
        try:
            return await self.engine.add_requests(engine_prompts, params)
        except (ValueError, TypeError) as error:
            raise APIError(400, f"{param}: {error}" if len(prompts) == 1 else str(error), param=param) from None


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Deltas of several prompts' streams as they come, tagged with the prompt's index."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


async def _until_disconnected(request: Request, work: Any) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (its requests are aborted) and return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    logger.info("client disconnected: its request was aborted")
    return None


async def json_only(request: Request) -> None:
    """A body that is not sent as JSON is a 400 in vLLM's words (its ``validate_json_request``), checked
    before the body is read as a request."""
    media_type = request.headers.get("content-type", "").lower().split(";", maxsplit=1)[0].strip()
    if media_type != "application/json":
        raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The FastAPI application: routes, error handlers, and the engine's shutdown with the server's."""
    serving = OpenAIServing(engine, settings)
    name = settings.served_model_name

    def decode(token_id: int) -> str:
        return engine.tokenizer.decode([token_id])

    details = settings.enable_prompt_tokens_details

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # Its streams have ended already (begin_shutdown); a step longer than this is left running.
        engine.shutdown(timeout=GRACEFUL_SHUTDOWN_S)
        serving.renderer.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="mini-vLLM OpenAI-compatible server", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own 4xx (a body it cannot parse, an unknown route or method): the OpenAI error body too.
        message = str(error.detail)
        if message == "There was an error parsing the body":
            message = "the request body could not be parsed: send UTF-8 JSON (at most a few hundred levels deep)"
        return APIError(error.status_code, message).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        # The field's path, without pydantic's union-member tags ("str", "list[str]", "function-after[...]").
        location = [
            str(part)
            for part in first.get("loc", ())
            if part != "body" and not (isinstance(part, str) and (part in UNION_TAGS or "[" in part))
        ]
        param = ".".join(location) or None
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
            param = None
        elif param is None and first.get("type") == "value_error":  # a check of the whole body: its own words
            message = str(first.get("msg")).removeprefix("Value error, ")
        else:
            message = f"{param or 'body'}: {first.get('msg')}"
            if "input" in first and param:
                message += f" (got {json.dumps(first['input'], default=str)[:80]})"
        return APIError(400, message, param=param).response()

    @app.exception_handler(EngineShutDown)
    async def shutting_down(request: Request, error: EngineShutDown) -> JSONResponse:
        return APIError(503, str(error), error_type="ServiceUnavailableError").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("request failed")
        return APIError(500, f"the engine failed on this request: {type(error).__name__}: {error}").response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """SageMaker's health check, which vLLM's server also answers: the same as ``/health``."""
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": mini_vllm_version()}

    @app.post("/tokenize", dependencies=[Depends(json_only)])
    async def tokenize(body: TokenizeRequest) -> dict:
        serving.check_model(body.model)
        serving.check_implemented(body)
        return await serving.tokenize(body)

    @app.post("/detokenize", dependencies=[Depends(json_only)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving.check_model(body.model)
        return await serving.detokenize(body)

    @app.get("/v1/models")
    async def models() -> dict:
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

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False) -> dict:
        """Always a 200 saying whether the cache was reset, as vLLM's: ``{"success": false}`` while requests
        hold blocks, unless ``?reset_running_requests=true`` preempts them first (they are recomputed)."""
        return {"success": await engine.reset_prefix_cache(reset_running_requests)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions", dependencies=[Depends(json_only)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        serving.check_model(body.model)
        serving.check_cache_salt(body.cache_salt)
        serving.check_implemented(body)
        token_ids = await serving.chat_prompt(body)
        params = serving.sampling_params(body, len(token_ids))
        [stream] = await serving.start([token_ids], body.cache_salt, [params], "messages")
        response = _Response(
            "chatcmpl", "chat.completion", name, details, body.n, chat=True, logprobs=params.logprobs, decode=decode
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(response.stream([stream], include_usage), media_type="text/event-stream")
        result = await _until_disconnected(request, response.collect([stream]))
        return result if result is not None else Response(status_code=499)

    @app.post("/v1/completions", dependencies=[Depends(json_only)])
    async def completions(body: CompletionRequest, request: Request):
        serving.check_model(body.model)
        serving.check_cache_salt(body.cache_salt)
        serving.check_implemented(body)
        prompts = await serving.completion_prompts(body)
        params = [serving.sampling_params(body, len(token_ids)) for token_ids in prompts]
        streams = await serving.start(prompts, body.cache_salt, params, "prompt")
        response = _Response(
            "cmpl", "text_completion", name, details, body.n, chat=False, logprobs=params[0].logprobs, decode=decode
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(response.stream(streams, include_usage), media_type="text/event-stream")
        result = await _until_disconnected(request, response.collect(streams))
        return result if result is not None else Response(status_code=499)

    register_scale_out_routes(app, serving, settings.enable_scale_out, json_only)

    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine, name))
    app.state.engine = engine
    return app


class _Response:
    """Builds one chat or text completion response (whole, or as SSE chunks) from the engine's deltas."""

    def __init__(
        self,
        id_prefix: str,
        obj: str,
        model: str,
        details: bool,
        n: int,
        chat: bool,
        logprobs: int | None = None,
        decode: Callable[[int], str] = str,
    ) -> None:
        self.id = random_id(id_prefix)
        self.object = obj
        self.model = model
        self.details = details
        self.n = n
        self.chat = chat
        self.created = now()
        self.num_logprobs = logprobs  # top candidates per token (SamplingParams.logprobs); None: no logprobs
        self.decode = decode  # one token id's text (the routes give the tokenizer's)
        self.text_offsets: dict[int, int] = {}  # completions, streamed: each choice's text so far, in token texts

    def _logprobs(self, choice: int, token_ids: list[int], entries: list | None) -> dict | None:
        """The ``logprobs`` of ``token_ids`` (a whole choice, or one chunk's tokens), None when not asked for."""
        if self.num_logprobs is None or entries is None:
            return None
        if self.chat:
            return chat_logprobs(token_ids, entries, self.num_logprobs, self.decode)
        offset = self.text_offsets.get(choice, 0)
        result = completion_logprobs(token_ids, entries, self.num_logprobs, self.decode, offset)
        self.text_offsets[choice] = offset + sum(len(token) for token in result["tokens"])
        return result

    def _choice_index(self, prompt_index: int, delta: StreamDelta) -> int:
        return prompt_index * self.n + delta.index

    async def collect(self, streams: list[RequestStream]) -> JSONResponse:
        texts: dict[int, list[str]] = {}
        finals: dict[int, StreamDelta] = {}
        tokens: dict[int, list[int]] = {}
        entries: dict[int, list] = {}
        prompt_tokens = cached_tokens = completion_tokens = 0
        counted: set[int] = set()
        async for prompt_index, delta in _merged(streams):
            choice = self._choice_index(prompt_index, delta)
            texts.setdefault(choice, []).append(delta.text)
            tokens.setdefault(choice, []).extend(delta.token_ids)
            entries.setdefault(choice, []).extend(delta.logprobs or [])
            completion_tokens += len(delta.token_ids)
            if delta.finished:
                finals[choice] = delta
                if prompt_index not in counted:  # a prompt's tokens count once, whatever n is
                    counted.add(prompt_index)
                    prompt_tokens += delta.num_prompt_tokens
                    cached_tokens += delta.num_cached_tokens
        for final in finals.values():
            if final.finish_reason in FAILED_ENDINGS:
                status, error_type, message = FAILED_ENDINGS[final.finish_reason]
                raise APIError(status, message, error_type=error_type)
        choices = []
        for choice in sorted(finals):
            text = "".join(texts[choice])
            entry: dict[str, Any] = {"index": choice}
            if self.chat:
                entry["message"] = {"role": "assistant", "content": text}
            else:
                entry["text"] = text
            entry.update(
                {
                    "logprobs": self._logprobs(choice, tokens[choice], entries[choice]),
                    "finish_reason": finals[choice].finish_reason,
                    "stop_reason": _stop_reason(finals[choice]),
                }
            )
            choices.append(entry)
        return JSONResponse(
            {
                "id": self.id,
                "object": self.object,
                "created": self.created,
                "model": self.model,
                "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens, self.details),
            }
        )

    def _chunk(self, choices: list[dict], include_usage: bool, usage_value: dict | None = None) -> dict:
        chunk = {
            "id": self.id,
            "object": f"{self.object}.chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if include_usage:
            chunk["usage"] = usage_value
        return chunk

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        stop_reason: str | None = None,
        first: bool = False,
        logprobs: dict | None = None,
    ) -> dict:
        ending = {"logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": index, "delta": delta, **ending}
        return {"index": index, "text": text, **ending}

    async def stream(self, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
        """SSE chunks; the usage comes in one last chunk with no choices when ``include_usage`` is set."""
        prompt_tokens = cached_tokens = completion_tokens = 0
        counted: set[int] = set()
        started: set[int] = set()
        failed = False
        try:
            if self.chat:  # the assistant's role first, for every choice, as vLLM sends it
                for prompt_index in range(len(streams)):
                    for k in range(self.n):
                        choice = prompt_index * self.n + k
                        started.add(choice)
                        yield _sse(self._chunk([self._choice(choice, "", None, first=True)], include_usage))
            async for prompt_index, delta in _merged(streams):
                choice = self._choice_index(prompt_index, delta)
                completion_tokens += len(delta.token_ids)
                if delta.finished and prompt_index not in counted:
                    counted.add(prompt_index)
                    prompt_tokens += delta.num_prompt_tokens
                    cached_tokens += delta.num_cached_tokens
                if delta.finished and delta.finish_reason in FAILED_ENDINGS:
                    failed = True
                    status, error_type, message = FAILED_ENDINGS[delta.finish_reason]
                    yield _sse(error_body(message, error_type, status))
                    break
                with_logprobs = self.num_logprobs is not None and bool(delta.token_ids)
                if delta.text or delta.finished or with_logprobs:
                    finish = delta.finish_reason if delta.finished else None
                    logprobs = self._logprobs(choice, delta.token_ids, delta.logprobs)
                    choice_chunk = self._choice(choice, delta.text, finish, _stop_reason(delta), logprobs=logprobs)
                    yield _sse(self._chunk([choice_chunk], include_usage))
            if include_usage and not failed:
                yield _sse(self._chunk([], True, usage(prompt_tokens, completion_tokens, cached_tokens, self.details)))
            yield "data: [DONE]\n\n"
        finally:
            for stream in streams:  # a client that went away: abort what still runs
                await stream.aclose()


def _stop_reason(delta: StreamDelta) -> str | None:
    """The stop string that ended a finished completion (vLLM's ``stop_reason``), None otherwise."""
    return delta.output.outputs[0].stop_reason if delta.output is not None else None


class _EngineCollector:
    """``/metrics``: the engine's figures under vLLM's metric names (read from ``AsyncLLM.stats``)."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats
        labels = ["model_name"]
        values = [self.model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits
        )
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.num_blocks_in_use / stats.num_blocks if stats.num_blocks else 0.0,
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens)
        finished = CounterMetricFamily(
            "vllm:request_success", "Count of finished requests by finish reason.", labels=[*labels, "finished_reason"]
        )
        for reason in sorted(set(FINISH_REASONS) | set(stats.finished_by_reason)):
            finished.add_metric([self.model_name, reason], stats.finished_by_reason.get(reason, 0))
        yield finished


# -- running it ------------------------------------------------------------------------
class BackgroundServer:
    """The server in a thread of this process (notebooks, tests): ``with BackgroundServer(llm) as server: server.url``.

    The engine loop runs in its own thread as usual; uvicorn serves on
    ``host:port`` (port 0 picks a free one). ``stop()`` shuts both down.
    """

    def __init__(
        self,
        llm: LLM,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str | list[str] = "mini-vllm",
        enable_prompt_tokens_details: bool = True,
        trust_request_chat_template: bool = False,
        enable_scale_out: bool = False,
        kv_events_config: str | dict | None = None,
    ) -> None:
        """``enable_scale_out`` and ``kv_events_config`` (a JSON text or a dict of vLLM's ``KVEventsConfig``
        fields) are ``serve --enable-scale-out`` and ``--kv-events-config``: what a router in front needs."""
        import uvicorn

        engine = llm.llm_engine
        self.kv_events = start_kv_events(engine, kv_events_config)
        settings = ServerSettings(
            served_model_names=[served_model_name] if isinstance(served_model_name, str) else list(served_model_name),
            model_path=engine.model_path,
            max_model_len=servable_model_len(engine),
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            default_sampling=default_sampling_from(engine.model_path),
            trust_request_chat_template=trust_request_chat_template,
            enable_scale_out=enable_scale_out,
        )
        self.engine = AsyncLLM(llm)
        self.app = build_app(self.engine, settings)
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="mini-vllm-http", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server could not start on {host}:{port}")
            threading.Event().wait(0.02)
        bound_port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound_port}"

    def stop(self) -> None:
        self.engine.begin_shutdown()  # running requests end now (aborted), so uvicorn has none to wait for
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.engine.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def port_number(text: str) -> int:
    """``--port``: a TCP port, 0 to 65535 (0: any free one); anything else is an argparse error (exit 2)
    before the model loads, not uvicorn's OverflowError after."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 65535, got {port}")
    return port


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """``vllm serve``'s flag names, where mini-vLLM has the setting."""
    parser.add_argument("model_tag", nargs="?", default=None, help="a local Hugging Face folder (default: bundled)")
    parser.add_argument("--model", default=None, help="same as the positional MODEL")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=port_number, default=8000, help="port, 0-65535 (default: %(default)s)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model names clients may send; responses report the first (default: MODEL)",
    )
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--dtype", default=None, help="auto, float32, float16 or bfloat16")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N")
    parser.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="blocks in the KV-cache pool (EngineConfig.num_blocks)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="requests per step at most")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step at most")
    parser.add_argument("--attention-backend", default=None, help="torch, triton or cpu (default: auto)")
    parser.add_argument("--seed", type=int, default=None, help="the engine's seed for requests without one")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefix caching (default: on)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="use a chat template sent with a request (chat_template, chat_template_kwargs.chat_template); "
        "refused by default: it runs on the server's one renderer thread",
    )
    parser.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish the KV-cache events over ZMQ as vLLM does, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\' (vLLM\'s KVEventsConfig fields)',
    )
    parser.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve /v1/chat/completions/render and /v1/completions/render (a router tokenizes with them)",
    )
    parser.add_argument(
        "--learner-engine",
        action="store_true",
        help="serve your own engine: the parts you passed in the exercises (mini_vllm.course.learner_engine)",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn's log level (default: %(default)s)")


ENGINE_FLAGS = {
    "block_size": "block_size",
    "max_model_len": "max_model_len",
    "dtype": "dtype",
    "device": "device",
    "num_gpu_blocks_override": "num_blocks",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "attention_backend": "attention_backend",
    "seed": "seed",
}
"""Server flag (argparse dest) -> ``EngineConfig`` field."""


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m mini_vllm serve", description="An OpenAI-compatible server over mini-vLLM (make serve)."
    )
    add_server_args(parser)
    args = parser.parse_args(argv)
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    settings = {field: getattr(args, flag) for flag, field in ENGINE_FLAGS.items() if getattr(args, flag) is not None}
    settings["enable_prefix_caching"] = args.enable_prefix_caching
    try:
        if args.learner_engine:
            from ...course.learner_engine import learner_engine, show_parts

            llm = learner_engine(model, **settings)
            print(show_parts(llm))
        else:
            llm = LLM(model, **settings)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    try:
        kv_events = start_kv_events(llm.llm_engine, args.kv_events_config)
    except (ValueError, ImportError, OSError) as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = llm.llm_engine
    server_settings = ServerSettings(
        served_model_names=args.served_model_name or [model or "mini-vllm"],
        model_path=engine.model_path,
        max_model_len=servable_model_len(engine),
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        default_sampling=default_sampling_from(engine.model_path),
        trust_request_chat_template=args.trust_request_chat_template,
        enable_scale_out=args.enable_scale_out,
    )
    engine = AsyncLLM(llm)
    app = build_app(engine, server_settings)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
    )

    def listening(port: int) -> None:
        print(f"mini-vLLM serves {server_settings.served_model_name!r} on http://{args.host}:{port}/v1", flush=True)

    server = _Server(config, engine, listening)
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn raises the Ctrl-C it handled again once it has shut down (as uvicorn.run does)
    except SystemExit as exit_:  # uvicorn could not start: the port is taken, or the address is not this machine's
        if server.started or not exit_.code:
            raise
        print(
            f"mini-vLLM could not listen on {args.host}:{args.port} (uvicorn's error above says why; "
            "if another server has the port, choose another with --port)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if not engine.stopped:
        exit_now(f"the engine is still in a step after {GRACEFUL_SHUTDOWN_S} s: exiting without waiting for it")
    if kv_events is not None:
        kv_events.close()
    return 0


def start_kv_events(engine, config: str | dict | None):
    """Publish ``engine``'s KV events as ``--kv-events-config`` says; None when it says nothing is published.

    Imported only then: pyzmq and msgspec are needed for this alone (their absence is an
    ImportError naming the package).
    """
    if config is None:
        return None
    from ...distributed.kv_events import KVEventsConfig, publish_kv_events

    config = KVEventsConfig.from_json(config) if isinstance(config, str) else KVEventsConfig.from_dict(config)
    return publish_kv_events(engine, config) if config.publishes else None


def exit_now(reason: str) -> None:
    """End the process at once with status 1, saying why.

    A normal exit would tear the interpreter down under the engine thread while it runs a
    step in torch, which aborts the process (SIGABRT, "terminate called without an active
    exception"); ``os._exit`` skips that teardown. The clients were answered already.
    """
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except RuntimeError:  # in a signal handler, a write in progress cannot be re-entered
        pass
    os.write(sys.stderr.fileno(), f"mini-vLLM: {reason}\n".encode())
    os._exit(1)


class _Server:
    """uvicorn's server, which says it is listening once it is, and on Ctrl-C or SIGTERM first aborts the
    requests in flight.

    ``listening(port)`` runs once the socket is bound (a port in use never gets that far: uvicorn
    logs the error and raises SystemExit). At the first Ctrl-C or SIGTERM the requests in flight
    end at once (``AsyncLLM.begin_shutdown``: a 503, or an error event on a stream; their blocks
    are freed when the engine's step is done), so uvicorn's graceful shutdown finds none to wait
    for; a second one exits at once (``exit_now``), not waiting for the engine's step.
    """

    def __new__(cls, config, engine: AsyncLLM, listening: Callable[[int], None]):
        import uvicorn

        class Server(uvicorn.Server):
            async def startup(self, sockets=None) -> None:
                await super().startup(sockets=sockets)
                listening(self.servers[0].sockets[0].getsockname()[1])

            def handle_exit(self, sig, frame) -> None:
                if self.should_exit:
                    exit_now(f"{signal.Signals(sig).name} again: exiting without waiting for the engine")
                engine.begin_shutdown()
                super().handle_exit(sig, frame)

        return Server(config)
