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

A request turns itself into ``SamplingParams`` (``to_sampling_params``, as vLLM's
requests do), and a bad value is an ``APIError``: a 4xx whose body
(``error_body``) names the field.

vLLM equivalent: ``vllm/entrypoints/openai/protocol.py`` (and, in 0.33,
``chat_completion/protocol.py``, ``completion/protocol.py``).
"""

from __future__ import annotations

import os
import time
import uuid
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

from ...sampling_params import MAX_LOGPROBS, SamplingParams

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


class APIError(Exception):
    """An error answered to the client alone: status code, OpenAI error type, message, offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or {400: "BadRequestError", 404: "NotFoundError"}.get(
            status, "BadRequestError" if status < 500 else "InternalServerError"
        )

    def body(self) -> dict[str, Any]:
        """What the client gets: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.error_type, self.status, self.param)


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
    """What a chat and a completion request share, and their conversion to ``SamplingParams``.

    Each endpoint's request says which field holds its prompt and its logprobs, and gives
    ``num_logprobs()``: ``SamplingParams.logprobs`` (top candidates per token, None for none).
    """

    # Unknown fields are kept (in model_extra) so that NOT_IMPLEMENTED ones can be refused by name.
    model_config = ConfigDict(extra="allow")

    # Fields whose neutral value is this endpoint's own (vLLM's defaults differ between chat and completions).
    ENDPOINT_NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {}
    # The field holding the prompt and the one asking for logprobs: the 400s about them name it.
    PROMPT_FIELD: ClassVar[str]
    LOGPROBS_FIELD: ClassVar[str]
    # max_tokens when the request gives none; None: the rest of the context (vLLM's chat default).
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None

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

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """The field that sets the output length, and its value."""
        return "max_tokens", self.max_tokens

    def to_sampling_params(
        self, num_prompt_tokens: int, max_model_len: int, default_sampling: dict[str, Any] | None = None
    ) -> SamplingParams:
        """``SamplingParams`` for a prompt of ``num_prompt_tokens``, ``default_sampling`` (the model's
        generation config) filling what the request leaves out; a 400 naming the field otherwise."""
        max_tokens = self._max_tokens(num_prompt_tokens, max_model_len)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options can only be given when stream is true", param="stream_options")
        settings = dict(default_sampling or {})
        for key in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, key) is not None:
                settings[key] = getattr(self, key)
        settings["logprobs"] = self._checked_num_logprobs()
        settings["stop_token_ids"] = self.stop_token_ids
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, stop=self.stop, ignore_eos=self.ignore_eos, **settings
            )
        except (ValueError, TypeError) as error:
            raise bad_request(error) from None

    def _max_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """As vLLM's ``get_max_tokens``: what was asked for (or the default), capped at the rest of the
        context (a prompt of 1000 tokens with max_tokens=100 and max_model_len=1024 gets 24)."""
        name, max_tokens = self.requested_max_tokens()
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{name} must be an integer >= 1, got {max_tokens}", param=name)
        if max_tokens is not None and max_tokens > max_model_len:
            raise APIError(  # vLLM's TokenizeParams check, in its words
                400,
                f"{name}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                "Please request fewer output tokens.",
                param=name,
            )
        if num_prompt_tokens >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
                f"{num_prompt_tokens} input tokens, which leaves no room for an output token. "
                "Please reduce the length of the input prompt.",
                param=self.PROMPT_FIELD,
            )
        room = max_model_len - num_prompt_tokens
        if max_tokens is None:
            max_tokens = self.DEFAULT_MAX_TOKENS
        return room if max_tokens is None else min(max_tokens, room)

    def _checked_num_logprobs(self) -> int | None:
        """``num_logprobs()``, a 400 outside 0..MAX_LOGPROBS."""
        name = self.LOGPROBS_FIELD
        num = self.num_logprobs()
        if num is not None and num < 0:
            raise APIError(400, f"`{name}` must be a non-negative integer, got {num}", param=name)
        if num is not None and num > MAX_LOGPROBS:  # vLLM's words
            raise APIError(
                400,
                f"Requested sample logprobs of {num}, which is greater than max allowed: {MAX_LOGPROBS}",
                param=name,
            )
        return num


def bad_request(error: Exception) -> APIError:
    """A ValueError/TypeError from the engine's validation as a 400; ``param`` is the field it names first."""
    message = str(error)
    first_word = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":")
    known = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    return APIError(400, message, param=first_word if first_word in known else None)


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
    PROMPT_FIELD = "messages"
    LOGPROBS_FIELD = "top_logprobs"

    messages: list[ChatMessage] = Field(min_length=1)
    n: Annotated[Integer, null_means(1)] = 1  # Optional in vLLM's chat request (not in its completion request)
    max_completion_tokens: Integer | None = None
    logprobs: Annotated[StrictBool, null_means(False)] = False
    top_logprobs: Integer | None = None

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """``max_completion_tokens`` wins over ``max_tokens`` (OpenAI's newer name for it)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def num_logprobs(self) -> int | None:
        """``top_logprobs`` (0 without) when ``logprobs`` is true."""
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing, as in vLLM
            raise APIError(400, "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    ENDPOINT_NOT_IMPLEMENTED = {"add_special_tokens": (True, None)}
    PROMPT_FIELD = "prompt"
    LOGPROBS_FIELD = "logprobs"
    DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default, as OpenAI's

    # A string, a list of strings, token ids, or a list of token-id lists (one choice set per prompt).
    prompt: StrictStr | list[StrictStr] | list[Integer] | list[list[Integer]]
    logprobs: Integer | None = None

    def num_logprobs(self) -> int | None:
        """``logprobs``: top candidates per token."""
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


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def now() -> int:
    return int(time.time())
