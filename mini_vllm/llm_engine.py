"""The engine loop: add requests, step, collect outputs (chapter 08).

One ``step()`` is: the scheduler picks the batch (and talks to the
KV-cache manager), the model runner computes it, the sampler picks one token
for each request whose last token was computed (``ScheduledRequest.samples_token``:
every decode step, and a prefill's last chunk), and finished requests free their
blocks. Listeners (widgets, tests) receive an event for every change.

vLLM equivalent: ``vllm/v1/engine/llm_engine.py`` and ``core.py``
(``EngineCore.step``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .attention import get_attn_backend
from .block_pool import BlockPool
from .config import EngineConfig, check_device_name
from .detokenizer import find_stop_string, stop_string_window  # noqa: F401  (tests/engine/test_engine.py's names)
from .engine_parts import EngineParts
from .engine_stats import EngineStats
from .events import EventBus, Listener, RequestAdded, RequestFinished, StepFinished
from .input_processor import (
    InputProcessor,
    load_tokenizer,
    sampling_params_per_prompt,
    validated_sampling_params,
    type_name,
)
from .interrupts import keyboard_interrupts_deferred
from .kv_cache_interface import make_kv_cache_config, max_blocks_per_request
from .kv_cache_manager import KVCacheManager, cdiv
from .kv_offload.connector import OffloadingConnector
from .kv_offload.cpu_manager import CPUOffloadingManager
from .kv_offload.spec import eviction_policy, fs_tier_settings
from .kv_offload.tiering import make_fs_tiering_manager
from .model import default_model_path, load_model
from .model_config import ModelConfig
from .model_runner import ModelRunner, kv_cache_bytes_per_block
from .output_processor import OutputProcessor
from .outputs import RequestMetrics, RequestOutput
from .parallel_sampling import ParentRequest, parent_id_of
from .request import Request, RequestStatus
from .sampler import make_generator, sample, token_logprobs
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger("mini_vllm")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# The device types the engine runs on (its kernels, memory budget and dtypes know these two).
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else the CPU; ValueError for a GPU that is not there.

    ``device`` is any name ``EngineConfig`` accepted (every ``torch.device``
    string); a valid device the engine cannot run on ("meta", "mps", ...) is a
    ValueError naming it.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device_name(device)
    resolved = torch.device(device)
    if resolved.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"device={device!r} is a torch device, but mini-vLLM runs only on "
            f"{' or '.join(SUPPORTED_DEVICE_TYPES)} devices: use device='cpu', 'cuda' or 'auto'"
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but CUDA is not available here: use device='cpu' or 'auto'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return resolved


def ids_of(parent: ParentRequest) -> list[str]:
    """The request ids a prompt takes: its completions' and, with ``n > 1``, its own."""
    return parent.child_request_ids if parent.n == 1 else [*parent.child_request_ids, parent.request_id]


class LLMEngine:
    """Owns the tokenizer, the scheduler (and through it the KV-cache manager) and the model runner.

    The engine talks only to the scheduler; the scheduler talks to the
    KV-cache manager, the manager to the block pool. Every request the engine
    serves is in ``requests`` (its metrics and random generator ride on the
    ``Request``), from ``add_validated_request`` until ``_finish`` removes it.

    ``parts`` (an ``EngineParts``, ``mini_vllm/engine_parts.py``): the pieces
    this engine runs; each goes to the object that owns it as that object is
    built here (the defaults are the engine's own implementations, and take
    the same way). Kept as ``self.parts``.
    """

    def __init__(
        self, model: str | None = None, config: EngineConfig | None = None, parts: EngineParts | None = None
    ) -> None:
        if parts is None:
            parts = EngineParts()
        elif not isinstance(parts, EngineParts):
            raise TypeError(f"parts must be an EngineParts, got {type(parts).__name__}")
        self.parts = parts
        self.config = config = config or EngineConfig()
        self.model_path = os.path.expanduser(str(model)) if model is not None else default_model_path()
        self.device = resolve_device(config.device)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.dtype = self._resolve_dtype(config.dtype)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(  # as vLLM's ModelConfig: a longer context would run past the trained positions
                f"max_model_len={config.max_model_len} is longer than this model's {limit} positions "
                f"(max_position_embeddings in {self.model_path}/config.json): use max_model_len <= {limit}"
            )
        self.max_model_len = config.max_model_len or limit
        self.tokenizer = load_tokenizer(self.model_path)
        self.output_processor = OutputProcessor(self.tokenizer, self._eos_token_ids(), self.max_model_len)

        self.block_hasher = parts.block_hasher(config.hash_algo)  # every Request hashes its blocks with it
        if parts.store_kv is not None or parts.paged_decode is not None:
            from .attention.torch_backend import PartsAttentionBackend

            attn_backend = PartsAttentionBackend(parts.store_kv, parts.paged_decode)
        else:
            attn_backend = get_attn_backend(config.attention_backend, str(self.device))
        model = load_model(self.model_path, device=self.device, dtype=self.dtype, attn_backend=attn_backend)
        num_blocks = config.num_blocks or self._num_blocks_from_budget()
        # One KV-cache group of every layer, or a hybrid model's groups (chapter 08b).
        self.kv_cache_config = make_kv_cache_config(
            self.model_config.layer_sliding_windows,
            config.block_size,
            num_blocks,
            disable_hybrid_kv_cache_manager=config.disable_hybrid_kv_cache_manager,
        )
        self.model_runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            self.device,
            self.dtype,
            slot_mapping=parts.slot_mapping,
            kv_cache_config=self.kv_cache_config,
        )
        self.events = EventBus()
        block_pool = BlockPool(
            num_blocks,
            config.enable_prefix_caching,
            free_queue=parts.free_queue,
            get_new_blocks=parts.get_new_blocks,
            free_blocks=parts.free_blocks,
        )
        kv_cache_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            kv_cache_config=self.kv_cache_config,
            block_pool=block_pool,
            find_longest_cache_hit=parts.find_longest_cache_hit,
            free_request_blocks=parts.free_request_blocks,
            find_sliding_window_cache_hit=parts.find_sliding_window_cache_hit,
            prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        )
        connector = self._make_offloading_connector() if config.kv_offloading_size is not None else None
        self.model_runner.kv_connector = connector
        self.scheduler = Scheduler(
            kv_cache_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.events,
            schedule_waiting=parts.schedule_waiting,
            connector=connector,
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.model_config.vocab_size,
            self.max_model_len,
            config.block_size,
            num_blocks,
            blocks_needed=functools.partial(
                max_blocks_per_request, self.kv_cache_config, max_num_batched_tokens=config.max_num_batched_tokens
            ),
        )
        self.requests: dict[str, Request] = {}  # queued and not finished, by id: the engine's per-request state
        # An n > 1 prompt's completion ids by the prompt's id, while any of them is unfinished, so that
        # abort_request takes the prompt's id, as vLLM's does (_finish drops it with the last completion).
        self.parent_requests: dict[str, list[str]] = {}
        self.num_steps = 0
        self._request_counter = itertools.count()
        self._batch_counter = itertools.count()  # add_requests' automatic ids: "{batch}-{index}"
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB) on %s, attention backend %r",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            num_blocks * self._bytes_per_block() / 2**20,
            self.device,
            attn_backend.name,
        )

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        """The scheduler's KV-cache manager, for widgets and notebooks to read; the engine goes through the scheduler."""
        return self.scheduler.kv_cache_manager

    # -- set-up helpers ---------------------------------------------------------
    def _make_offloading_connector(self) -> OffloadingConnector:
        """The CPU tier of ``kv_offloading_size`` GiB: as many chunks of one pool block as fit."""
        config = self.config
        policy = eviction_policy(config.kv_transfer_config)  # "lru" unless kv_connector_extra_config says "arc"
        unusable = self.parts.unusable_with_offloading(policy)
        if unusable:  # e.g. another schedule_waiting would never read the tier: every prefix silently recomputed
            raise ValueError(
                "kv_offloading_size: this engine's parts replace "
                + "; ".join(f"EngineParts.{name} ({why})" for name, why in unusable.items())
                + ": build the engine without them, or without the tier"
            )
        if len(self.kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(
                "kv_offloading_size: KV-cache offloading is built for one KV-cache group, not a hybrid model"
            )
        bytes_per_block = self._bytes_per_block()
        num_chunks = int(config.kv_offloading_size * 2**30) // bytes_per_block
        if num_chunks < 1:
            raise ValueError(
                f"kv_offloading_size={config.kv_offloading_size} GiB holds no block of this model "
                f"({bytes_per_block} bytes): use at least {bytes_per_block / 2**30:.2g}"
            )
        manager = CPUOffloadingManager(num_chunks, cache_policy=policy, lru_evict=self.parts.lru_evict)
        fs_tier = fs_tier_settings(config.kv_transfer_config)  # secondary_tiers: [{"type": "fs", ...}]
        if fs_tier is not None:
            layer_ids = self.kv_cache_config.kv_cache_groups[0].layer_ids
            manager = make_fs_tiering_manager(
                manager, self.model_path, config.block_size, self.dtype, layer_ids, **fs_tier
            )
        connector = OffloadingConnector(manager, config.block_size)
        connector.register_kv_caches(self.model_runner.kv_caches)
        return connector

    def _resolve_dtype(self, name: str) -> torch.dtype:
        if name != "auto":
            return DTYPES[name]
        if self.device.type == "cpu":
            return torch.float32
        return DTYPES.get(self.model_config.torch_dtype, torch.bfloat16)

    def _eos_token_ids(self) -> set[int]:
        ids = self.model_config.eos_token_id
        eos = set(ids) if isinstance(ids, list) else ({ids} if ids is not None else set())
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    def _bytes_per_block(self) -> int:
        """One block's K and V: one KV-cache group's layers, or every layer with the hybrid manager off."""
        config = self.config
        return kv_cache_bytes_per_block(
            self.model_config, config.block_size, self.dtype, config.disable_hybrid_kv_cache_manager
        )

    def _num_blocks_from_budget(self) -> int:
        bytes_per_block = self._bytes_per_block()
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = 0.9 * free
        else:
            budget = 0.25 * 2**30
        # Never more than every sequence at full length needs.
        most_useful = self.config.max_num_seqs * cdiv(self.max_model_len, self.config.block_size)
        return max(1, min(int(budget // bytes_per_block), most_useful))

    # -- listeners --------------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """Receive every engine event; turns on the block pool's event recording."""
        self.events.add(listener)
        self.scheduler.set_kv_cache_events(True)

    def remove_listener(self, listener: Listener) -> None:
        self.events.remove(listener)
        if not self.events.active:
            self.scheduler.set_kv_cache_events(False)

    # -- requests ---------------------------------------------------------------
    # Every way in (LLM.generate, LLM.chat, add_request, add_requests, the
    # dashboard) goes through the InputProcessor (input_processor.py) before
    # anything is queued or allocated: bad input raises ValueError (TypeError
    # for a wrong type) naming the field and the value, and changes nothing.

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
        prompt: Any = None,
    ) -> Request:
        """Queue one sequence (validated first: a bad one raises and leaves the engine untouched).

        ``n > 1`` needs one request per completion: use ``add_requests``. The
        request keeps its own checked copy of ``sampling_params``
        (``validated_sampling_params``): changing the object later changes
        nothing queued.
        """
        self.check_request_id(request_id)
        sampling_params = SamplingParams() if sampling_params is None else validated_sampling_params(sampling_params)
        prompt_token_ids = self.input_processor.validate_request(prompt_token_ids, sampling_params, cache_salt)
        if sampling_params.n != 1:
            raise ValueError(
                f"add_request queues one sequence, but n={sampling_params.n}: use add_requests, "
                "which queues one request per completion"
            )
        return self.add_validated_request(request_id, prompt_token_ids, sampling_params, cache_salt, prompt)

    def add_requests(
        self,
        prompts: Any,
        sampling_params: Any = None,
        request_ids: Sequence[str] | None = None,
    ) -> dict[str, list[str]]:
        """Validate a whole batch, then queue all of it; returns ``{prompt's id: its completions' ids}``.

        ``add_parent_requests`` does the work (its docstring says what is
        accepted and checked); this returns each ``ParentRequest``'s
        ``child_request_ids`` by prompt id, in prompt order.
        """
        parents = self.add_parent_requests(prompts, sampling_params, request_ids)
        return {parent.request_id: parent.child_request_ids for parent in parents}

    def add_parent_requests(
        self,
        prompts: Any,
        sampling_params: Any = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[ParentRequest]:
        """Validate a whole batch, then queue all of it; returns one ``ParentRequest`` per prompt, in order.

        ``prompts``: one prompt or a list (see ``InputProcessor.process_prompt``);
        ``sampling_params``: None, one ``SamplingParams`` or one per prompt;
        ``request_ids``: one id per prompt, or None for ids ``"{batch}-{index}"``
        that are not in use. Each prompt's ``ParentRequest``
        (``parallel_sampling.py``) names its requests: with ``n > 1``, ``n``
        requests ``"{id}-{k}"``, which share its blocks through the prefix
        cache; with a seed, completion ``k`` samples with ``seed + k`` (as
        vLLM's ``ParentRequest`` does), so the completions differ and are
        reproducible. The engine owns those requests; the ``ParentRequest``
        only names them and merges their outputs (``ParentRequest.merge``).

        Nothing is queued unless everything is valid: in a batch of several, an
        error names the prompt by its index. The requests keep the engine's own checked copies of
        ``sampling_params`` (``validated_sampling_params``), so a field changed
        after construction is checked here and a change after this call
        reaches no queued request.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (list, tuple)):
            prompts = list(prompts)
        else:
            raise TypeError(
                f"prompts must be a str, a dict or a list of them, got {type_name(prompts)}"
                " (token ids go in as {'prompt_token_ids': [...]})"
            )
        params_list = sampling_params_per_prompt(sampling_params, len(prompts))
        inputs = []
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                token_ids, cache_salt, shown = self.input_processor.process_prompt(prompt)
                token_ids = self.input_processor.validate_request(token_ids, params, cache_salt)
            except (ValueError, TypeError) as error:
                if len(prompts) == 1:
                    raise
                raise type(error)(f"prompt {index}: {error}") from None
            inputs.append((token_ids, cache_salt, shown))

        if request_ids is None:
            while True:  # skip batch numbers whose ids someone already uses
                batch = next(self._batch_counter)
                parents = [ParentRequest(f"{batch}-{index}", params) for index, params in enumerate(params_list)]
                if not any(self.request_id_in_use(request_id) for parent in parents for request_id in ids_of(parent)):
                    break
        else:
            request_ids = list(request_ids)
            if len(request_ids) != len(prompts):
                raise ValueError(f"got {len(request_ids)} request_ids for {len(prompts)} prompts")
            parents = [ParentRequest(request_id, params) for request_id, params in zip(request_ids, params_list)]
            all_ids = [request_id for parent in parents for request_id in ids_of(parent)]
            for request_id in all_ids:
                self.check_request_id(request_id)
            if len(set(all_ids)) != len(all_ids):
                raise ValueError(f"request ids repeat within the batch: {all_ids}")

        queued: list[str] = []
        try:
            with keyboard_interrupts_deferred():  # all of the batch or none of it
                for parent, (token_ids, cache_salt, shown) in zip(parents, inputs):
                    for index in range(parent.n):
                        request_id, child_params = parent.get_child_info(index)
                        self.add_validated_request(request_id, list(token_ids), child_params, cache_salt, shown)
                        queued.append(request_id)
                    if parent.n > 1:
                        self.parent_requests[parent.request_id] = parent.child_request_ids
        except BaseException:
            for request_id in queued:
                self.abort_request(request_id)
            raise
        return parents

    def request_id_in_use(self, request_id: str) -> bool:
        """A queued request's id, or the id of an ``n > 1`` prompt with a completion unfinished
        (``abort_request`` takes both, so a new request must not reuse either)."""
        return request_id in self.requests or request_id in self.parent_requests

    def check_request_id(self, request_id: str) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type_name(request_id)} {request_id!r:.40}")
        if self.request_id_in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")

    def add_validated_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        prompt: Any = None,
    ) -> Request:
        """Queue one sequence that ``check_request_id`` and ``InputProcessor.validate_request`` accepted."""
        with keyboard_interrupts_deferred():  # registered everywhere or nowhere
            request = Request(
                request_id,
                prompt_token_ids,
                block_size=self.config.block_size,
                cache_salt=cache_salt,
                sampling_params=sampling_params,
                hash_algo=self.config.hash_algo,
                prompt=prompt,
                block_hasher=self.block_hasher,
            )
            seed = sampling_params.seed
            if seed is None:
                seed = self.config.seed * 1_000_003 + next(self._request_counter)
            request.generator = make_generator(seed)
            request.metrics = RequestMetrics(arrival_time=request.arrival_time, arrival_step=self.num_steps)
            self.output_processor.add_request(request)
            self.requests[request_id] = request
            self.scheduler.add_request(request)
            if self.events.active:
                self.events.emit(RequestAdded(request_id, request.num_prompt_tokens))
        return request

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks: one id or several, as vLLM's ``abort_request``.

        The id of an ``n > 1`` prompt stops all its completions; ids of requests
        that are unknown or already finished are ignored.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif not isinstance(request_ids, Iterable):
            raise TypeError(f"request_ids must be a str or an iterable of str, got {type_name(request_ids)}")
        request_ids = list(request_ids)
        if not all(isinstance(request_id, str) for request_id in request_ids):
            raise TypeError(f"request_ids must be a str or an iterable of str, got {request_ids!r:.80}")
        for request_id in request_ids:
            if request_id not in self.requests:
                for child_id in self.parent_requests.pop(request_id, ()):
                    self.abort_request(child_id)
                continue
            request = self.requests[request_id]
            if not request.is_finished():
                with keyboard_interrupts_deferred():
                    self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample; returns the requests that finished in this step.

        A step is all or nothing for the prefix cache. Blocks are cached at
        schedule time, before the forward pass writes their K/V; if the
        forward pass raises, ``_recover_from_failed_step`` takes them back out
        of the cache before anything can hit them. The scheduling and the
        bookkeeping after the model ran hold back a Ctrl-C until they are done
        (``keyboard_interrupts_deferred``), so it lands in the forward pass or
        between steps, never in the middle of an update.
        """
        scheduler_output = None
        try:
            with keyboard_interrupts_deferred():
                self.num_steps += 1
                scheduler_output = self.scheduler.schedule()  # 1. schedule
            logits = self.model_runner.execute_model(scheduler_output)  # 2. run the model
        except BaseException as error:
            if scheduler_output is None:  # scheduling itself failed (a bug); the scheduler kept the cache clean
                raise
            return self._recover_from_failed_step(scheduler_output, error)
        with keyboard_interrupts_deferred():
            return self._update_from_output(scheduler_output, logits)  # 3. sample, 4. update

    def _update_from_output(
        self, scheduler_output: SchedulerOutput, logits: torch.Tensor | None
    ) -> list[RequestOutput]:
        """Sample a token for every request that completed its prefill, check stop conditions.

        A request whose own processing raises (a bug in sampling, a stop
        check) finishes with ``finish_reason="error"``; the others go on.
        """
        now = time.monotonic()
        finished: list[RequestOutput] = []
        for row, scheduled in enumerate(scheduler_output.scheduled):
            request = scheduled.request
            metrics = request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if not scheduled.samples_token:
                continue  # a prefill chunk: its last token's logits predict nothing we need yet
            try:
                token_id = sample(logits[row], request.sampling_params, request.generator)
                if request.logprobs is not None:
                    request.logprobs.append(token_logprobs(logits[row], token_id, request.sampling_params.logprobs))
                request.append_output_token_ids(token_id)
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                    metrics.first_token_step = self.num_steps
                status = self.output_processor.check_stop(request)
            except Exception:
                logger.exception(
                    "request %r failed after its forward pass; it finishes with an error", request.request_id
                )
                status = RequestStatus.FINISHED_ERROR
            if status is not None:
                finished.append(self._finish(request, status))
        if self.events.active:
            self.scheduler.emit_kv_cache_events()  # what the step stored in the offloading tier, or evicted there
            self.events.emit(
                StepFinished(
                    self.num_steps,
                    tuple((s.request.request_id, s.num_new_tokens) for s in scheduler_output.scheduled),
                    len(self.scheduler.running),
                    len(self.scheduler.waiting),
                )
            )
        return finished

    def _recover_from_failed_step(self, scheduler_output: SchedulerOutput, error: BaseException) -> list[RequestOutput]:
        """Undo a step whose forward pass raised ``error``; the engine keeps serving.

        The blocks cached while scheduling it leave the cache first (their K/V
        were not written), then every request of the step gives back its blocks
        (``Scheduler.undo_failed_step``). What happens to those requests:

        * an ``Exception`` (a bug, out of memory, ...): they finish with
          ``finish_reason="error"`` and are returned; retrying would most
          likely fail the same way. Requests not in the step are untouched.
        * a ``KeyboardInterrupt`` (Ctrl-C) or another ``BaseException``: they
          go back to the waiting queue, to be recomputed from scratch by a
          later ``step()``, and the interrupt is raised again.

        vLLM differs: an exception in its forward pass stops the engine core
        (``EngineDeadError``), and the server must be restarted.
        """
        with keyboard_interrupts_deferred():
            requeue = not isinstance(error, Exception)
            self.scheduler.undo_failed_step(scheduler_output, requeue=requeue)
            if requeue:
                logger.warning(
                    "step %d interrupted (%s): its requests will be recomputed", self.num_steps, type(error).__name__
                )
                finished = []
            else:
                logger.error(
                    "step %d failed: %s: %s; its %d request(s) finish with an error",
                    self.num_steps,
                    type(error).__name__,
                    error,
                    len(scheduler_output.scheduled),
                    exc_info=error,
                )
                finished = [self._finish(s.request, RequestStatus.FINISHED_ERROR) for s in scheduler_output.scheduled]
        if requeue:
            raise error
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> RequestOutput:
        """Free the request's blocks, build its output, and forget it: the one place a request leaves the engine."""
        self.scheduler.finish_request(request, status)
        metrics = request.metrics
        metrics.finished_time = time.monotonic()
        metrics.num_preemptions = request.num_preemptions
        if self.events.active:
            self.events.emit(RequestFinished(request.request_id, status.finish_reason or ""))
        output = self.output_processor.make_request_output(request)
        del self.requests[request.request_id]
        parent_id = parent_id_of(request.request_id)
        siblings = self.parent_requests.get(parent_id, ())
        if request.request_id in siblings and not any(child_id in self.requests for child_id in siblings):
            del self.parent_requests[parent_id]
        return output

    # -- inspection -------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        """The engine's step count and the scheduler's counters (``Scheduler.make_stats``, a copy)."""
        return EngineStats(num_steps=self.num_steps, scheduler_stats=self.scheduler.make_stats())

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (False while a request holds blocks, unless ``reset_running_requests``
        preempts the running ones first): ``Scheduler.reset_prefix_cache``."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)
