"""``LLM``: the offline API, named and shaped like vLLM's (chapters 00, 08).

    >>> from mini_vllm import LLM, SamplingParams
    >>> llm = LLM()                                   # the bundled default model
    >>> out = llm.generate(["Tell me a story about a cat named Mia."],
    ...                    SamplingParams(temperature=0, max_tokens=40))
    >>> out[0].outputs[0].text, out[0].num_cached_tokens

vLLM equivalent: ``vllm/entrypoints/llm.py`` (``LLM.generate``, ``LLM.chat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from .config import EngineConfig, make_engine_config, signature_with_settings
from .engine_parts import EngineParts
from .interrupts import keyboard_interrupts_deferred
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .validation import check_text

PromptType = str | dict


class LLM:
    """A model plus an engine. Owns one ``LLMEngine``; every call runs it to completion."""

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        parts: EngineParts | None = None,
        **settings: Any,
    ) -> None:
        """``model``: a Hugging Face folder (None: the bundled model).

        The settings are ``EngineConfig``'s fields, as keywords or as
        ``config=EngineConfig(...)`` (its docstring says what each means and
        its default): ``device``, ``dtype``, ``block_size``, ``num_blocks``,
        ``kv_cache_memory_gb``, ``enable_prefix_caching``, ``max_num_seqs``,
        ``max_num_batched_tokens``, ``max_model_len``, ``attention_backend``,
        ``hash_algo``, ``seed``, ``kv_offloading_size``, ``kv_offloading_backend``,
        ``kv_transfer_config``, ``prefix_cache_retention_interval``,
        ``disable_hybrid_kv_cache_manager``. An unknown keyword is a TypeError naming it.

        ``parts``: an ``EngineParts`` (``mini_vllm/engine_parts.py``), the
        pieces this engine runs in place of the engine's own (the free queue,
        the slot mapping, the hashing, the prefix lookup, freeing, popping with
        eviction, the kernels, admission); None: the engine's own.
        """
        config = make_engine_config(config, settings)
        self.llm_engine = LLMEngine(model, config, parts)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (as vLLM's ``LLM.reset_prefix_cache``); False while requests run,
        unless ``reset_running_requests`` preempts them first (they are recomputed)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    # -- generate ---------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in prompt order.

        A prompt is a string or ``{"prompt_token_ids": [...], "cache_salt": "..."}``.
        Every prompt is validated before any is queued (``LLMEngine.add_parent_requests``):
        a bad one raises ValueError (TypeError for a wrong type) and nothing is
        allocated. With ``n > 1`` each completion runs as its own request; they
        share the prompt's blocks through the prefix cache, and each prompt's
        ``ParentRequest`` (``parallel_sampling.py``) merges them into its one
        ``RequestOutput``.

        A completion whose step failed has ``finish_reason="error"`` (the
        error is logged); the others are unaffected. On Ctrl-C every request
        of this call is aborted, its blocks freed, and the ``KeyboardInterrupt``
        raised again: the engine is ready for the next call.
        """
        engine = self.llm_engine
        queued_before = set(engine.requests)
        results: dict[str, RequestOutput] = {}
        try:
            parents = engine.add_parent_requests(prompts, sampling_params)
            self._run_engine(
                [child_id for parent in parents for child_id in parent.child_request_ids], use_tqdm, results
            )
        finally:
            # On an exception (or Ctrl-C) nothing of this call may stay queued or allocated.
            # (Found by difference, so that even requests queued just before a Ctrl-C are caught.)
            with keyboard_interrupts_deferred():
                for request_id in set(engine.requests) - queued_before:
                    engine.abort_request(request_id)
        return [parent.merge(results) for parent in parents]

    def _run_engine(self, request_ids: list[str], use_tqdm: bool, results: dict[str, RequestOutput]) -> None:
        """Step the engine until every one of ``request_ids`` is in ``results``."""
        engine = self.llm_engine
        wanted = set(request_ids)
        progress = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        try:
            while not wanted <= results.keys():
                # The engine may also finish requests queued before this call
                # (e.g. by the dashboard's add_requests): they are not ours to return.
                for output in engine.step():
                    if output.request_id in wanted:
                        results[output.request_id] = output
                        progress.update(1)
        finally:
            progress.close()

    # -- chat -------------------------------------------------------------------
    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template.

        ``messages``: one conversation (a list of ``{"role": str, "content": str}``)
        or a list of them. Every conversation is checked and rendered before
        anything is queued; an error names the conversation and message index.

        As in vLLM, the template is rendered to text and that text is tokenized
        with special tokens recognized, so a role marker such as
        ``<|im_start|>`` typed inside a message's content becomes the control
        token, not literal text (chapter 09b). Escape or strip such markers from
        untrusted content yourself.
        """
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict or None, got {type(chat_template_kwargs).__name__}")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError(
                f"messages must be a non-empty list of messages (or of conversations), got {messages!r:.80}"
            )
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for index, conversation in enumerate(conversations):
            where = f"conversation {index}, " if len(conversations) > 1 else ""
            conversation = join_text_parts(conversation, where)
            check_conversation(conversation, where)
            try:
                token_ids = self.apply_chat_template(conversation, **(chat_template_kwargs or {}))
            except Exception as error:  # a template may reject a conversation by raising (jinja's TemplateError)
                raise ValueError(f"{where}the chat template rejected the conversation: {error}") from error
            prompt: dict = {"prompt_token_ids": token_ids}
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def render_chat_template(
        self,
        conversation: list[dict],
        chat_template_kwargs: dict | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of a conversation plus the assistant's turn header (what is tokenized).

        ``chat_template_kwargs`` (a request's) go to the template, but the settings this engine
        renders with win over them, as over vLLM's: ``add_generation_prompt`` and
        ``continue_final_message`` (vLLM's request fields, which override its
        ``chat_template_kwargs``; chat always adds the header, the server's ``/tokenize`` may
        not), and text, not token ids (``tokenize``: the same prompt either way).
        """
        settings = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tokenize": False,
        }
        return self.get_tokenizer().apply_chat_template(conversation, **((chat_template_kwargs or {}) | settings))

    def apply_chat_template(self, conversation: list[dict], **kwargs) -> list[int]:
        """Token ids of a conversation plus the assistant's turn header."""
        return self.get_tokenizer().encode(self.render_chat_template(conversation, kwargs), add_special_tokens=False)


def join_text_parts(conversation: Any, where: str = "") -> Any:
    """The conversation with each OpenAI-style content list (``[{"type": "text", "text": ...}, ...]``)
    joined into one string with newlines, and an assistant message's null or missing content (OpenAI
    allows it) as "", as vLLM's chat renderer and the server do; anything else as given."""
    if not isinstance(conversation, (list, tuple)):
        return conversation
    joined = []
    for index, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if content is None and isinstance(message, dict) and message.get("role") == "assistant":
            message = {**message, "content": ""}
        if isinstance(content, list):
            for part_index, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise TypeError(
                        f"{where}message {index}: content part {part_index} must be "
                        f"{{'type': 'text', 'text': str}} (this engine reads text only), got {part!r:.80}"
                    )
            message = {**message, "content": "\n".join(part["text"] for part in content)}
        joined.append(message)
    return joined


def check_conversation(conversation: Any, where: str = "") -> None:
    """TypeError/ValueError naming the message index when a conversation is malformed."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise TypeError(f"{where}a conversation must be a non-empty list of messages, got {conversation!r:.80}")
    for index, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise TypeError(
                f"{where}message {index} must be a dict with 'role' and 'content', got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"{where}message {index} has no {key!r}: {message!r:.80}")
            if not isinstance(message[key], str):
                kind = "a str or a list of text parts" if key == "content" else "a str"
                raise TypeError(
                    f"{where}message {index}: {key!r} must be {kind}, got {type(message[key]).__name__} {message[key]!r:.80}"
                )
        if not message["role"]:
            raise ValueError(f"{where}message {index}: 'role' is empty")
        for key in ("role", "content"):  # a lone surrogate (a JSON escape) would fail in the tokenizer
            check_text(message[key], f"{where}message {index}: {key!r}")


# help(LLM) and Jupyter's Shift-Tab show every setting with its default, taken from EngineConfig.
LLM.__init__.__signature__ = signature_with_settings(LLM.__init__)
