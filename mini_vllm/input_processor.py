"""From what a user passes to a validated request: prompts, token ids, sampling settings (chapter 08).

Every way into the engine (``LLM.generate``, ``LLM.chat``, ``LLMEngine.add_request``
and ``add_requests``, the dashboard) goes through ``InputProcessor`` before
anything is queued or allocated: bad input raises a ``ValueError`` (a
``TypeError`` for a wrong type) that names the field and the value, and the
engine is left untouched.

vLLM equivalent: ``vllm/v1/engine/input_processor.py`` (``InputProcessor``,
which also checks token ids against the vocabulary and the prompt against
``max_model_len``). The ids and settings of an ``n > 1`` prompt's children
come from ``ParentRequest`` (``parallel_sampling.py``), not from here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from transformers import AutoTokenizer

from .kv_cache_manager import cdiv
from .sampling_params import SamplingParams
from .validation import check_text

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def load_tokenizer(model_path: str):
    """The folder's tokenizer; ValueError when it has no tokenizer files (instead of an empty tokenizer)."""
    if os.path.isdir(model_path) and not any(os.path.exists(os.path.join(model_path, f)) for f in TOKENIZER_FILES):
        raise ValueError(
            f"the model folder {model_path!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
            "copy them from the model's original folder"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if len(tokenizer) == 0:
        raise ValueError(f"the tokenizer in {model_path!r} has an empty vocabulary")
    return tokenizer


def type_name(value: Any) -> str:
    """``numpy.ndarray``, ``torch.Tensor``, ``int``: the type of ``value`` as an error message shows it."""
    cls = type(value)
    module = cls.__module__.split(".")[0]
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def validated_sampling_params(params: Any) -> SamplingParams:
    """The engine's own checked copy of ``params``: what a request is queued with.

    ``SamplingParams`` checks its fields when it is built, but a field set
    afterwards (``params.n = 2000``, ``params.temperature = float("inf")``)
    skips those checks. ``dataclasses.replace`` builds a new object from the
    current fields, so ``__post_init__`` runs again: a bad value raises the very
    error that constructing ``SamplingParams`` with it would (naming the field
    and the value), the derived fields (``stop_strings``) are recomputed and the
    normalisations applied (``seed=-1`` -> None, a tiny temperature -> 0.01).
    Queuing the copy also means that changing ``params`` after it was submitted
    cannot change a queued request (vLLM clones the sampling params of each
    request too).
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type_name(params)} {params!r:.80}")
    stop = list(params.stop) if isinstance(params.stop, list) else params.stop  # not shared with the caller's list
    return dataclasses.replace(params, stop=stop)


def sampling_params_per_prompt(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    """``sampling_params`` as ``generate`` takes it (None, one, or one per prompt) -> one checked copy per prompt.

    Each is ``validated_sampling_params``' copy: a field changed after the
    object was built is checked here, before anything is queued; for a list,
    the error names its index (``sampling_params[1]: ...``).
    """
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [validated_sampling_params(sampling_params)] * num_prompts
    if isinstance(sampling_params, (list, tuple)):
        for index, params in enumerate(sampling_params):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params[{index}] must be a SamplingParams, got {type_name(params)}")
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {num_prompts} prompts")
        checked = []
        for index, params in enumerate(sampling_params):
            try:
                checked.append(validated_sampling_params(params))
            except (ValueError, TypeError) as error:
                raise type(error)(f"sampling_params[{index}]: {error}") from None
        return checked
    raise TypeError(
        f"sampling_params must be a SamplingParams or a list of them, got {type_name(sampling_params)} "
        f"{sampling_params!r:.80} (write SamplingParams(**...) for a dict)"
    )


class InputProcessor:
    """Turns prompts into token ids and checks a request against the model and the pool.

    Owns nothing that changes: the tokenizer, the vocabulary size, ``max_model_len``
    and the pool's size are fixed when the engine is built. The engine owns the
    requests; this class only says yes (returning the token ids) or raises.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        blocks_needed: Callable[[int], int] | None = None,
    ) -> None:
        """``blocks_needed(num_tokens)``: the most blocks a request that long holds at once (default:
        ``cdiv(num_tokens, block_size)``, one full-attention group; a hybrid model's engine passes
        ``kv_cache_interface.max_blocks_per_request`` for its groups)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks_needed = blocks_needed or (lambda num_tokens: cdiv(num_tokens, block_size))

    def process_prompt(self, prompt: Any) -> tuple[Any, str | None, Any]:
        """A prompt as ``LLM.generate`` takes it -> (prompt_token_ids, cache_salt, what to report as the prompt).

        A prompt is a non-empty ``str`` (tokenized here, no special tokens
        added) or a dict with ``"prompt_token_ids"`` (or ``"prompt"``, a
        string) and optionally ``"cache_salt"``. The token ids are checked by
        ``validate_request``.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give at least one token")
            check_text(prompt, "the prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False), None, prompt
        if not isinstance(prompt, dict):
            raise TypeError(f"a prompt must be a str or a dict with 'prompt_token_ids', got {type_name(prompt)}")
        unknown = set(prompt) - {"prompt_token_ids", "cache_salt", "prompt"}
        if unknown:
            raise ValueError(
                f"unknown prompt keys {sorted(map(str, unknown))}; expected 'prompt_token_ids' (or 'prompt') and 'cache_salt'"
            )
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(
                f"prompt['prompt'] must be a str, got {type_name(text)} {text!r:.80}: a prompt dict cannot nest another"
            )
        if "prompt_token_ids" in prompt:
            return prompt["prompt_token_ids"], prompt.get("cache_salt"), text
        if text is None:
            raise ValueError("a dict prompt needs 'prompt_token_ids' (or 'prompt')")
        token_ids, _, shown = self.process_prompt(text)
        return token_ids, prompt.get("cache_salt"), shown

    def check_token_ids(self, token_ids: list[int] | tuple[int, ...], name: str = "prompt_token_ids") -> None:
        """Every id an int of the vocabulary (``TypeError`` / ``ValueError`` naming the first that is not):
        for a prompt here, and for the server's ``/detokenize``."""
        vocab_size = self.vocab_size
        for index, token_id in enumerate(token_ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                hint = " (convert numpy or torch integers with .tolist())" if hasattr(token_id, "item") else ""
                raise TypeError(f"{name}[{index}] must be an int, got {type_name(token_id)} {token_id!r:.40}{hint}")
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"{name}[{index}] = {token_id} is outside the vocabulary (valid ids: 0..{vocab_size - 1})"
                )

    def longest_sequence_the_pool_holds(self) -> int:
        """The longest request (prompt + output, at most ``max_model_len``) whose slots fit the pool.

        A sequence of ``n`` tokens needs slots for ``n - 1`` (the last sampled token is never
        computed). vLLM refuses to start when ``max_model_len`` does not fit its KV cache and
        names this "estimated maximum model length"; the server serves it instead (mini-vLLM's
        pool is often sized by hand).
        """
        low, high = 1, self.max_model_len
        while low < high:
            mid = (low + high + 1) // 2
            if self.blocks_needed(mid - 1) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def validate_request(
        self, prompt_token_ids: Any, sampling_params: SamplingParams, cache_salt: str | None = None
    ) -> list[int]:
        """Check a request before anything is allocated; returns its token ids as a list.

        Token ids must be Python ``int``s in a ``list`` or ``tuple`` (as in
        vLLM, whose prompt_token_ids are ``list[int]``): a numpy array, a
        tensor, a ``range`` or a string is refused with a TypeError naming its
        type (``.tolist()`` converts arrays and tensors). The request must fit
        ``max_model_len`` (prompt + output, as in vLLM: a prompt of
        ``max_model_len`` tokens leaves no room for one output token) and the
        pool: prompt + ``max_tokens - 1`` tokens need slots (the last sampled
        token is never computed), so a prompt that fills the pool exactly is
        accepted with ``max_tokens=1``.
        """
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got {type_name(sampling_params)} {sampling_params!r:.80}"
            )
        # An empty salt is no salt, as in vLLM's offline LLM (its OpenAI server refuses "").
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type_name(cache_salt)} {cache_salt!r:.80}")
        if isinstance(prompt_token_ids, str) or not isinstance(prompt_token_ids, (list, tuple)):
            hint = (
                " (text goes in as the prompt itself)"
                if isinstance(prompt_token_ids, str)
                else " (convert it with .tolist() or list(...))"
            )
            raise TypeError(f"prompt_token_ids must be a list of ints, got {type_name(prompt_token_ids)}{hint}")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self.check_token_ids(prompt_token_ids)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens: with at least one output token that is longer than "
                f"max_model_len={self.max_model_len} (prompt + output)"
            )
        max_tokens, shown = sampling_params.max_tokens, sampling_params.max_tokens
        if max_tokens is None:  # as many as max_model_len leaves room for, as in vLLM
            max_tokens = self.max_model_len - len(prompt_token_ids)
            shown = f"None: up to max_model_len, {max_tokens}"
        num_tokens_needing_slots = min(len(prompt_token_ids) + max_tokens, self.max_model_len) - 1
        needed_blocks = self.blocks_needed(num_tokens_needing_slots)
        if needed_blocks > self.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({shown}) needs "
                f"{needed_blocks} KV-cache blocks, but the pool has only {self.num_blocks}"
            )
        return list(prompt_token_ids)
