"""``AsyncLLM``: one engine, many asyncio callers (what the OpenAI server runs on).

``LLM.generate`` runs the engine until *its* prompts are done, so two callers
could never share a step. A server needs the opposite: one engine loop that
keeps stepping while requests arrive and leave, so that requests from many
HTTP clients are batched together (continuous batching across clients).

The engine is not thread-safe, so it has exactly one owner here: the engine
thread (``_run``). Callers never touch the engine; they send it commands
(add a request, abort one, read the stats) through a queue and receive, per
request, a stream of ``StreamDelta`` objects on an ``asyncio.Queue``:

    caller (event loop)                        engine thread
    ───────────────────                        ─────────────
    streams = await add_requests(prompts) ─add─▶ add_parent_requests (validates: a bad
                                               prompt raises here, in the caller)
    async for delta in stream: ...   ◀─delta─  step(); after every step, for each of its
                                               requests: new tokens, new text, finished?
    stream.aclose() (caller gone)    ─abort─▶  abort_request (frees its blocks)

vLLM equivalent: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate``,
``abort``), whose engine core runs in a separate process and streams
``EngineCoreOutputs`` back; here a thread and a queue play those roles.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..detokenizer import IncrementalDetokenizer
from ..llm import LLM
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

logger = logging.getLogger("mini_vllm")

# The finish_reason of the deltas that end every open stream when the server shuts down
# (``AsyncLLM.begin_shutdown``): not an OpenAI finish reason, the server answers it with a 503.
SHUTDOWN = "shutdown"


class EngineShutDown(RuntimeError):
    """A call that arrives after ``begin_shutdown``, or waited behind the step it came in: never run."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down: this request was not started")


@dataclass
class StreamDelta:
    """What one completion gained in one engine step (or how it ended).

    ``index`` is the completion's index within its prompt (0..n-1).
    ``text`` is new text only: concatenating every delta's ``text`` gives the
    final text exactly (text that a stop string might still cut is held back
    until the completion finishes). ``output`` is set on the last delta.
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = None
    # With SamplingParams(logprobs=k): each of token_ids' {token id: Logprob} (``CompletionOutput.logprobs``).
    logprobs: list | None = None


@dataclass
class _Stream:
    """The engine thread's record of one completion it streams to a caller.

    ``detokenizer`` is its request's (``Request.detokenizer``, the owner of its
    text): each step's new text is ``get_next_output_text(delta=True)``, which
    holds back what a stop string could still cut.
    """

    index: int
    push: Callable[[StreamDelta], None]
    detokenizer: IncrementalDetokenizer
    num_tokens_sent: int = 0


@dataclass
class ServingStats:
    """Engine-wide figures for ``/metrics``, copied by the engine thread after every step."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # The KV-cache offloading tier's (0 without one): SchedulerStats.connector_prefix_cache_stats.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_blocks: int = 0
    num_blocks_in_use: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)


class RequestStream:
    """One prompt's deltas, in the order the engine produced them: ``async for delta in stream``.

    Ends after every completion's last delta. ``aclose()`` (also run when the
    caller stops early) aborts the completions still running. ``end(reason)``
    ends it from the caller's side, without waiting for the engine: a last
    delta with ``finish_reason=reason`` for every completion still running
    (what the engine sends for them afterwards is dropped).
    """

    def __init__(self, engine: AsyncLLM, request_ids: list[str], deltas: asyncio.Queue) -> None:
        self.request_ids = request_ids
        self._engine = engine
        self._deltas = deltas
        self._remaining = set(request_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        while self._remaining:
            delta = await self._deltas.get()
            if delta.request_id not in self._remaining:
                continue  # a completion that end() ended already
            if delta.finished:
                self._remaining.discard(delta.request_id)
            return delta
        raise StopAsyncIteration

    def end(self, finish_reason: str) -> None:
        """Queue a last delta with ``finish_reason`` for every completion still running (event-loop thread only)."""
        for index, request_id in enumerate(self.request_ids):
            if request_id in self._remaining:  # (a last delta already queued for it is read first and wins)
                ending = StreamDelta(request_id, index, "", [], 0, 0, finished=True, finish_reason=finish_reason)
                self._deltas.put_nowait(ending)

    async def aclose(self) -> None:
        if self._remaining:
            self._engine.abort(sorted(self._remaining))
            self._remaining.clear()


class AsyncLLM:
    """Serves one ``LLM`` (the reference engine or a learner's) to asyncio callers.

    Owns the engine thread; everything else talks to the engine through
    ``add_requests``, ``abort``, ``reset_prefix_cache`` and ``call``. Call
    ``shutdown`` to stop the thread (requests still running are aborted, and
    their streams end at once, whatever step the engine is in).
    """

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = llm.get_tokenizer()
        self.stats = ServingStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only: request id -> its stream
        self._ids = itertools.count()
        self._stopping = False
        # Event-loop side: the streams handed out (each leaves when collected) and their loop.
        self._request_streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending_calls: set[concurrent.futures.Future] = set()  # call()s the engine thread has not run yet
        self._thread = threading.Thread(target=self._run, name="mini-vllm-engine", daemon=True)
        self._thread.start()

    # -- what callers use ---------------------------------------------------------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread between two steps; its result or exception comes back."""
        if self._stopping:
            raise EngineShutDown()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._pending_calls.add(future)
        future.add_done_callback(self._pending_calls.discard)
        self._commands.put((fn, future))
        self._wakeup.set()
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # begin_shutdown cancelled it before the engine thread ran it (a caller that was itself
            # cancelled during the shutdown gets this too: it is going away either way).
            if self._stopping and future.cancelled():
                raise EngineShutDown() from None
            raise

    async def add_requests(self, prompts: list[Any], sampling_params: list[SamplingParams]) -> list[RequestStream]:
        """Queue prompts (``n`` completions each), all or none; each prompt's deltas come from its ``RequestStream``.

        A prompt is what ``LLM.generate`` takes (text, or a dict with
        ``prompt_token_ids`` and ``cache_salt``). Bad input raises here, with
        nothing queued (``LLMEngine.add_parent_requests``: in a batch, the error
        names the prompt's index), so no prompt of a refused batch ever runs.
        Closing a stream before it ends (the client went away) aborts the
        completions that have not finished, so their blocks go back to the pool.
        """
        self._loop = loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue[StreamDelta]] = [asyncio.Queue() for _ in prompts]

        def pusher(deltas: asyncio.Queue) -> Callable[[StreamDelta], None]:
            def push(delta: StreamDelta) -> None:  # runs on the engine thread
                try:
                    loop.call_soon_threadsafe(deltas.put_nowait, delta)
                except RuntimeError:  # the event loop has closed: the server has stopped and nobody reads this
                    pass

            return push

        request_ids = [f"serve-{next(self._ids)}" for _ in prompts]
        pushes = [pusher(deltas) for deltas in queues]
        child_ids = await self.call(lambda: self._add(request_ids, prompts, sampling_params, pushes))
        streams = [RequestStream(self, ids, deltas) for ids, deltas in zip(child_ids, queues)]
        for stream in streams:
            self._request_streams.add(stream)
            if self._stopping:  # the shutdown began while the engine queued it
                stream.end(SHUTDOWN)
        return streams

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (fire and forget: the engine thread frees their blocks before its next step)."""
        if not self._stopping:
            self._commands.put((lambda: self._abort(request_ids), None))
            self._wakeup.set()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await self.call(lambda: self.engine.reset_prefix_cache(reset_running_requests))

    def begin_shutdown(self) -> None:
        """End every stream now (a last delta with ``finish_reason="shutdown"``, even while a long
        step runs), abort their requests and let the engine thread stop once its step is done;
        returns at once (safe in a signal handler, from any thread)."""
        if self._stopping:
            return
        self._commands.put((lambda: self._abort_all(SHUTDOWN), None))
        self._stopping = True
        self._wakeup.set()
        for future in list(self._pending_calls):  # waiting behind a long step: they will not run now
            future.cancel()
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._end_request_streams)
            except RuntimeError:  # the event loop has closed: no stream is read any more
                pass

    def _end_request_streams(self) -> None:
        for stream in list(self._request_streams):
            stream.end(SHUTDOWN)

    def shutdown(self, timeout: float = 30) -> None:
        """``begin_shutdown``, then wait up to ``timeout`` seconds for the engine thread to end."""
        self.begin_shutdown()
        self._thread.join(timeout=timeout)

    @property
    def stopped(self) -> bool:
        """The engine thread has ended (False while it finishes a step after ``begin_shutdown``)."""
        return not self._thread.is_alive()

    # -- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._run_commands()
            if self._stopping and self._commands.empty():
                return
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                finished = self.engine.step()
            except Exception:  # a bug outside the forward pass: fail what is running, keep serving
                logger.exception("engine step failed; its requests finish with an error")
                self._abort_all(reason="error")
                continue
            self._publish(finished)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as error:  # the caller's exception (e.g. a ValueError for bad input)
                if future is None:
                    logger.exception("engine command failed")
                else:
                    future.set_exception(error)
            else:
                if future is not None:
                    future.set_result(result)
        # (the stats are refreshed after commands too, so /metrics sees an aborted request leave)

    def _add(
        self, request_ids: list[str], prompts: list[Any], params: list[SamplingParams], pushes: list[Callable]
    ) -> list[list[str]]:
        """Queue the prompts' children (``ParentRequest``, ``parallel_sampling.py``); each streams on its own."""
        parents = self.engine.add_parent_requests(prompts, params, request_ids=request_ids)
        for parent, push in zip(parents, pushes):
            for index, child_id in enumerate(parent.child_request_ids):
                self._streams[child_id] = _Stream(index, push, self.engine.requests[child_id].detokenizer)
        self._refresh_stats()
        return [parent.child_request_ids for parent in parents]

    def _abort(self, request_ids: list[str]) -> None:
        """Abort requests whose caller went away. /metrics does not count them as finished: vLLM's
        ``OutputProcessor.abort_requests`` records no finished-request stats either."""
        for request_id in request_ids:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
        self._refresh_stats()

    def _abort_all(self, reason: str = "abort") -> None:
        """Abort every streamed request; ``reason`` is its streams' last finish_reason ("error" after a
        failed step, which /metrics counts as vLLM counts an engine's ERROR; SHUTDOWN, not counted, as an abort)."""
        for request_id, stream in list(self._streams.items()):
            request = self.engine.requests.get(request_id)
            self.engine.abort_request(request_id)
            del self._streams[request_id]
            if reason != SHUTDOWN:
                self._count_finished(reason)
            stream.push(
                StreamDelta(
                    request_id,
                    stream.index,
                    "",
                    [],
                    request.num_prompt_tokens if request else 0,
                    0,
                    finished=True,
                    finish_reason=reason,
                )
            )
        self._refresh_stats()

    def _publish(self, finished: list[RequestOutput]) -> None:
        """After a step: each streamed request's new tokens and text, and the finished ones' outputs."""
        # The engine's figures first: a client that reads /metrics as soon as its request ends sees it gone.
        self._refresh_stats()
        for output in finished:
            stream = self._streams.pop(output.request_id, None)
            if stream is None:
                continue  # not ours (queued directly on the engine) or already aborted
            completion = output.outputs[0]
            new_tokens = completion.token_ids[stream.num_tokens_sent :]
            logprobs = None if completion.logprobs is None else completion.logprobs[stream.num_tokens_sent :]
            # The rest of the final text (none after an error: the output's text is empty then).
            text = stream.detokenizer.get_next_output_text(finished=True, delta=True) if completion.text else ""
            self._count_prefill(stream, len(output.prompt_token_ids))
            self.stats.generation_tokens += len(new_tokens)
            self._count_finished(completion.finish_reason or "abort")
            stream.push(
                StreamDelta(
                    output.request_id,
                    stream.index,
                    text,
                    list(new_tokens),
                    len(output.prompt_token_ids),
                    output.num_cached_tokens,
                    finished=True,
                    finish_reason=completion.finish_reason,
                    output=output,
                    logprobs=logprobs,
                )
            )
        for request_id, stream in self._streams.items():
            request = self.engine.requests.get(request_id)
            if request is None or request.num_output_tokens == stream.num_tokens_sent:
                continue
            new_tokens = list(request.output_token_ids[stream.num_tokens_sent :])
            logprobs = None if request.logprobs is None else request.logprobs[stream.num_tokens_sent :]
            self._count_prefill(stream, request.num_prompt_tokens)
            stream.num_tokens_sent = request.num_output_tokens
            self.stats.generation_tokens += len(new_tokens)
            text = stream.detokenizer.get_next_output_text(finished=False, delta=True)
            stream.push(
                StreamDelta(
                    request_id,
                    stream.index,
                    text,
                    new_tokens,
                    request.num_prompt_tokens,
                    max(request.num_cached_tokens, 0),
                    logprobs=logprobs,
                )
            )

    def _count_prefill(self, stream: _Stream, num_prompt_tokens: int) -> None:
        """``vllm:prompt_tokens``: a request's prompt counts once its prefill is done (its first token
        arrives), finished or not, as vLLM counts it (``IterationStats.update_from_output``)."""
        if stream.num_tokens_sent == 0:
            self.stats.prompt_tokens += num_prompt_tokens

    def _count_finished(self, reason: str) -> None:
        self.stats.finished_by_reason[reason] = self.stats.finished_by_reason.get(reason, 0) + 1

    def _refresh_stats(self) -> None:
        engine_stats = self.engine.get_stats()
        stats = self.stats
        stats.prefix_cache_queries = engine_stats.prefix_cache_queries
        stats.prefix_cache_hits = engine_stats.prefix_cache_hits
        external = engine_stats.scheduler_stats.connector_prefix_cache_stats
        if external is not None:
            stats.external_prefix_cache_queries = external.queries
            stats.external_prefix_cache_hits = external.hits
        stats.num_running = engine_stats.num_running
        stats.num_waiting = engine_stats.num_waiting
        stats.num_preemptions = engine_stats.num_preemptions
        stats.num_blocks = engine_stats.num_blocks
        stats.num_blocks_in_use = engine_stats.num_blocks_in_use
