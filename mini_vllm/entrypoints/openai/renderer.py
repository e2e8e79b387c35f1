"""Prompts to token ids, on one thread beside the engine's: chat templates, tokenizing, the length check.

Rendering and tokenizing run on the renderer's own thread, off the engine loop's, so
that a long prompt never delays the other clients' steps. Every endpoint that turns
text into tokens (chat, completions, ``/tokenize``, ``/detokenize``) goes through
the one ``Renderer`` the app has.

vLLM equivalent: the renderer executor of ``vllm/entrypoints/openai/serving_engine.py``
(one worker, as its ``renderer_num_workers``; in 0.33, ``vllm/renderers/``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from ...llm import check_conversation
from ..async_llm import AsyncLLM
from .protocol import APIError, ChatCompletionRequest, TokenizeRequest


class Renderer:
    """The thread that renders chat templates and tokenizes, and the checks made before it does."""

    def __init__(self, engine: AsyncLLM, max_model_len: int, trust_request_chat_template: bool) -> None:
        self.engine = engine
        self.max_model_len = max_model_len
        # A Jinja template sent with a request runs on this thread (a slow one holds up every prompt).
        self.trust_request_chat_template = trust_request_chat_template
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mini-vllm-renderer")
        # The most characters a prompt of max_model_len tokens can have: a longer text is refused before it
        # is tokenized (vLLM's _text_len_check), so a huge prompt costs nobody a tokenization.
        vocab = engine.tokenizer.get_vocab()
        self.max_input_chars = max_model_len * max(len(token) for token in vocab)

    async def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` (a template rendering, a tokenization) on the renderer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def check_text_length(self, text: str, param: str) -> None:
        """A 400 for a prompt text longer than any prompt of max_model_len tokens, in vLLM's words."""
        if len(text) > self.max_input_chars:
            limit = self.max_model_len
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{len(text)} characters (more than {self.max_input_chars} characters, which is the upper "
                f"bound for {limit} input tokens). Please reduce the length of the input prompt.",
                param=param,
            )

    async def conversation_text(
        self,
        body: ChatCompletionRequest | TokenizeRequest,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """A request's ``messages`` rendered by the chat template (chat, and ``/tokenize`` of
        messages: the same text, so the same tokens, for the same conversation)."""
        conversation = [{"role": message.role, "content": message.text()} for message in body.messages]
        llm = self.engine.llm
        template_kwargs = dict(body.chat_template_kwargs or {})
        if body.request_chat_template() is not None:
            if not self.trust_request_chat_template:
                raise APIError(  # vLLM's words
                    400,
                    "Chat template is passed with request, but --trust-request-chat-template is not set. "
                    "Refused request with untrusted chat template.",
                    param="chat_template",
                )
            if body.chat_template is not None:
                template_kwargs["chat_template"] = body.chat_template

        def render() -> str:
            check_conversation(conversation)
            try:
                return llm.render_chat_template(
                    conversation,
                    template_kwargs,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                )
            except Exception as error:  # jinja's TemplateError, a template raising on a role it does not know
                raise ValueError(f"the chat template rejected the conversation: {error}") from error

        try:
            return await self.run(render)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param="messages") from None

    async def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Each text's token ids, tokenized in one go on the renderer thread."""
        tokenizer = self.engine.tokenizer
        return await self.run(lambda: [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts])
