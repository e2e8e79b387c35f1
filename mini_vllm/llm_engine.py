"""The engine loop: add requests, step, collect outputs (chapter 08).

One ``step()`` is: the scheduler picks the batch (and talks to the
KV-cache manager), the model runner computes it, the sampler picks one token
for each request that finished its prefill, and finished requests free their
blocks. Listeners (widgets, tests) receive an event for every change.

vLLM equivalent: ``vllm/v1/engine/llm_engine.py`` and ``core.py``
(``EngineCore.step``).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers import AutoTokenizer

from .attention import get_attn_backend
from .config import EngineConfig
from .events import EventBus, Listener, RequestAdded, RequestFinished, StepFinished
from .kv_cache_manager import KVCacheManager, cdiv
from .model import ModelConfig, default_model_path, load_model
from .model_runner import ModelRunner, kv_cache_bytes_per_block
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .request import Request, RequestStatus
from .sampler import make_generator, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler

logger = logging.getLogger("mini_vllm")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineStats:
    """Engine-wide counters (vLLM: ``vllm:prefix_cache_*``, ``vllm:num_preemptions``, ``vllm:kv_cache_usage_perc``)."""

    num_steps: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    hit_rate: float
    num_preemptions: int
    num_evictions: int
    num_blocks: int
    num_blocks_in_use: int
    num_running: int
    num_waiting: int


def find_stop_string(text: str, stop_strings: list[str]) -> Optional[int]:
    """Where the first stop string starts in ``text``, or None."""
    positions = [text.find(stop) for stop in stop_strings]
    positions = [p for p in positions if p >= 0]
    return min(positions) if positions else None


class LLMEngine:
    """Owns the tokenizer, the scheduler (and through it the KV-cache manager) and the model runner."""

    def __init__(self, model: Optional[str] = None, config: Optional[EngineConfig] = None) -> None:
        self.config = config = config or EngineConfig()
        self.model_path = os.path.expanduser(str(model)) if model is not None else default_model_path()
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.dtype = self._resolve_dtype(config.dtype)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_token_ids = self._eos_token_ids()

        attn_backend = get_attn_backend(config.attention_backend, str(self.device))
        llm = load_model(self.model_path, device=self.device, dtype=self.dtype, attn_backend=attn_backend)
        num_blocks = config.num_blocks or self._num_blocks_from_budget()
        self.model_runner = ModelRunner(llm, num_blocks, config.block_size, self.device, self.dtype)
        self.events = EventBus()
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens, self.events)
        self.requests: dict[str, Request] = {}
        self.metrics: dict[str, RequestMetrics] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.num_steps = 0
        self._request_counter = itertools.count()
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB) on %s, attention backend %r",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            num_blocks * kv_cache_bytes_per_block(self.model_config, config.block_size, self.dtype) / 2**20,
            self.device,
            attn_backend.name,
        )

    # -- set-up helpers ---------------------------------------------------------
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

    def _num_blocks_from_budget(self) -> int:
        bytes_per_block = kv_cache_bytes_per_block(self.model_config, self.config.block_size, self.dtype)
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
        self.kv_cache_manager.block_pool.enable_kv_cache_events = True

    def remove_listener(self, listener: Listener) -> None:
        self.events.remove(listener)
        if not self.events.active:
            self.kv_cache_manager.block_pool.enable_kv_cache_events = False
            self.kv_cache_manager.take_events()

    # -- requests ---------------------------------------------------------------
    def validate_request(
        self, prompt_token_ids: Any, sampling_params: SamplingParams, cache_salt: Optional[str] = None
    ) -> list[int]:
        """Check a request before anything is allocated; ValueError says what is wrong."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab_size = self.model_config.vocab_size
        for token_id in prompt_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"token id {token_id!r} is outside the vocabulary (valid ids: 0..{vocab_size - 1})"
                )
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, longer than max_model_len={self.max_model_len}"
            )
        longest = min(len(prompt_token_ids) + sampling_params.max_tokens, self.max_model_len + 1)
        needed_blocks = cdiv(longest, self.config.block_size)
        if needed_blocks > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling_params.max_tokens}) needs "
                f"{needed_blocks} KV-cache blocks, but the pool has only {self.kv_cache_manager.num_blocks}"
            )
        return list(prompt_token_ids)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        cache_salt: Optional[str] = None,
        prompt: Any = None,
    ) -> Request:
        """Queue a request (validated first: a bad one raises and leaves the engine untouched)."""
        sampling_params = sampling_params or SamplingParams()
        self.check_request_id(request_id)
        prompt_token_ids = self.validate_request(prompt_token_ids, sampling_params, cache_salt)
        return self.add_validated_request(request_id, prompt_token_ids, sampling_params, cache_salt, prompt)

    def check_request_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def add_validated_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: Optional[str] = None,
        prompt: Any = None,
    ) -> Request:
        """Queue a request that ``check_request_id`` and ``validate_request`` accepted.

        ``LLM.generate`` validates a whole batch before queueing any of it, so
        that one bad prompt leaves the engine untouched; it then comes here.
        """
        request = Request(
            request_id,
            prompt_token_ids,
            block_size=self.config.block_size,
            cache_salt=cache_salt,
            sampling_params=sampling_params,
            hash_algo=self.config.hash_algo,
            prompt=prompt,
        )
        seed = sampling_params.seed
        if seed is None:
            seed = self.config.seed * 1_000_003 + next(self._request_counter)
        self.generators[request_id] = make_generator(seed)
        self.requests[request_id] = request
        self.metrics[request_id] = RequestMetrics(arrival_time=request.arrival_time, arrival_step=self.num_steps)
        self.scheduler.add_request(request)
        if self.events.active:
            self.events.emit(RequestAdded(request_id, request.num_prompt_tokens))
        return request

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (unknown ids are ignored)."""
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished():
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample; returns the requests that finished in this step."""
        self.num_steps += 1
        scheduler_output = self.scheduler.schedule()
        logits = self.model_runner.execute_model(scheduler_output)
        now = time.monotonic()
        finished: list[RequestOutput] = []
        for row, scheduled in enumerate(scheduler_output.scheduled):
            request = scheduled.request
            metrics = self.metrics[request.request_id]
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if not scheduled.completes_prefill:
                continue  # a prefill chunk: its last token's logits predict nothing we need yet
            params = request.sampling_params
            token_id = sample(logits[row], params, self.generators[request.request_id])
            request.append_output_token_ids(token_id)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.first_token_step = self.num_steps
            status = self._check_stop(request)
            if status is not None:
                finished.append(self._finish(request, status))
        if self.events.active:
            self.events.emit(
                StepFinished(
                    self.num_steps,
                    tuple((s.request.request_id, s.num_new_tokens) for s in scheduler_output.scheduled),
                    len(self.scheduler.running),
                    len(self.scheduler.waiting),
                )
            )
        return finished

    def _check_stop(self, request: Request) -> Optional[RequestStatus]:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_strings:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            if find_stop_string(text, params.stop_strings) is not None:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens > self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> RequestOutput:
        self.scheduler.finish_request(request, status)
        metrics = self.metrics[request.request_id]
        metrics.finished_time = time.monotonic()
        metrics.num_preemptions = request.num_preemptions
        if self.events.active:
            self.events.emit(RequestFinished(request.request_id, status.finish_reason or ""))
        output = self._make_output(request)
        del self.requests[request.request_id]
        del self.generators[request.request_id]
        del self.metrics[request.request_id]
        return output

    def _make_output(self, request: Request) -> RequestOutput:
        token_ids = list(request.output_token_ids)
        if token_ids and not request.sampling_params.ignore_eos and token_ids[-1] in self.eos_token_ids:
            token_ids_for_text = token_ids[:-1]
        else:
            token_ids_for_text = token_ids
        text = self.tokenizer.decode(token_ids_for_text, skip_special_tokens=True)
        cut = find_stop_string(text, request.sampling_params.stop_strings)
        if cut is not None:
            text = text[:cut]
        completion = CompletionOutput(0, text, token_ids, request.get_finished_reason())
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics=self.metrics[request.request_id],
        )

    # -- inspection -------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        stats = self.kv_cache_manager.prefix_cache_stats
        return EngineStats(
            num_steps=self.num_steps,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            hit_rate=stats.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_evictions=self.kv_cache_manager.block_pool.num_evictions,
            num_blocks=self.kv_cache_manager.num_blocks,
            num_blocks_in_use=self.kv_cache_manager.num_blocks - self.kv_cache_manager.get_num_free_blocks(),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
