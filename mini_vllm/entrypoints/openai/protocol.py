"""The OpenAI API's request and response bodies, as vLLM's server accepts and returns them.

Only the fields a prompt-caching course needs, with the OpenAI / vLLM names:
``messages`` or ``prompt``, ``max_tokens`` (``max_completion_tokens`` for chat),
``temperature``, ``top_p``, ``top_k``, ``seed``, ``n``, ``stop``, ``stop_token_ids``, ``stream``,
``stream_options.include_usage``, ``ignore_eos``, ``logprobs`` (chat: ``logprobs`` and
``top_logprobs``) and vLLM's ``cache_salt``. Types are checked strictly
(a string ``max_tokens`` is refused, not converted; vLLM's lax models convert it) except that a
whole-number float such as ``3.0`` is the integer 3, as vLLM takes it (``Integer``); values are checked by
``SamplingParams``, the engine's one place for them, so the server and
``LLM.generate`` refuse the same things with the same words. Fields vLLM
implements and this server does not (``NOT_IMPLEMENTED``: penalties,
``min_tokens``, ``response_format``, tools, ...) are refused with a 400 naming
the field when they ask for anything but their neutral value, never silently
dropped; other unknown fields are ignored, as vLLM does (it logs them).

vLLM equivalent: ``vllm/entrypoints/openai/protocol.py`` (and, in 0.33,
``chat_completion/protocol.py``, ``completion/protocol.py``).
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

# A JSON number: an int is taken as the float it equals; a string or a bool is "not a valid number".
Number = StrictFloat


def _whole_number_as_int(value: Any) -> Any:
    """``3.0`` -> ``3``: a JSON number without a fractional part is an integer (Python's json writes 3.0)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer field: an int, or a float with nothing after the point, as vLLM's models accept (3.5 is refused).
Integer = Annotated[StrictInt, BeforeValidator(_whole_number_as_int)]


def null_means(default: Any) -> BeforeValidator:
    """An explicit JSON null is the field's default: for the fields vLLM's models declare Optional with a
    non-null default (``stream: bool | None = False``), which vLLM then treats as that default."""
    return BeforeValidator(lambda value: default if value is None else value)


# vLLM's bounds of a request's seed (an int64), and its most stop strings (its env variable, default 4).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
VLLM_MAX_STOP_STRINGS = int(os.environ.get("VLLM_MAX_STOP_STRINGS", "4"))


# vLLM request fields that change the answer and that this server does not implement, each with the
# values that mean "off" (what OpenAI clients and vLLM's benchmarks send when they do not use them).
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "min_p": (0, 0.0, None),
    "min_tokens": (0, None),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "bad_words": (None, []),
    "include_stop_str_in_output": (False, None),
    "skip_special_tokens": (True, None),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    "echo": (False, None),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "suffix": (None, ""),
    "continue_final_message": (False, None),
    "add_generation_prompt": (True, None),
    "allowed_token_ids": (None, []),
    "use_beam_search": (False, None),
    "length_penalty": (1, 1.0, None),
    "priority": (0, None),
    "return_token_ids": (False, None),
    "return_tokens_as_token_ids": (False, None),
}


def _is_off(value: Any, off_values: tuple[Any, ...]) -> bool:
    """``value`` is one of ``off_values`` (a bool only equals a bool: True is no penalty of 1)."""
    return any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in off_values)


class _Request(BaseModel):
    # Unknown fields are kept (in model_extra) so that NOT_IMPLEMENTED ones can be refused by name.
    model_config = ConfigDict(extra="allow")

    # Fields whose neutral value is this endpoint's own (vLLM's defaults differ between chat and completions).
    ENDPOINT_NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def not_implemented_field(self) -> str | None:
        """The first field that asks for something this server does not implement (see NOT_IMPLEMENTED)."""
        refused = NOT_IMPLEMENTED | self.ENDPOINT_NOT_IMPLEMENTED
        for name, value in (self.model_extra or {}).items():
            if name in refused and not _is_off(value, refused[name]):
                return name
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return "stream_options.continuous_usage_stats"
        return None

    model: StrictStr | None = None
    max_tokens: Integer | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Integer | None = None
    seed: Annotated[Integer, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None  # vLLM's bounds (torch takes more)
    n: Integer = 1
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=VLLM_MAX_STOP_STRINGS)] | None = None
    stream: Annotated[StrictBool, null_means(False)] = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[Integer, Field(ge=0)]] | None = None
    cache_salt: StrictStr | None = None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    # OpenAI lets an assistant message send null or no content (it made only tool calls); other roles need it.
    content: StrictStr | list[TextPart] | None = Field(default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if content is None and role != "assistant":
            raise ValueError(f"a {role!r} message needs content (only an assistant message may leave it null)")
        return content

    def text(self) -> str:
        """The content as one string (text parts joined with newlines; none is "", as vLLM's chat renderer does)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class _ChatTemplateFields(BaseModel):
    """The chat-template fields a chat request and a ``/tokenize`` of ``messages`` share."""

    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def request_chat_template(self) -> str | None:
        """The Jinja template the request sends, as ``chat_template`` or in ``chat_template_kwargs`` (None: the model's)."""
        if self.chat_template is not None:
            return self.chat_template
        return (self.chat_template_kwargs or {}).get("chat_template")


class ChatCompletionRequest(_Request, _ChatTemplateFields):
    ENDPOINT_NOT_IMPLEMENTED = {"add_special_tokens": (False, None)}  # the template writes the special tokens

    messages: list[ChatMessage] = Field(min_length=1)
    n: Annotated[Integer, null_means(1)] = 1  # Optional in vLLM's chat request (not in its completion request)
    max_completion_tokens: Integer | None = None
    logprobs: Annotated[StrictBool, null_means(False)] = False
    top_logprobs: Integer | None = None

    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` for this request: ``top_logprobs`` (0 without) when ``logprobs`` is true."""
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing, as in vLLM
            raise ValueError("top_logprobs: when using `top_logprobs`, `logprobs` must be set to true.")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    ENDPOINT_NOT_IMPLEMENTED = {"add_special_tokens": (True, None)}

    # A string, a list of strings, token ids, or a list of token-id lists (one choice set per prompt).
    prompt: StrictStr | list[StrictStr] | list[Integer] | list[list[Integer]]
    logprobs: Integer | None = None

    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` for this request."""
        return self.logprobs


class TokenizeRequest(_ChatTemplateFields):
    """``POST /tokenize``: a ``prompt`` (as ``/v1/completions`` tokenizes it) or ``messages`` (as chat
    renders and tokenizes them), one of the two, as vLLM's ``TokenizeCompletionRequest`` /
    ``TokenizeChatRequest``. ``add_special_tokens`` defaults to True for a prompt and False for
    messages (the template writes them), as in vLLM. ``tools`` (which a template may render) is
    refused unless empty, as in a chat request."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: Annotated[StrictBool, null_means(False)] = False

    def not_implemented_field(self) -> str | None:
        """``tools`` when the request gives any (see NOT_IMPLEMENTED); None otherwise."""
        tools = (self.model_extra or {}).get("tools")
        return None if _is_off(tools, NOT_IMPLEMENTED["tools"]) else "tools"

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt (text) or messages (a conversation), not both or neither")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text, special tokens included (vLLM's ``DetokenizeRequest``)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[Annotated[Integer, Field(ge=0, le=INT64_MAX)]]


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
TokenizeRequest.model_rebuild()


# -- responses (plain dicts: what goes over the wire is exactly what is written here) ---------
def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, with_details: bool) -> dict[str, Any]:
    """The ``usage`` object. ``prompt_tokens`` includes the cached ones, as OpenAI and vLLM count them;
    ``prompt_tokens_details.cached_tokens`` is there only with ``--enable-prompt-tokens-details`` (0 on a miss)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens} if with_details else None,
    }


def _decoded(entry: Any, token_id: int, decode: Callable[[int], str]) -> str:
    """A logprob entry's token as text: the engine's ``decoded_token``, else decoded here (vLLM's ``_get_decoded_token``)."""
    return entry.decoded_token if entry.decoded_token is not None else decode(token_id)


def _logprob(entry: Any) -> float:
    return max(entry.logprob, -9999.0)  # -inf is no JSON number: OpenAI's floor, as vLLM writes it


def completion_logprobs(
    token_ids: list[int], entries: list[dict], num_top: int, decode: Callable[[int], str], text_offset: int = 0
) -> dict[str, Any]:
    """A completion choice's ``logprobs``, as vLLM's ``_create_completion_logprobs``: per token its text,
    log-probability, offset in the text, and the first ``num_top + 1`` candidates (the token first)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in zip(token_ids, entries):
        token = _decoded(position[token_id], token_id, decode)
        tokens.append(token)
        token_logprobs.append(_logprob(position[token_id]))
        candidates = itertools.islice(position.items(), num_top + 1)
        top_logprobs.append({_decoded(entry, other, decode): _logprob(entry) for other, entry in candidates})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}


def chat_logprobs(token_ids: list[int], entries: list[dict], num_top: int, decode: Callable[[int], str]) -> dict:
    """A chat choice's ``logprobs``, as vLLM's ``_create_chat_logprobs``: per token its text, log-probability
    and UTF-8 bytes, and the first ``num_top`` candidates in the engine's order (the token first)."""

    def item(token_id: int, entry: Any) -> dict[str, Any]:
        token = _decoded(entry, token_id, decode)
        return {"token": token, "logprob": _logprob(entry), "bytes": list(token.encode("utf-8", errors="replace"))}

    content = []
    for token_id, position in zip(token_ids, entries):
        top = [item(other, entry) for other, entry in itertools.islice(position.items(), num_top)]
        content.append({**item(token_id, position[token_id]), "top_logprobs": top})
    return {"content": content}


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def now() -> int:
    return int(time.time())
