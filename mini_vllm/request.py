"""A request as the scheduler and the KV-cache manager see it (chapters 04, 08).

A ``Request`` holds everything kept about one sequence while it is served:
its token ids (prompt + generated), how many of them have K/V in the cache
(``num_computed_tokens``), one hash per *full* block of its tokens
(``block_hashes``), and the engine's bookkeeping (metrics, random generator).
The hashes are kept current as tokens are appended: a block is hashed once,
in the call that fills it.

Who changes which field (every other module only reads them):

* fixed at construction: ``request_id``, ``prompt``, ``prompt_token_ids``,
  ``sampling_params``, ``cache_salt``, ``block_size``, ``arrival_time``;
* the ``Request`` itself: ``block_hashes`` (in ``append_output_token_ids``);
* the scheduler (``scheduler.py``): ``status``, ``num_computed_tokens``,
  ``num_cached_tokens``, ``num_preemptions`` (code that admits prompts
  without a scheduler, as the chapters and the router do, calls
  ``schedule_whole_prompt`` there, or sets them as the scheduler would);
* the engine (``llm_engine.py``, ``output_processor.py``): the generated
  tokens (``append_output_token_ids``), ``metrics``, ``generator``,
  ``detokenizer`` (which owns the output text) and ``stop_reason``.

vLLM equivalent: ``vllm/v1/request.py`` (``Request``, ``RequestStatus``).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .config import DEFAULT_BLOCK_SIZE, check_block_size
from .hashing import BlockHash, BlockHasher, make_block_hasher

if TYPE_CHECKING:
    import torch

    from .detokenizer import IncrementalDetokenizer
    from .outputs import Logprob, RequestMetrics
    from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop string
    FINISHED_LENGTH_CAPPED = "finished_length_capped"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # its step failed, or processing its output raised

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason: "stop", "length", "abort", "error", or None while running."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class Request:
    """One sequence being generated.

    Holds its token ids, ``num_computed_tokens`` (advanced by the scheduler,
    reset to 0 on preemption), ``block_hashes``, its status and the engine's
    ``metrics`` and ``generator``; the module docstring says who changes which.
    The engine keeps every request it serves in one dict, ``LLMEngine.requests``,
    and forgets it in one place (``LLMEngine._finish``).

    Invariants: ``len(block_hashes) == num_tokens // block_size``;
    ``0 <= num_computed_tokens <= num_tokens``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_size: int = DEFAULT_BLOCK_SIZE,
        cache_salt: str | None = None,
        sampling_params: SamplingParams | None = None,
        hash_algo: str = "sha256",
        arrival_time: float | None = None,
        prompt: Any = None,
        block_hasher: BlockHasher | None = None,
    ) -> None:
        """``block_hasher``: what hashes the blocks its tokens fill (``hashing.make_block_hasher``;
        by default ``hash_algo``'s reference). The engine passes the one of its ``EngineParts``."""
        check_block_size(block_size)
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING

        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (-1 = not yet).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # The engine's, set when it queues the request (None for a request built without one).
        self.metrics: RequestMetrics | None = None
        self.generator: torch.Generator | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        # What stopped it, as vLLM reports: a stop token's id or a stop string (None for EOS, length, ...).
        self.stop_reason: int | str | None = None
        # With SamplingParams(logprobs=k): each generated token's {token id: Logprob} (the engine appends them).
        wants_logprobs = sampling_params is not None and sampling_params.logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if wants_logprobs else None

        self._block_hasher = make_block_hasher(hash_algo) if block_hasher is None else block_hasher
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    # -- tokens ---------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (do not mutate: use append_output_token_ids)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated token(s); a block they fill gets its hash now."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        # Only blocks that became full since the last call are hashed.
        if self.num_tokens // self.block_size > len(self.block_hashes):
            self.block_hashes.extend(
                self._block_hasher(self._all_token_ids, self.block_size, self.block_hashes, self.cache_salt)
            )

    # -- status ---------------------------------------------------------------
    def is_finished(self) -> bool:
        return self.status.is_finished

    def get_finished_reason(self) -> str | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )
