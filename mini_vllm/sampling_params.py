"""How to pick the next token, and when to stop (chapter 08).

vLLM equivalent: ``vllm/sampling_params.py`` (``SamplingParams``); the fields
here keep vLLM's names and meanings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one prompt.

    Attributes:
        n: completions per prompt. Each runs as its own request; they share the
            prompt's KV blocks through the prefix cache.
        temperature: 0 means greedy (argmax); higher flattens the distribution.
        top_p: keep the smallest set of tokens whose probability reaches top_p.
        top_k: keep the k most likely tokens (-1: all).
        max_tokens: at most this many generated tokens.
        seed: makes sampling reproducible per request, whatever else is batched.
        stop: strings that end the completion (not included in its text).
        ignore_eos: keep generating past the end-of-sequence token.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    ignore_eos: bool = False
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
