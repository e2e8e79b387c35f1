"""How to pick the next token, and when to stop (chapter 08).

vLLM equivalent: ``vllm/sampling_params.py`` (``SamplingParams``); the fields
here keep vLLM's names and meanings.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

logger = logging.getLogger("mini_vllm")

# Limits a server would have (README, "Bad input"). vLLM allows n up to
# VLLM_MAX_N_SEQUENCES (16384 by default); each completion here is a whole
# request, so a smaller bound keeps one call from queueing millions of them.
MAX_N = 256
# vLLM 0.33 refuses temperatures above 2 and raises those below 0.01 to 0.01.
MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 0.01
# vLLM's default --max-logprobs: the most top tokens a request may ask for at each position.
MAX_LOGPROBS = 20
# What torch.Generator.manual_seed accepts.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


# vLLM's SamplingParams settings this engine does not implement, with the value that asks for nothing
# (vLLM's default). That value is accepted and changes nothing, as the server accepts it; any other
# is a ValueError that says so, not Python's "unexpected keyword argument".
VLLM_NOT_IMPLEMENTED: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "prompt_logprobs": None,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "detokenize": True,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "structured_outputs": None,
}


def _check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r:.80}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value!r}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r:.80}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one prompt.

    Attributes:
        n: completions per prompt, 1..MAX_N (256). Each runs as its own
            request; they share the prompt's KV blocks through the prefix cache.
        temperature: 0 means greedy (argmax); higher flattens the distribution.
            At most 2; values in (0, 0.01) are raised to 0.01 (as in vLLM).
        top_p: keep the smallest set of tokens whose probability reaches top_p.
        top_k: keep the k most likely tokens (0 or -1: all, as in vLLM).
        max_tokens: at most this many generated tokens; None: as many as
            ``max_model_len`` leaves room for (as in vLLM).
        seed: makes sampling reproducible per request, whatever else is batched;
            with n > 1, completion k uses seed + k (as in vLLM). -1 means None.
        stop: strings that end the completion (not included in its text).
        ignore_eos: keep generating past the end-of-sequence token.
        stop_token_ids: token ids that end the completion, as EOS does (the
            token stays in ``token_ids``, not in the text; ``stop_reason`` is its id),
            also with ``ignore_eos``, as in vLLM.
        logprobs: also return each generated token's log-probability and those of
            the ``logprobs`` most likely tokens at its position (0: the generated
            token's alone; at most MAX_LOGPROBS, 20, vLLM's default limit), from the
            model's raw logits, before temperature, top-k and top-p (vLLM's default
            ``logprobs_mode``). None: no log-probabilities.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # TypeError for a wrong type, ValueError for a bad value; both name the field and the value.
        # bool is an int subclass in Python, but True is no number of tokens: refused everywhere.
        _check_int("n", self.n, minimum=1, maximum=MAX_N)
        _check_number("temperature", self.temperature)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # As vLLM does: a tiny temperature overflows the logits / temperature; it samples as greedily as 0.01.
            logger.warning("temperature %r is below %r; using %r", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if self.temperature == 0 and self.n > 1:
            # As vLLM's _verify_greedy_sampling: n greedy completions would be n copies of one.
            raise ValueError(f"n must be 1 when using greedy sampling (temperature=0), got {self.n}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k!r}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        if self.seed == -1:
            self.seed = None  # vLLM's spelling of "no seed"
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=MIN_SEED, maximum=MAX_SEED)
            if self.seed + self.n - 1 > MAX_SEED:
                raise ValueError(
                    f"seed must be at most {MAX_SEED} - (n - 1) = {MAX_SEED - self.n + 1} with n={self.n} "
                    f"(completion k samples with seed + k), got {self.seed!r}"
                )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple)):
                raise TypeError(
                    f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__} "
                    f"{self.stop_token_ids!r:.80}"
                )
            for index, token_id in enumerate(self.stop_token_ids):
                _check_int(f"stop_token_ids[{index}]", token_id, minimum=0)
            self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__} {self.ignore_eos!r}")
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop)
        else:
            raise TypeError(f"stop must be a str or a list of str, got {type(self.stop).__name__} {self.stop!r:.80}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_top_k(self) -> bool:
        """Whether ``top_k`` limits the choice (0 and -1 both mean it does not, as in vLLM)."""
        return self.top_k > 0


def _refuse_what_is_not_implemented(init):
    """``SamplingParams.__init__``, first refusing vLLM settings this engine does not implement."""

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name in [name for name in kwargs if name in VLLM_NOT_IMPLEMENTED]:
            value, neutral = kwargs.pop(name), VLLM_NOT_IMPLEMENTED[name]
            if not (value is None or (value == neutral and isinstance(value, bool) == isinstance(neutral, bool))):
                raise ValueError(
                    f"{name}={value!r}: vLLM's SamplingParams has this setting, mini-vLLM does not implement it "
                    "(it has n, temperature, top_p, top_k, max_tokens, seed, stop, stop_token_ids, ignore_eos and logprobs)"
                )
        init(self, *args, **kwargs)

    return __init__


SamplingParams.__init__ = _refuse_what_is_not_implemented(SamplingParams.__init__)
