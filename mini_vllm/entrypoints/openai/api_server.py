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
(Prometheus text with vLLM's metric names) and ``POST /reset_prefix_cache``; with
``--enable-scale-out``, ``POST /v1/chat/completions/render`` and
``POST /v1/completions/render`` (a router's tokenization, ``serving_render.py``).
``--kv-events-config`` publishes the engine's KV events over ZMQ as vLLM does
(``mini_vllm/distributed/kv_events.py``), for a KV-aware router in front.

The HTTP layer is FastAPI + uvicorn, as in vLLM. Every request goes to one
``AsyncLLM`` (``mini_vllm/entrypoints/async_llm.py``), whose single engine
loop batches the requests of all clients together. A bad request gets a 4xx
with ``{"error": {"message", "type", "param", "code"}}`` naming the field, and
nothing is queued; a request the engine fails on gets a 500, alone; a client
that disconnects has its request aborted and its blocks freed.

This module wires the routes (each a line or two, handing the request to its
endpoint's serving object) and runs the server; the work is in its neighbours:
``protocol.py`` (request and response bodies, request -> ``SamplingParams``),
``serving_engine.py`` (the flow chat and completions share, whole and streamed
responses), ``serving_chat.py``, ``serving_completion.py``,
``serving_tokenization.py``, ``serving_models.py`` (``ServerSettings``,
``/v1/models``), ``renderer.py`` (chat templates and tokenizing, off the engine
thread), ``metrics.py`` (``/metrics``) and ``cli_args.py`` (the flags). A new
route is one function below; a new flag, one ``add_argument`` in ``cli_args.py``.

vLLM equivalent: ``vllm/entrypoints/openai/api_server.py`` (``build_app``,
``init_app_state``, ``run_server``); flags keep ``vllm serve``'s names where they exist.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import signal
import sys
import threading
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...llm import LLM
from ..async_llm import AsyncLLM, EngineShutDown
from .cli_args import engine_settings, make_arg_parser, server_settings, validate_parsed_serve_args
from .metrics import EngineMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .renderer import Renderer
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_models import ServerSettings, show_available_models
from .serving_render import OpenAIServingRender
from .serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("mini_vllm")

# Seconds a shutdown (Ctrl-C, SIGTERM) waits for running requests before aborting them.
GRACEFUL_SHUTDOWN_S = 5
# pydantic's tags of a union's members, left out of the field path a 400 names.
UNION_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def mini_vllm_version() -> str:
    """The installed package's version (``pyproject.toml``), which ``/version`` reports as vLLM's reports its own."""
    try:
        return importlib.metadata.version("mini-vllm-course")
    except importlib.metadata.PackageNotFoundError:  # a checkout run without pip install
        return "unknown"


async def json_only(request: Request) -> None:
    """A body that is not sent as JSON is a 400 in vLLM's words (its ``validate_json_request``), checked
    before the body is read as a request."""
    media_type = request.headers.get("content-type", "").lower().split(";", maxsplit=1)[0].strip()
    if media_type != "application/json":
        raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed")


# -- the routes: each hands its request to the app's serving object for it (build_app sets them) ------
router = APIRouter()
JSON_BODY = [Depends(json_only)]


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping() -> Response:
    """SageMaker's health check, which vLLM's server also answers: the same as ``/health``."""
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict:
    return {"version": mini_vllm_version()}


@router.post("/tokenize", dependencies=JSON_BODY)
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    return await request.app.state.openai_serving_tokenization.tokenize(body)


@router.post("/detokenize", dependencies=JSON_BODY)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    return await request.app.state.openai_serving_tokenization.detokenize(body)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return show_available_models(request.app.state.settings)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, reset_running_requests: bool = False) -> dict:
    """Always a 200 saying whether the cache was reset, as vLLM's: ``{"success": false}`` while requests
    hold blocks, unless ``?reset_running_requests=true`` preempts them first (they are recomputed)."""
    return {"success": await request.app.state.engine.reset_prefix_cache(reset_running_requests)}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return request.app.state.metrics.response()


@router.post("/v1/chat/completions", dependencies=JSON_BODY)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await request.app.state.openai_serving_chat.create(body, request)


@router.post("/v1/completions", dependencies=JSON_BODY)
async def completions(body: CompletionRequest, request: Request):
    return await request.app.state.openai_serving_completion.create(body, request)


@router.post("/v1/chat/completions/render", dependencies=JSON_BODY)
async def render_chat_completion(body: ChatCompletionRequest, request: Request) -> dict:
    return await request.app.state.openai_serving_render.render_chat(body)


@router.post("/v1/completions/render", dependencies=JSON_BODY)
async def render_completion(body: CompletionRequest, request: Request) -> list[dict]:
    return await request.app.state.openai_serving_render.render_completion(body)


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The FastAPI application: the routes, the error handlers, and the endpoints' serving objects."""
    app = FastAPI(title="mini-vLLM OpenAI-compatible server", lifespan=lifespan)
    for error, handler in EXCEPTION_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.include_router(router)
    state = app.state
    state.engine = engine
    state.settings = settings
    state.renderer = renderer = Renderer(engine, settings.max_model_len, settings.trust_request_chat_template)
    state.openai_serving_chat = OpenAIServingChat(engine, settings, renderer)
    state.openai_serving_completion = OpenAIServingCompletion(engine, settings, renderer)
    state.openai_serving_tokenization = OpenAIServingTokenization(engine, settings, renderer)
    state.openai_serving_render = OpenAIServingRender(
        state.openai_serving_chat, state.openai_serving_completion, settings.enable_scale_out
    )
    state.metrics = EngineMetrics(engine, settings.served_model_name)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine and the renderer shut down with the server."""
    yield
    # Its streams have ended already (begin_shutdown); a step longer than this is left running.
    app.state.engine.shutdown(timeout=GRACEFUL_SHUTDOWN_S)
    app.state.renderer.shutdown()


# -- errors: every one answered with the OpenAI error body ---------------------------------
def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def api_error(request: Request, error: APIError) -> JSONResponse:
    return error_response(error)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    # FastAPI's own 4xx (a body it cannot parse, an unknown route or method): the OpenAI error body too.
    message = str(error.detail)
    if message == "There was an error parsing the body":
        message = "the request body could not be parsed: send UTF-8 JSON (at most a few hundred levels deep)"
    return error_response(APIError(error.status_code, message))


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
    return error_response(APIError(400, message, param=param))


async def shutting_down(request: Request, error: EngineShutDown) -> JSONResponse:
    return error_response(APIError(503, str(error), error_type="ServiceUnavailableError"))


async def internal_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("request failed")
    return error_response(APIError(500, f"the engine failed on this request: {type(error).__name__}: {error}"))


EXCEPTION_HANDLERS = {
    APIError: api_error,
    StarletteHTTPException: http_error,
    RequestValidationError: validation_error,
    EngineShutDown: shutting_down,
    Exception: internal_error,
}


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
        """``enable_scale_out`` and ``kv_events_config`` (JSON text, or a dict of vLLM's ``KVEventsConfig``
        fields) are ``serve --enable-scale-out`` and ``--kv-events-config``: what a router in front needs."""
        settings = ServerSettings.for_engine(
            llm.llm_engine,
            [served_model_name] if isinstance(served_model_name, str) else list(served_model_name),
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            trust_request_chat_template=trust_request_chat_template,
            enable_scale_out=enable_scale_out,
        )
        self.kv_events = start_kv_events(llm.llm_engine, kv_events_config)
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


def main(argv: list[str] | None = None) -> int:
    """``python -m mini_vllm serve``: read the flags, load the engine, serve until Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m mini_vllm serve", description="An OpenAI-compatible server over mini-vLLM (make serve)."
    )
    args = make_arg_parser(parser).parse_args(argv)
    validate_parsed_serve_args(parser, args)
    args.model = args.model_tag or args.model
    try:
        if args.learner_engine:
            from ...course.learner_engine import learner_engine, show_parts

            llm = learner_engine(args.model, **engine_settings(args))
            print(show_parts(llm))
        else:
            llm = LLM(args.model, **engine_settings(args))
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    try:
        kv_events = start_kv_events(llm.llm_engine, args.kv_events_config)
    except (ValueError, ImportError, OSError) as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_server(llm, args)
    finally:
        if kv_events is not None:
            kv_events.close()


def start_kv_events(engine, config: str | dict | None):
    """Publish ``engine``'s KV events as ``--kv-events-config`` says; None when it says nothing is published.

    Imported only then: pyzmq and msgspec are needed for this alone (without them, an
    ImportError naming the package).
    """
    if config is None:
        return None
    from ...distributed.kv_events import KVEventsConfig, publish_kv_events

    config = KVEventsConfig.from_json(config) if isinstance(config, str) else KVEventsConfig.from_dict(config)
    return publish_kv_events(engine, config) if config.publishes else None


def run_server(llm: LLM, args: argparse.Namespace) -> int:
    """Serve ``llm`` on ``--host``/``--port`` until Ctrl-C or SIGTERM: 0, or 1 if the port cannot be had."""
    served_model_names = args.served_model_name or [args.model or "mini-vllm"]
    settings = ServerSettings.for_engine(llm.llm_engine, served_model_names, **server_settings(args))
    engine = AsyncLLM(llm)
    app = build_app(engine, settings)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
    )
    server = UvicornServer(config, engine, settings.served_model_name)
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
    return 0


class UvicornServer(uvicorn.Server):
    """uvicorn's server, which says it is listening once it is, and on Ctrl-C or SIGTERM first aborts the
    requests in flight.

    The line naming the URL is printed once the socket is bound (a port in use never gets that
    far: uvicorn logs the error and raises SystemExit). At the first Ctrl-C or SIGTERM the
    requests in flight end at once (``AsyncLLM.begin_shutdown``: a 503, or an error event on a
    stream; their blocks are freed when the engine's step is done), so uvicorn's graceful
    shutdown finds none to wait for; a second one exits at once (``exit_now``), not waiting for
    the engine's step.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, served_model_name: str) -> None:
        super().__init__(config)
        self.engine = engine
        self.served_model_name = served_model_name

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        port = self.servers[0].sockets[0].getsockname()[1]
        print(f"mini-vLLM serves {self.served_model_name!r} on http://{self.config.host}:{port}/v1", flush=True)

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            exit_now(f"{signal.Signals(sig).name} again: exiting without waiting for the engine")
        self.engine.begin_shutdown()
        super().handle_exit(sig, frame)


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
