"""``LLM``: the offline API, named and shaped like vLLM's (chapters 00, 08).

    >>> from mini_vllm import LLM, SamplingParams
    >>> llm = LLM()                                   # the bundled default model
    >>> out = llm.generate(["Tell me a story about a cat named Mia."],
    ...                    SamplingParams(temperature=0, max_tokens=40))
    >>> out[0].outputs[0].text, out[0].num_cached_tokens

vLLM equivalent: ``vllm/entrypoints/llm.py`` (``LLM.generate``, ``LLM.chat``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Optional, Union

from tqdm.auto import tqdm

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

PromptType = Union[str, dict]


class LLM:
    """A model plus an engine. Owns one ``LLMEngine``; every call runs it to completion."""

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = 16,
        num_blocks: Optional[int] = None,
        kv_cache_memory_gb: Optional[float] = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 2048,
        max_model_len: Optional[int] = None,
        attention_backend: str = "auto",
        hash_algo: str = "sha256",
        seed: int = 0,
    ) -> None:
        config = EngineConfig(
            device=device,
            dtype=dtype,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            attention_backend=attention_backend,
            hash_algo=hash_algo,
            seed=seed,
        )
        self.llm_engine = LLMEngine(model, config)
        self._call_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's ``LLM.reset_prefix_cache``); False while requests run."""
        return self.llm_engine.reset_prefix_cache()

    # -- generate ---------------------------------------------------------------
    def _to_request_inputs(self, prompt: PromptType) -> tuple[list[int], Optional[str], Any]:
        """(prompt_token_ids, cache_salt, what to report as the prompt)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give at least one token")
            token_ids = self.get_tokenizer().encode(prompt, add_special_tokens=False)
            return token_ids, None, prompt
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt_token_ids", "cache_salt", "prompt"}
            if unknown:
                raise ValueError(f"unknown prompt keys {sorted(unknown)}; expected 'prompt_token_ids' and 'cache_salt'")
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                shown = prompt.get("prompt")
            elif "prompt" in prompt:
                token_ids, _, shown = self._to_request_inputs(prompt["prompt"])
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' (or 'prompt')")
            return token_ids, prompt.get("cache_salt"), shown
        raise ValueError(f"a prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in prompt order.

        A prompt is a string or ``{"prompt_token_ids": [...], "cache_salt": "..."}``.
        Every prompt is validated before any is queued: a bad one raises
        ValueError and nothing is allocated. With ``n > 1`` each completion runs
        as its own request; they share the prompt's blocks through the prefix cache.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")

        engine = self.llm_engine
        call = next(self._call_counter)
        child_ids = [
            [f"{call}-{index}" if params.n == 1 else f"{call}-{index}-{k}" for k in range(params.n)]
            for index, params in enumerate(params_list)
        ]
        # Validate everything before queueing anything: one bad prompt leaves the engine untouched.
        inputs = [self._to_request_inputs(p) for p in prompts]
        validated = [engine.validate_request(ids, params, salt) for (ids, salt, _), params in zip(inputs, params_list)]
        for request_id in sum(child_ids, []):
            engine.check_request_id(request_id)

        for ids, token_ids, (_, salt, shown), params in zip(child_ids, validated, inputs, params_list):
            for child_id in ids:
                engine.add_validated_request(child_id, list(token_ids), params, cache_salt=salt, prompt=shown)

        results = self._run_engine(sum(child_ids, []), use_tqdm)
        return [self._merge(f"{call}-{index}", ids, results) for index, ids in enumerate(child_ids)]

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        results: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        try:
            while len(results) < len(request_ids):
                # The engine may also finish requests queued before this call
                # (e.g. by the dashboard's add_requests): they are not ours to return.
                for output in engine.step():
                    if output.request_id in wanted:
                        results[output.request_id] = output
                        progress.update(1)
        finally:
            progress.close()
            # On an exception (or Ctrl-C) nothing may stay allocated.
            for request_id in request_ids:
                if request_id not in results:
                    engine.abort_request(request_id)
        return results

    @staticmethod
    def _merge(request_id: str, child_ids: list[str], results: dict[str, RequestOutput]) -> RequestOutput:
        children = [results[child_id] for child_id in child_ids]
        first = children[0]
        outputs = []
        for index, child in enumerate(children):
            completion = child.outputs[0]
            completion.index = index
            outputs.append(completion)
        return RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            num_cached_tokens=first.num_cached_tokens,
            metrics=first.metrics,
            per_completion_metrics=[child.metrics for child in children],
        )

    # -- chat -------------------------------------------------------------------
    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        sampling_params: Optional[SamplingParams] = None,
        use_tqdm: bool = False,
        cache_salt: Optional[str] = None,
        chat_template_kwargs: Optional[dict] = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            token_ids = self.apply_chat_template(conversation, **(chat_template_kwargs or {}))
            prompt: dict = {"prompt_token_ids": token_ids}
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation: list[dict], **kwargs) -> list[int]:
        """Token ids of a conversation plus the assistant's turn header."""
        text = self.get_tokenizer().apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True, **kwargs
        )
        return self.get_tokenizer().encode(text, add_special_tokens=False)
