"""After the model ran: each new token's text and stop check, and a finished request's ``RequestOutput`` (chapter 08).

``OutputProcessor`` gives every request the engine queues an
``IncrementalDetokenizer`` (``detokenizer.py``: the one owner of its output
text), checks after each sampled token whether the request is done (EOS, a
stop token id, a stop string, its length), and builds the ``RequestOutput`` of
a request that finished. It holds nothing per request: what it learns goes on
the ``Request`` (``detokenizer``, ``stop_reason``).

vLLM equivalent: ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``:
detokenizing, stop strings, ``RequestOutput``) and
``vllm/v1/core/sched/utils.py`` (``check_stop``), which vLLM runs in two
processes; here they run one after the other, in the engine's step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput
from .request import Request, RequestStatus


class OutputProcessor:
    """Turns sampled tokens into stop decisions and text, and finished requests into ``RequestOutput``."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def add_request(self, request: Request) -> None:
        """Give a newly queued request its detokenizer (it stops on its own checked stop strings)."""
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.sampling_params.stop_strings)

    def check_stop(self, request: Request) -> RequestStatus | None:
        """Decode the token just appended to ``request`` and say whether it finished the request, and how.

        In vLLM's order: EOS (unless ``ignore_eos``) and ``stop_token_ids``
        (also with ``ignore_eos``), whose token is not text; then a stop string
        the new text completed (``IncrementalDetokenizer.update`` cuts the text
        there); then ``max_tokens`` and ``max_model_len``. ``request.stop_reason``
        records a stop token's id or a stop string, as vLLM reports it.
        """
        params = request.sampling_params
        last = request.output_token_ids[-1]
        status = None
        if not params.ignore_eos and last in self.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif params.stop_token_ids and last in params.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
        stop_string = request.detokenizer.update([last], stop_terminated=status is not None)
        if stop_string is not None:
            request.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        if status is not None:
            return status
        if request.num_tokens >= self.max_model_len or (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def make_request_output(self, request: Request) -> RequestOutput:
        """The ``RequestOutput`` of a finished request: its detokenizer's text, tokens, reason and logprobs."""
        token_ids = list(request.output_token_ids)
        # Decoding may be what failed: an errored request's text is empty, its tokens so far are in token_ids.
        text = "" if request.status is RequestStatus.FINISHED_ERROR else request.detokenizer.output_text
        completion = CompletionOutput(0, text, token_ids, request.get_finished_reason(), request.stop_reason)
        if request.logprobs is not None:  # as vLLM's: each entry's decoded_token, and their sum
            completion.logprobs = [
                {
                    token: dataclasses.replace(entry, decoded_token=self.tokenizer.decode([token]))
                    for token, entry in position.items()
                }
                for position in request.logprobs
            ]
            completion.cumulative_logprob = sum(
                position[token].logprob for token, position in zip(token_ids, request.logprobs)
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics=request.metrics,
        )
