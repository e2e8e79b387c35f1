"""``POST /v1/chat/completions``: a conversation rendered by the chat template, answered as chat.

The flow (checks, queueing, whole or streamed answer) is ``OpenAIServing``'s
(``serving_engine.py``); what is chat's own is here: the prompt is the
conversation rendered by the model's chat template, a choice is an assistant
``message`` (a ``delta`` when streamed, the role first), and logprobs are
written per token with their UTF-8 bytes.

vLLM equivalent: ``vllm/entrypoints/openai/serving_chat.py`` (``OpenAIServingChat``;
in 0.33, ``chat_completion/serving.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from .protocol import ChatCompletionRequest
from .serving_engine import OpenAIServing, ResponseBuilder, decoded_token, json_logprob


class ChatResponseBuilder(ResponseBuilder):
    ID_PREFIX = "chatcmpl"
    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"

    def content(self, text: str, chunk: bool = False, first: bool = False) -> dict[str, Any]:
        if not chunk:
            return {"message": {"role": "assistant", "content": text}}
        return {"delta": {"role": "assistant", "content": text} if first else {"content": text}}

    def logprobs(self, choice: int, token_ids: list[int], entries: list) -> dict:
        return chat_logprobs(token_ids, entries, self.num_logprobs, self.decode)

    def opening_chunks(self, num_choices: int) -> list[dict]:
        """The assistant's role first, for every choice, as vLLM sends it."""
        return [self.chunk_choice(choice, "", None, first=True) for choice in range(num_choices)]


class OpenAIServingChat(OpenAIServing):
    builder = ChatResponseBuilder

    async def prompts(self, body: ChatCompletionRequest) -> list[list[int]]:
        """The conversation as the chat template renders it, tokenized (the template wrote the special tokens)."""
        text = await self.renderer.conversation_text(body)
        self.renderer.check_text_length(text, "messages")
        return await self.renderer.encode([text], add_special_tokens=False)


def chat_logprobs(token_ids: list[int], entries: list[dict], num_top: int, decode: Callable[[int], str]) -> dict:
    """A chat choice's ``logprobs``, as vLLM's ``_create_chat_logprobs``: per token its text, log-probability
    and UTF-8 bytes, and the first ``num_top`` candidates in the engine's order (the token first)."""

    def item(token_id: int, entry: Any) -> dict[str, Any]:
        token = decoded_token(entry, token_id, decode)
        return {"token": token, "logprob": json_logprob(entry), "bytes": list(token.encode("utf-8", errors="replace"))}

    content = []
    for token_id, position in zip(token_ids, entries):
        top = [item(other, entry) for other, entry in itertools.islice(position.items(), num_top)]
        content.append({**item(token_id, position[token_id]), "top_logprobs": top})
    return {"content": content}
