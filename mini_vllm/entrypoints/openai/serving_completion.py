"""``POST /v1/completions``: text or token-id prompts, one choice set per prompt, answered as text.

The flow (checks, queueing, whole or streamed answer) is ``OpenAIServing``'s
(``serving_engine.py``); what is completions' own is here: ``prompt`` is a
string, a list of strings, token ids or a list of token-id lists (a batch: choice
``i * n + k`` is prompt ``i``'s ``k``-th), a choice is ``text``, and logprobs
carry each token's offset in that text.

vLLM equivalent: ``vllm/entrypoints/openai/serving_completion.py``
(``OpenAIServingCompletion``; in 0.33, ``completion/serving.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from ...validation import check_text
from .protocol import APIError, CompletionRequest
from .serving_engine import OpenAIServing, ResponseBuilder, decoded_token, json_logprob


class CompletionResponseBuilder(ResponseBuilder):
    ID_PREFIX = "cmpl"
    OBJECT = "text_completion"
    CHUNK_OBJECT = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.text_offsets: dict[int, int] = {}  # streamed: each choice's text so far, in token texts

    def content(self, text: str, chunk: bool = False, first: bool = False) -> dict[str, Any]:
        return {"text": text}

    def logprobs(self, choice: int, token_ids: list[int], entries: list) -> dict:
        offset = self.text_offsets.get(choice, 0)
        result = completion_logprobs(token_ids, entries, self.num_logprobs, self.decode, offset)
        self.text_offsets[choice] = offset + sum(len(token) for token in result["tokens"])
        return result


class OpenAIServingCompletion(OpenAIServing):
    builder = CompletionResponseBuilder

    async def prompts(self, body: CompletionRequest) -> list[list[int]]:
        """Each prompt's token ids: texts tokenized with the special tokens, as vLLM does; token ids as given."""
        prompt = body.prompt
        if isinstance(prompt, str):
            texts: list[str] | None = [prompt]
        elif prompt and isinstance(prompt[0], str):
            texts = list(prompt)
        else:
            texts = None
        if texts is None:  # token ids: one list, or a list of lists
            prompts = [list(prompt)] if not prompt or isinstance(prompt[0], int) else [list(p) for p in prompt]
        else:
            for index, text in enumerate(texts):
                self.renderer.check_text_length(text, "prompt")
                try:
                    check_text(text, f"prompt {index}" if len(texts) > 1 else "prompt")
                except ValueError as error:
                    raise APIError(400, str(error), param="prompt") from None
            prompts = await self.renderer.encode(texts, add_special_tokens=True)
        for index, token_ids in enumerate(prompts):
            if not token_ids:
                where = f"prompt {index}" if len(prompts) > 1 else "prompt"
                raise APIError(400, f"{where} is empty: give at least one token", param="prompt")
        return prompts


def completion_logprobs(
    token_ids: list[int], entries: list[dict], num_top: int, decode: Callable[[int], str], text_offset: int = 0
) -> dict[str, Any]:
    """A completion choice's ``logprobs``, as vLLM's ``_create_completion_logprobs``: per token its text,
    log-probability, offset in the text, and the first ``num_top + 1`` candidates (the token first)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in zip(token_ids, entries):
        token = decoded_token(position[token_id], token_id, decode)
        tokens.append(token)
        token_logprobs.append(json_logprob(position[token_id]))
        candidates = itertools.islice(position.items(), num_top + 1)
        top_logprobs.append({decoded_token(entry, other, decode): json_logprob(entry) for other, entry in candidates})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}
