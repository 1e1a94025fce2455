"""Pydantic models of the OpenAI API subset kvserve serves (completions, chat, models).

Request models validate types (strictly: "5" is not an int, "yes" not a bool) and ranges;
a violation becomes a 400 with the field as ``param`` (see errors.py). An unknown field is a
400 naming it (``extra="forbid"``), as OpenAI's own API does: nothing is silently dropped.
The fields beyond OpenAI's that are accepted are vLLM's extras listed in ``VLLM_EXTRAS``.
"""

from __future__ import annotations

import functools
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from kvserve.sampling_params import MAX_LOGPROBS

TokenId = Annotated[int, Strict()]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]

_FORBID = ConfigDict(extra="forbid", strict=True)


class RequestModel(BaseModel):
    """A request body's model: a JSON ``null`` for an optional field means "not set".

    NOTE: OpenAI's API marks its optional fields nullable and clients send unset ones as
    ``null`` (``"n": null``, ``"stream": null``); a field whose default is not None would
    reject that under strict types, so the key is dropped before validation and the default
    applies. A required field keeps its type error.
    """

    model_config = _FORBID

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted_keys(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


@functools.cache
def _defaulted_keys(model: type[BaseModel]) -> frozenset[str]:
    """The names (and aliases) of ``model``'s optional fields whose default is not None."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        if field.is_required() or field.get_default(call_default_factory=False) is None:
            continue
        keys.add(name)
        if field.alias:
            keys.add(field.alias)
    return frozenset(keys)


# The request fields beyond OpenAI's API that kvserve implements, with vLLM's names and
# meaning; any other field not in OpenAI's API is a 400 (README, "OpenAI server").
VLLM_EXTRAS: dict[str, tuple[str, ...]] = {
    "common": (
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "stop_token_ids",
        "priority",
        "cache_salt",
        "structured_outputs",
    ),
    "completions": ("prompt_logprobs", "response_format"),
    "chat": ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"),
}


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs`` extra: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: FiniteFloat | None = Field(None, ge=0)  # None = 1.0, as OpenAI
    top_p: FiniteFloat | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: FiniteFloat | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: FiniteFloat = Field(0.0, ge=-2, le=2)
    frequency_penalty: FiniteFloat = Field(0.0, ge=-2, le=2)
    repetition_penalty: FiniteFloat = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (vLLM's ``continuous_usage_stats``,
        with ``include_usage``)."""
        options = self.stream_options
        return self.include_usage and options is not None and options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. ``prompt``: text, token ids, or a batch of either."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo (score the prompt)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None  # vLLM takes it on completions too


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # role "tool": the call this result answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        # NOTE: said before the union is tried, which would list each member's complaint.
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported: the served "
                        "model reads text only (parts of type 'text' are)"
                    )
        return value

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessage:
        # NOTE: OpenAI's API and vLLM's protocol require it: a tool result answers one call.
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' must have a tool_call_id")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = no arguments
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(RequestModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the last (assistant) message is continued
    # vLLM: the reply starts with the last message's content when that message has the
    # reply's role (assistant; with add_generation_prompt off, whatever the last role is).
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: more variables for the template


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogProbs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per output token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: one token's raw logprob, rank and text."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # token id (as a JSON key) -> entry, per prompt token; None for the first one.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(RequestModel):
    """POST /tokenize with a prompt (vLLM)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestModel):
    """POST /tokenize with chat messages (vLLM): the rendered chat template's tokens."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model."""
    return model.model_dump(mode="json")
