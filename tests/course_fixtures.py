"""What the course checks' tests share: the chapter 01 decode loop a learner writes and how a rejection is proved.

The learner-style implementations of each exercise (right and wrong) stay
next to the tests that use them; what several test files need lives here,
once. The bundled model the chapter 01 tests run is the ``default_model``
fixture (``tests/conftest.py``).
"""

from __future__ import annotations

import re

import pytest

from mini_vllm.course._harness import CheckFailure
from mini_vllm.course.one_sequence import contiguous_kv_cache, run_model


def rejects(check, wrong, fragment: str, *args, regex: bool = False) -> str:
    """The check's message for ``wrong``; fails unless it is a CheckFailure holding ``fragment``.

    ``regex``: ``fragment`` is a regular expression to search for (as ``pytest.raises(match=...)``).
    """
    with pytest.raises(CheckFailure) as info:
        check(wrong, *args)
    message = str(info.value)
    assert re.search(fragment, message) if regex else fragment in message, message
    return message


def make_decode(
    *, position=None, feed_all=False, seq_len_shift=0, feed_token=None, fresh_cache=False, cache_for_prompt_only=False
):
    """Chapter 01's exercise, a greedy decode loop, correct unless one of the mistakes is switched on."""

    def greedy_decode(model, prompt_ids, max_new_tokens):
        kv_caches = contiguous_kv_cache(
            model.config, len(prompt_ids) + (0 if cache_for_prompt_only else max_new_tokens)
        )
        tokens = list(prompt_ids)
        logits = run_model(model, kv_caches, tokens, list(range(len(tokens))), len(tokens))
        new_tokens = [int(logits.argmax())]
        tokens.append(new_tokens[-1])
        while len(new_tokens) < max_new_tokens:
            if fresh_cache:
                kv_caches = contiguous_kv_cache(model.config, len(prompt_ids) + max_new_tokens)
            if feed_all:
                logits = run_model(model, kv_caches, tokens, list(range(len(tokens))), len(tokens))
            else:
                fed = tokens[-1] if feed_token is None else feed_token(prompt_ids, tokens)
                pos = len(tokens) - 1 if position is None else position(prompt_ids, tokens)
                logits = run_model(model, kv_caches, [fed], [pos], len(tokens) + seq_len_shift)
            new_tokens.append(int(logits.argmax()))
            tokens.append(new_tokens[-1])
        return new_tokens

    return greedy_decode
