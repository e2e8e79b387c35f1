"""What the two generating endpoints share: checks, queueing, and the response, whole or streamed.

``/v1/chat/completions`` (``serving_chat.py``) and ``/v1/completions``
(``serving_completion.py``) run one flow, ``OpenAIServing.create``: check the
request, render its prompts to token ids, make its ``SamplingParams``, queue every
prompt or none, then answer with one JSON body (``ResponseBuilder.collect``) or an
SSE stream (``ResponseBuilder.stream``). Each endpoint gives only what is its own:
how its prompts become token ids, and how its choices and logprobs are written.

vLLM equivalent: ``vllm/entrypoints/openai/serving_engine.py`` (``OpenAIServing``),
with the generators of ``serving_chat.py`` / ``serving_completion.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ...sampling_params import SamplingParams
from ..async_llm import SHUTDOWN, AsyncLLM, RequestStream, StreamDelta
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body, now, random_id, usage
from .renderer import Renderer
from .serving_models import ServerSettings

logger = logging.getLogger("mini_vllm")

# vLLM 0.33 refuses salts longer than this or containing these characters.
MAX_CACHE_SALT_LENGTH = 128
FORBIDDEN_SALT_CHARACTERS = ("@", "/", "\\", "\0")
# Completions that ended without an answer, as the client is told: finish_reason -> (status, error type, message).
FAILED_ENDINGS = {
    "error": (500, "InternalServerError", "the engine failed while computing this request (see the server's log)"),
    SHUTDOWN: (
        503,
        "ServiceUnavailableError",
        "the server is shutting down: this request was stopped before it finished",
    ),
}


def check_implemented(body: Any) -> None:
    """A 400 naming the first field that asks for what this server does not implement (vLLM would honour it)."""
    field = body.not_implemented_field()
    if field is not None:
        raise APIError(400, f"{field} is not supported by mini-vLLM's server", param=field)


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


class OpenAIServing(ABC):
    """One generating endpoint: a request checked, rendered, queued, and answered whole or streamed.

    Each endpoint's subclass gives ``prompts`` (the request's prompts as token ids, rendered on
    the renderer thread) and ``builder`` (its ``ResponseBuilder``).
    """

    builder: ClassVar[type[ResponseBuilder]]

    def __init__(self, engine: AsyncLLM, settings: ServerSettings, renderer: Renderer) -> None:
        self.engine = engine
        self.settings = settings
        self.renderer = renderer

    async def create(self, body: ChatCompletionRequest | CompletionRequest, raw_request: Request) -> Response:
        """The endpoint: its JSON response, its SSE stream, or a 499 when the client left before the answer."""
        prompts, params = await self.prepare(body)
        streams = await self.start(prompts, body.cache_salt, params, body.PROMPT_FIELD)
        settings = self.settings
        response = self.builder(
            settings.served_model_name, settings.enable_prompt_tokens_details, body.n, params[0].logprobs, self.decode
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(response.stream(streams, include_usage), media_type="text/event-stream")
        result = await until_disconnected(raw_request, response.collect(streams))
        return result if result is not None else Response(status_code=499)

    async def prepare(
        self, body: ChatCompletionRequest | CompletionRequest
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        """The request checked: its prompts' token ids, and each one's ``SamplingParams``; a 4xx otherwise."""
        self.settings.check_model(body.model)
        check_cache_salt(body.cache_salt)
        check_implemented(body)
        prompts = await self.prompts(body)
        limit, defaults = self.settings.max_model_len, self.settings.default_sampling
        return prompts, [body.to_sampling_params(len(token_ids), limit, defaults) for token_ids in prompts]

    @abstractmethod
    async def prompts(self, body: Any) -> list[list[int]]:
        """The request's prompts as token ids (a 400 naming the field for a bad one)."""

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

    def decode(self, token_id: int) -> str:
        """One token id's text (a logprob entry's, when the engine gave none)."""
        return self.engine.tokenizer.decode([token_id])


class ResponseBuilder(ABC):
    """One response (whole, or as SSE chunks) built from the engine's deltas.

    Each endpoint's subclass gives its id prefix and object names, ``content`` (how a choice's
    text is written) and ``logprobs`` (a choice's, in its endpoint's shape).
    """

    ID_PREFIX: ClassVar[str]
    OBJECT: ClassVar[str]
    CHUNK_OBJECT: ClassVar[str]

    def __init__(
        self, model: str, details: bool, n: int, num_logprobs: int | None, decode: Callable[[int], str]
    ) -> None:
        self.id = random_id(self.ID_PREFIX)
        self.model = model
        self.details = details  # usage.prompt_tokens_details (--enable-prompt-tokens-details)
        self.n = n
        self.created = now()
        self.num_logprobs = num_logprobs  # top candidates per token (SamplingParams.logprobs); None: no logprobs
        self.decode = decode  # one token id's text

    @abstractmethod
    def content(self, text: str, chunk: bool = False, first: bool = False) -> dict[str, Any]:
        """A choice's text: whole, or one chunk's (``first``: the choice's first chunk)."""

    @abstractmethod
    def logprobs(self, choice: int, token_ids: list[int], entries: list) -> dict:
        """The ``logprobs`` of ``token_ids`` (a whole choice, or one chunk's tokens)."""

    def opening_chunks(self, num_choices: int) -> list[dict]:
        """Chunk choices streamed before any token (chat: every choice's role)."""
        return []

    def _logprobs(self, choice: int, token_ids: list[int], entries: list | None) -> dict | None:
        if self.num_logprobs is None or entries is None:
            return None
        return self.logprobs(choice, token_ids, entries)

    def _choice_index(self, prompt_index: int, delta: StreamDelta) -> int:
        return prompt_index * self.n + delta.index

    async def collect(self, streams: list[RequestStream]) -> JSONResponse:
        texts: dict[int, list[str]] = {}
        finals: dict[int, StreamDelta] = {}
        tokens: dict[int, list[int]] = {}
        entries: dict[int, list] = {}
        prompt_tokens = cached_tokens = completion_tokens = 0
        counted: set[int] = set()
        async for prompt_index, delta in merged(streams):
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
            entry: dict[str, Any] = {"index": choice, **self.content("".join(texts[choice]))}
            entry.update(
                {
                    "logprobs": self._logprobs(choice, tokens[choice], entries[choice]),
                    "finish_reason": finals[choice].finish_reason,
                    "stop_reason": stop_reason(finals[choice]),
                }
            )
            choices.append(entry)
        return JSONResponse(
            {
                "id": self.id,
                "object": self.OBJECT,
                "created": self.created,
                "model": self.model,
                "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens, self.details),
            }
        )

    def _chunk(self, choices: list[dict], include_usage: bool, usage_value: dict | None = None) -> dict:
        chunk = {
            "id": self.id,
            "object": self.CHUNK_OBJECT,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if include_usage:
            chunk["usage"] = usage_value
        return chunk

    def chunk_choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        stop_reason: str | None = None,
        first: bool = False,
        logprobs: dict | None = None,
    ) -> dict:
        ending = {"logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}
        return {"index": index, **self.content(text, chunk=True, first=first), **ending}

    async def stream(self, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
        """SSE chunks; the usage comes in one last chunk with no choices when ``include_usage`` is set."""
        prompt_tokens = cached_tokens = completion_tokens = 0
        counted: set[int] = set()
        failed = False
        try:
            for opening in self.opening_chunks(len(streams) * self.n):
                yield sse(self._chunk([opening], include_usage))
            async for prompt_index, delta in merged(streams):
                choice = self._choice_index(prompt_index, delta)
                completion_tokens += len(delta.token_ids)
                if delta.finished and prompt_index not in counted:
                    counted.add(prompt_index)
                    prompt_tokens += delta.num_prompt_tokens
                    cached_tokens += delta.num_cached_tokens
                if delta.finished and delta.finish_reason in FAILED_ENDINGS:
                    failed = True
                    status, error_type, message = FAILED_ENDINGS[delta.finish_reason]
                    yield sse(error_body(message, error_type, status))
                    break
                with_logprobs = self.num_logprobs is not None and bool(delta.token_ids)
                if delta.text or delta.finished or with_logprobs:
                    finish = delta.finish_reason if delta.finished else None
                    logprobs = self._logprobs(choice, delta.token_ids, delta.logprobs)
                    choice_chunk = self.chunk_choice(choice, delta.text, finish, stop_reason(delta), logprobs=logprobs)
                    yield sse(self._chunk([choice_chunk], include_usage))
            if include_usage and not failed:
                yield sse(self._chunk([], True, usage(prompt_tokens, completion_tokens, cached_tokens, self.details)))
            yield "data: [DONE]\n\n"
        finally:
            for stream in streams:  # a client that went away: abort what still runs
                await stream.aclose()


def sse(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def stop_reason(delta: StreamDelta) -> str | None:
    """The stop string that ended a finished completion (vLLM's ``stop_reason``), None otherwise."""
    return delta.output.outputs[0].stop_reason if delta.output is not None else None


def decoded_token(entry: Any, token_id: int, decode: Callable[[int], str]) -> str:
    """A logprob entry's token as text: the engine's ``decoded_token``, else decoded here (vLLM's ``_get_decoded_token``)."""
    return entry.decoded_token if entry.decoded_token is not None else decode(token_id)


def json_logprob(entry: Any) -> float:
    return max(entry.logprob, -9999.0)  # -inf is no JSON number: OpenAI's floor, as vLLM writes it


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
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


async def until_disconnected(request: Request, work: Any) -> Any:
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
