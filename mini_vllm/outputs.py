"""What ``LLM.generate`` returns (chapter 08).

vLLM equivalent: ``vllm/outputs.py`` (``RequestOutput``, ``CompletionOutput``).
``num_cached_tokens`` is what hosted APIs call ``cached_tokens``: prompt tokens
whose K/V came from the prefix cache instead of being computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``vllm.logprobs.Logprob``)."""

    logprob: float
    rank: int | None = None  # 1: the most likely token at that position
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error" (its step failed: see LLMEngine.step)
    stop_reason: str | None = None  # the stop string that ended it (vLLM: also a stop token id); None otherwise
    # With SamplingParams(logprobs=k), as vLLM's: the sum of the generated tokens' log-probabilities, and for
    # each generated token {token id: Logprob} of that token and the k most likely (k + 1 entries, or k
    # when the generated token is among them). None without logprobs.
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestMetrics:
    """Timings of one request (seconds on ``time.monotonic``'s clock, and engine steps)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    arrival_step: int = 0
    first_token_step: int | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def steps_to_first_token(self) -> int | None:
        """Engine steps from arrival to the first token (1 = prefilled in one step)."""
        if self.first_token_step is None:
            return None
        return self.first_token_step - self.arrival_step


@dataclass
class RequestOutput:
    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics | None = None
    # Each completion's own metrics, in completion order (``metrics`` is the first's; they differ for n > 1).
    per_completion_metrics: list[RequestMetrics] = field(default_factory=list, repr=False)

    @property
    def finished(self) -> bool:
        """Every completion has ended (vLLM's ``RequestOutput.finished``)."""
        return all(completion.finish_reason is not None for completion in self.outputs)
