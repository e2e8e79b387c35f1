"""Checks for chapter 01: a greedy decode loop over a contiguous KV cache.

The learner writes ``greedy_decode(model, prompt_ids, max_new_tokens)``: one
forward over the whole prompt (the prefill), then one forward per new token
that feeds *only* that token and reuses the K/V of everything before it.

The check hands the learner's function a recording stand-in for the model, so
it can say exactly which forward went wrong (how many tokens it fed, which
token, at which position, with which ``seq_len``), and then verifies every
generated token against a single teacher-forced forward over the whole
sequence: token ``i`` must be the arg-max of the logits at the position before
it (up to float rounding, so near-ties cannot make a correct loop fail).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._harness import Checker, Mistake, describe_type, guarded_check, unequal
from .one_sequence import contiguous_kv_cache, run_model

# Logits computed incrementally and all at once differ by float rounding only;
# a token counts as the arg-max when it is within this of the maximum.
_ARGMAX_TOLERANCE = 1e-3


class _RecordingModel:
    """Stands in for a ``CausalLM``: records every forward, then runs the real model.

    A loop that never ends (one that forgets to append the new token) is stopped
    after ``max_forwards`` forwards with a message that says so.
    """

    def __init__(self, model: Any, check: Checker, case: str, max_new_tokens: int) -> None:
        self._model = model
        self.config = model.config
        self.calls: list[dict] = []
        self._check, self._case, self._max_new_tokens = check, case, max_new_tokens
        # Room for an off-by-one loop to finish (and be told so), not for one that never ends.
        self.max_forwards = 2 * max_new_tokens + 8

    def __call__(self, input_ids, positions, kv_caches, attn_metadata):
        if len(self.calls) >= self.max_forwards:
            self._check.fail(
                f"{self._case}: your function called model(...) {len(self.calls)} times for "
                f"max_new_tokens={self._max_new_tokens} and had not returned: a loop that never ends",
                "the loop stops when max_new_tokens tokens were generated: append each new token to the list "
                "your `while` condition measures (new_tokens.append(next_token)), or loop with "
                "`for _ in range(max_new_tokens - 1)`",
            )
        self.calls.append(
            {
                "input_ids": [int(t) for t in input_ids.tolist()],
                "positions": [int(p) for p in positions.tolist()],
                "seq_lens": [int(s) for s in attn_metadata.seq_lens.tolist()],
                "cache": kv_caches[0][0] if kv_caches else None,
            }
        )
        return self._model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden):
        return self._model.compute_logits(hidden)

    def __getattr__(self, name: str):
        # Anything else (model.model.layers, parameters(), ...) is the real model's.
        return getattr(self._model, name)


def with_a_forward_limit(model: Any, max_new_tokens: int) -> _RecordingModel:
    """``model`` as a learner's ``greedy_decode`` sees it in the check: a loop that never ends is stopped.

    For running the learner's function outside the check (exercise 01's engine cell), where a
    loop that never appends its new token would otherwise hang the notebook.
    """
    return _RecordingModel(model, Checker("greedy_decode"), "your greedy_decode", max_new_tokens)


def _teacher_forced_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``token_ids``, from one forward over a fresh cache."""
    param = next(model.parameters())
    n = len(token_ids)
    kv_caches = contiguous_kv_cache(model.config, n, dtype=param.dtype, device=param.device)
    return run_model(model, kv_caches, token_ids, list(range(n)), seq_len=n, all_logits=True).float().cpu()


def _load_default_model():
    from ..attention import TorchAttentionBackend
    from ..model import default_model_path, load_model

    return load_model(default_model_path(), attn_backend=TorchAttentionBackend())


@dataclass
class _Forward:
    """One forward of the learner's loop, as the recording model saw it: the prefill (step 0) or a decode step."""

    call: dict  # input_ids, positions, seq_lens, cache
    prompt: list[int]
    step: int
    prefill: dict | None = None  # the prefill's call (decode steps)
    output: list[int] | None = None  # the new tokens the learner returned (decode steps)

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence after this step's token is stored."""
        return len(self.prompt) + self.step

    @property
    def fed(self) -> int:
        return len(self.call["input_ids"])

    @property
    def previous_token(self) -> int | None:
        """The token generated by the previous forward, if the learner returned it."""
        return self.output[self.step - 1] if self.step - 1 < len(self.output) else None


# What a wrong forward is, as tables of mistakes: the prefill's (the whole prompt at positions 0..n-1) and
# each decode step's (exactly the newest token, at the next position). Each row is one of the check's cases.
PREFILL_MISTAKES = (
    Mistake(
        lambda seen: seen.call["input_ids"] != seen.prompt,
        lambda seen: unequal("the first forward (the prefill) fed these tokens", seen.prompt, seen.call["input_ids"]),
        "the prefill feeds the whole prompt in one forward",
    ),
    Mistake(
        lambda seen: seen.call["positions"] != list(range(len(seen.prompt))),
        lambda seen: unequal("positions of the prefill", list(range(len(seen.prompt))), seen.call["positions"]),
        "prompt token i sits at position i: positions are 0, 1, ..., n-1",
    ),
    Mistake(
        lambda seen: seen.call["seq_lens"] != [len(seen.prompt)],
        lambda seen: unequal("seq_len of the prefill", [len(seen.prompt)], seen.call["seq_lens"]),
        "seq_len counts the tokens in the cache after this forward: the n prompt tokens",
    ),
)

STEP_MISTAKES = (
    Mistake(
        lambda seen: seen.fed != 1,
        lambda seen: unequal("number of tokens fed to the model", 1, seen.fed),
        lambda seen: (
            "you fed the whole sequence again: that is decoding WITHOUT a cache. The K/V of every "
            "earlier token are already in the cache; feed only the newest token"
            if seen.fed == seen.seq_len
            else "a decode step feeds exactly one token: the one generated by the previous forward"
        ),
    ),
    Mistake(
        lambda seen: seen.call["cache"] is not seen.prefill["cache"],
        "the model got different KV-cache tensors than in the prefill",
        "create the cache once, before the prefill, and pass the same kv_caches to every forward: "
        "a fresh cache has forgotten the prompt's K/V",
    ),
    Mistake(
        lambda seen: seen.previous_token is not None and seen.call["input_ids"][0] != seen.previous_token,
        lambda seen: unequal("the token fed to the model", seen.previous_token, seen.call["input_ids"][0]),
        "feed the token you generated in the previous step (append it to the sequence first), "
        "not a prompt token or an older one",
    ),
    Mistake(
        lambda seen: seen.call["positions"] != [seen.seq_len - 1],
        lambda seen: unequal("the position of the fed token", [seen.seq_len - 1], seen.call["positions"]),
        lambda seen: (
            "positions advance: the newest token's position is the number of tokens before it "
            f"({len(seen.prompt)} prompt tokens + {seen.step - 1} earlier new token(s) = {seen.seq_len - 1})"
        ),
    ),
    Mistake(
        lambda seen: seen.call["seq_lens"] != [seen.seq_len],
        lambda seen: unequal("seq_len", [seen.seq_len], seen.call["seq_lens"]),
        lambda seen: (
            "seq_len counts every token in the cache after this forward, the one just fed included "
            f"({seen.seq_len - 1} earlier tokens + 1 = {seen.seq_len})"
        ),
    ),
)


def _check_one(
    check: Checker,
    greedy_decode: Callable,
    model: Any,
    prompt: list[int],
    max_new_tokens: int,
    case: str,
    random_case: bool,
) -> None:
    recorder = _RecordingModel(model, check, case, max_new_tokens)
    given = list(prompt)
    output = check.call(
        greedy_decode,
        recorder,
        given,
        max_new_tokens,
        what=f"{case}: greedy_decode(model, {len(prompt)} prompt tokens, max_new_tokens={max_new_tokens})",
        expected=f"a list of {max_new_tokens} new token ids",
        hint={
            IndexError: "a position past the end of the KV cache: it needs a row for every position written to "
            "it (the prompt's and every new token's: size it for len(prompt) + max_new_tokens)"
        },
    )
    n = len(prompt)
    check.expect_unchanged(
        list(prompt),
        given,
        case,
        "prompt_ids list",
        "the prompt belongs to the caller: copy it before appending new tokens (tokens = list(prompt_ids))",
    )
    output = check.expect_list(output, f"{case}: greedy_decode", random_case=random_case)
    not_ints = [(i, t) for i, t in enumerate(output) if not isinstance(t, int)]
    check.expect(
        not not_ints,
        f"{case}: greedy_decode returned a list of {len(output)} whose item {not_ints[0][0]} is "
        f"{describe_type(not_ints[0][1])} ({len(not_ints)} of the {len(output)} are not ints); expected int "
        "token ids"
        if not_ints
        else "",
        "return only the NEW tokens, as Python ints (int(logits.argmax()))",
        random_case,
    )
    check.expect_equal(
        len(output),
        max_new_tokens,
        f"{case}: number of new tokens returned",
        "return exactly max_new_tokens new tokens (not the prompt)",
        random_case,
    )
    calls = recorder.calls
    check.expect(
        bool(calls),
        f"{case}: your function never called model(...)",
        "run the model through run_model(model, kv_caches, token_ids, positions, seq_len)",
        random_case,
    )

    # The prefill: the whole prompt, at positions 0..n-1, in one forward.
    check.expect_no_mistakes(PREFILL_MISTAKES, _Forward(calls[0], list(prompt), 0), f"{case}: ", random_case)
    # Each decode step: exactly the newest token, at the next position.
    for step, call in enumerate(calls[1:], start=1):
        seen = _Forward(call, list(prompt), step, calls[0], output)
        check.expect_no_mistakes(STEP_MISTAKES, seen, f"{case}, decode step {step}: ", random_case)
    check.expect_equal(
        len(calls),
        max_new_tokens,
        f"{case}: number of forwards",
        "one prefill (its last logits give the first new token), then max_new_tokens - 1 decode steps",
        random_case,
    )

    # Finally the tokens themselves, against one teacher-forced forward over prompt + output.
    logits = _teacher_forced_logits(model, list(prompt) + output)
    for i, token in enumerate(output):
        row = logits[n - 1 + i]
        best = int(row.argmax())
        is_argmax = 0 <= token < row.numel() and float(row[token]) >= float(row[best]) - _ARGMAX_TOLERANCE
        check.expect(
            is_argmax,
            f"{case}: new token {i} is {token}, but recomputing the whole sequence without a cache gives "
            f"{best} (logit {float(row[best]):.3f} vs {float(row[token]):.3f} for yours)"
            if 0 <= token < row.numel()
            else f"{case}: new token {i} ({token}) is not a token id",
            "greedy decoding picks argmax of the LAST position's logits; and every forward must see the "
            "K/V of all earlier tokens",
            random_case,
        )


@guarded_check()
def check_decode_loop(greedy_decode: Callable, model: Any | None = None) -> None:
    """The learner's ``greedy_decode(model, prompt_ids, max_new_tokens) -> list[int]`` (new tokens only).

    ``model``: a ``CausalLM`` (default: the bundled model, loaded here). The
    learner's function receives a recording wrapper with the same interface.
    """
    check = Checker("greedy_decode")
    if model is None:
        model = _load_default_model()
    vocab = model.config.vocab_size
    rng = check.rng
    fixed = [
        ("a 20-token prompt, 6 new tokens", [(7 * i + 3) % vocab for i in range(20)], 6),
        ("a 1-token prompt", [5 % vocab], 4),
        (
            "a prompt of exactly one block (16 tokens): the first new token opens block 1",
            [(11 * i + 1) % vocab for i in range(16)],
            5,
        ),
        ("a 30-token prompt whose decode crosses into block 2", [(13 * i + 2) % vocab for i in range(30)], 5),
        ("max_new_tokens=1: the prefill alone", [(3 * i + 4) % vocab for i in range(9)], 1),
    ]
    for case, prompt, max_new_tokens in fixed:
        _check_one(check, greedy_decode, model, prompt, max_new_tokens, case, random_case=False)
    for _ in range(4):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        max_new_tokens = rng.randint(1, 6)
        _check_one(
            check,
            greedy_decode,
            model,
            prompt,
            max_new_tokens,
            f"a random {len(prompt)}-token prompt, {max_new_tokens} new tokens",
            random_case=True,
        )
    check.passed()
