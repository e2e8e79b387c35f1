"""``POST /tokenize`` and ``POST /detokenize``: what a prompt costs in tokens, and token ids back to text.

vLLM equivalent: ``vllm/entrypoints/openai/serving_tokenization.py``
(``OpenAIServingTokenization``; in 0.33, ``vllm/entrypoints/serve/tokenize/``).
"""

from __future__ import annotations

from typing import Any

from ...validation import check_text
from ..async_llm import AsyncLLM
from .protocol import APIError, DetokenizeRequest, TokenizeRequest
from .renderer import Renderer
from .serving_engine import check_implemented
from .serving_models import ServerSettings


class OpenAIServingTokenization:
    def __init__(self, engine: AsyncLLM, settings: ServerSettings, renderer: Renderer) -> None:
        self.engine = engine
        self.settings = settings
        self.renderer = renderer

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """``/tokenize``: the token ids a completion (``prompt``) or a chat (``messages``) request would
        queue, as vLLM's: no length limit (counting a long text is what it is for), ``count``,
        ``max_model_len``, and ``token_strs`` when ``return_token_strs`` asks for them."""
        self.settings.check_model(body.model)
        check_implemented(body)
        if body.messages is not None:
            text = await self.renderer.conversation_text(body, body.add_generation_prompt, body.continue_final_message)
            add_special_tokens = bool(body.add_special_tokens)  # default False: the template writes them
        else:
            text = body.prompt
            try:
                check_text(text, "prompt")
            except ValueError as error:
                raise APIError(400, str(error), param="prompt") from None
            add_special_tokens = body.add_special_tokens is not False  # default True, as /v1/completions
        [token_ids] = await self.renderer.encode([text], add_special_tokens=add_special_tokens)
        return {
            "count": len(token_ids),
            "max_model_len": self.settings.max_model_len,
            "tokens": token_ids,
            "token_strs": self.engine.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        """``/detokenize``: the text of token ids, special tokens included, as vLLM's; an id outside the
        vocabulary is a 400 naming it."""
        self.settings.check_model(body.model)
        try:
            self.engine.llm.llm_engine.input_processor.check_token_ids(body.tokens, "tokens")
        except ValueError as error:
            raise APIError(400, str(error), param="tokens") from None
        tokenizer = self.engine.tokenizer
        return {"prompt": await self.renderer.run(lambda: tokenizer.decode(body.tokens))}
