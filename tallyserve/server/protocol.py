"""Pydantic models of the OpenAI completions and chat completions APIs (requests, responses,
streaming chunks, usage). Field names and shapes follow OpenAI's; a few vLLM extras (top_k,
min_p, ignore_eos, min_tokens, stop_token_ids, use_beam_search, best_of, length_penalty, ...) are
accepted too.

Requests validate in strict mode, so a wrong JSON type ("5" for an integer, 1 for a boolean) is a
400, never silently coerced. The completions and chat requests keep the fields they do not
declare (extra="allow"): serving.check_unsupported() rejects the OpenAI and vLLM fields that
tallyserve does not implement (catalogued in fields.py) unless they carry a harmless value, and
ignores (with one log line) fields neither API defines. Every string in a request
(nested ones and dict keys included) must be valid Unicode: a lone surrogate (a JSON escape such
as \\ud800, or the bytes ED A0 80 that JSON decoding lets through) is a 400 naming the field."""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer
from pydantic_core import PydanticCustomError

# ----------------------------------------------------------------------------- requests


_SCALARS = {int, float, bool, type(None)}


def _has_invalid_unicode(value: Any) -> bool:
    """Whether a string anywhere in `value` (a JSON value: lists, dicts and their keys, models)
    holds a lone surrogate, which no tokenizer, regex or UTF-8 encoder accepts."""
    if isinstance(value, str):
        if value.isascii():
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, (list, tuple)):
        if set(map(type, value)) <= _SCALARS:  # token ids: no per-item Python loop
            return False
        return any(_has_invalid_unicode(v) for v in value)
    if isinstance(value, dict):
        return any(_has_invalid_unicode(k) or _has_invalid_unicode(v) for k, v in value.items())
    if isinstance(value, BaseModel):
        return _has_invalid_unicode(dict(value))
    return False


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if _has_invalid_unicode(value):
            raise PydanticCustomError("invalid_unicode", "invalid Unicode (a lone surrogate such as \\ud800, "
                                      "or bytes that are not UTF-8); send valid UTF-8 text")
        return value


METADATA_MAX_KEYS, METADATA_MAX_KEY_CHARS, METADATA_MAX_VALUE_CHARS = 16, 64, 512  # OpenAI's limits


def check_metadata(value: Any) -> Optional[dict[str, str]]:
    """OpenAI's `metadata`: null, or an object of at most 16 string keys (at most 64 characters)
    to string values (at most 512 characters). Anything else is a validation error naming the
    field (a 400 with param "metadata"). Nothing is stored: responses echo it."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PydanticCustomError("metadata", "must be an object of string keys to string values")
    if len(value) > METADATA_MAX_KEYS:
        raise PydanticCustomError("metadata", "at most {limit} keys, got {count}",
                                  {"limit": METADATA_MAX_KEYS, "count": len(value)})
    for key, item in value.items():
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise PydanticCustomError("metadata", "keys are at most {limit} characters, got one of {count}",
                                      {"limit": METADATA_MAX_KEY_CHARS, "count": len(key)})
        if not isinstance(item, str):
            raise PydanticCustomError("metadata", "values must be strings, got {kind}",
                                      {"kind": "null" if item is None else type(item).__name__})
        if len(item) > METADATA_MAX_VALUE_CHARS:
            raise PydanticCustomError("metadata", "values are at most {limit} characters, got one of {count}",
                                      {"limit": METADATA_MAX_VALUE_CHARS, "count": len(item)})
    return value


class StreamOptions(RequestModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # vLLM's; only false is supported (a 400 otherwise)


class SamplingFields(RequestModel):
    """Fields the completions and chat completions requests share. Undeclared fields are kept
    (`model_extra`) for serving.check_unsupported(); `catalogue` names its fields.py catalogue."""

    model_config = ConfigDict(strict=True, extra="allow")
    catalogue: ClassVar[str] = ""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: Optional[int] = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM extras
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[int] = 0
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = True
    include_stop_str_in_output: Optional[bool] = False
    use_beam_search: Optional[bool] = False
    best_of: Optional[int] = None  # with use_beam_search: the beam width (default n)
    length_penalty: Optional[float] = 1.0  # beam search: score = cum_logprob / length ** length_penalty
    repetition_penalty: Optional[float] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    # keep only the last N prompt tokens (left truncation); -1: max_model_len
    truncate_prompt_tokens: Optional[int] = None
    # structured outputs (vLLM's names; server/structured.py maps them to StructuredOutputsParams)
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    # vLLM's: the logprobs of the prompt tokens plus this many top alternatives (not with stream)
    prompt_logprobs: Optional[int] = None
    # disaggregated serving (vLLM's name): {"do_remote_decode": true} to a producer, its answer to a consumer
    kv_transfer_params: Optional[dict[str, Any]] = None
    # OpenAI's: string pairs echoed in the (non-streamed) response object (check_metadata)
    metadata: Optional[Any] = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: Any) -> Optional[dict[str, str]]:
        return check_metadata(value)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    catalogue: ClassVar[str] = "completions"
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    add_special_tokens: Optional[bool] = True  # for text prompts (e.g. a BOS)
    response_format: Optional[dict[str, Any]] = None  # text, json_object or json_schema


class ChatCompletionRequest(SamplingFields):
    catalogue: ClassVar[str] = "chat"
    messages: list[Any]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None  # function tools (checked by tool_specs.parse_tools)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None  # none / auto / required / a named function
    parallel_tool_calls: Optional[bool] = None  # false: at most one call
    response_format: Optional[dict[str, Any]] = None
    add_generation_prompt: Optional[bool] = True
    # vLLM's chat template controls
    continue_final_message: Optional[bool] = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: Optional[bool] = False  # the template places its own special tokens
    echo: Optional[bool] = False  # prepend the last message's content when it is an assistant message

    @property
    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class FaultRequest(RequestModel):
    # handler_exception: the handler itself raises (an unexpected error, not an engine fault)
    kind: Literal["step_exception", "kill_loop", "stall", "handler_exception"]
    seconds: Optional[float] = Field(default=1.0, ge=0, le=600)


# ----------------------------------------------------------------------------- responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(_Response):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's Logprob as it serializes: one token of one prompt position."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's prompt_logprobs: one entry per prompt token, null for the first; token id -> PromptLogprob
PromptLogprobsField = Optional[list[Optional[dict[int, PromptLogprob]]]]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    prompt_logprobs: PromptLogprobsField = None  # vLLM's, with the request's prompt_logprobs


class _EchoesMetadata(_Response):
    """A response object that echoes the request's `metadata`: present only when it was sent."""

    metadata: Optional[dict[str, str]] = None

    @model_serializer(mode="wrap")
    def _drop_no_metadata(self, handler):
        out = handler(self)
        metadata = out.pop("metadata", None)
        if metadata is not None:
            out["metadata"] = metadata  # last, after the object's own fields
        return out


class CompletionResponse(_EchoesMetadata):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


class CompletionStreamResponse(CompletionResponse):
    pass


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobEntry(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: Optional[list[ChatLogprobEntry]] = None
    refusal: Optional[list[ChatLogprobEntry]] = None


class FunctionCall(_Response):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Response):
    """`tool_calls` appears only when the model called tools."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(_EchoesMetadata):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_logprobs: PromptLogprobsField = None  # vLLM's, with the request's prompt_logprobs


class _Sparse(_Response):
    """Serialised without its unset (None) fields, as OpenAI's stream deltas are."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Sparse):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Sparse):
    """A call's first delta carries index, id, type and the name (arguments ""); later ones only
    index and a fragment of the arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(_Response):
    """A streamed delta: only the fields that are set appear (the final delta is `{}`)."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "tallyserve"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class HealthResponse(_Response):
    status: Literal["ok", "unhealthy"]
    reason: Optional[str] = None
    pending_requests: int
    seconds_since_last_step: float


class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(_Response):
    """Every error the server returns: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# ----------------------------------------------------------------------------- tokenizer endpoints (vLLM's shapes)


class TokenizeRequest(RequestModel):
    """POST /tokenize: either `prompt` (completion style) or `messages` (through the chat template),
    as vLLM's TokenizeCompletionRequest / TokenizeChatRequest. `add_special_tokens` defaults to
    true for a prompt and false for messages (the template places its own special tokens); with
    messages, continue_final_message / chat_template / chat_template_kwargs / tools work as in chat."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Any]] = None
    tools: Optional[list[Any]] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: Optional[bool] = None
    return_token_strs: Optional[bool] = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str
