"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Request fields are strictly typed: a string where a number belongs, or ``true`` as a token
count, is a 400 with the field named, never a silent coercion. Value ranges are checked once,
by ``SamplingParams``, so that the server and the offline API give the same messages.

Unknown fields are refused (``extra="forbid"``: a 400 naming the field), since a field
dropped without a word is a wrong answer with a 200. The fields OpenAI accepts as metadata
(``user``, ``metadata``, ``store``, ``service_tier``) are accepted and have no effect on the
output (``user`` may scope the prefix cache); see docs/OPENAI_API.md for every field.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      field_validator, model_serializer)

from pagellm.entrypoints.chat_content import flatten_content

Number = StrictFloat | StrictInt
# What torch.Generator.manual_seed accepts: a larger seed would fail inside the engine.
Seed = Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(Strict):
    name: StrictStr = "response"
    description: StrictStr | None = None
    # "schema" shadows a BaseModel attribute: stored as json_schema, sent as "schema"
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(Strict):
    """vLLM's ``structured_outputs`` field (pagellm.structured_outputs.StructuredOutputsParams)."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = True


class SamplingRequest(Strict):
    """Fields shared by completions and chat completions, including vLLM's extras."""

    model: StrictStr | None = None
    n: StrictInt = 1
    temperature: Number | None = None
    top_p: Number | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Seed | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # OpenAI metadata: accepted, no effect on the output (nothing is stored)
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    # structured outputs (OpenAI's response_format; vLLM's structured_outputs and the older
    # guided_* spellings): at most one of them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    # vLLM extras
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    priority: StrictInt = 0
    cache_salt: StrictStr | None = None
    prompt_logprobs: StrictInt | None = None
    truncate_prompt_tokens: StrictInt | None = None
    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    # refused with a 400 when used: beam search is not implemented
    use_beam_search: StrictBool = False
    length_penalty: Number | None = None


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class FunctionCall(Strict):
    name: StrictStr
    arguments: StrictStr


class ToolCall(Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    """A message; an assistant message may carry ``tool_calls``, a ``tool`` message answers
    one (``tool_call_id``). The fields OpenAI's clients echo back from a response
    (``refusal``, ``annotations``, ``audio``, ``function_call``) are accepted when null."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | None = None  # or a list of text parts, joined
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _flatten_parts(cls, content: Any) -> Any:
        """Text parts become one string, as the template reads them (chat_content); a part of
        another type is a 400 naming it."""
        return flatten_content(content, "content")

    def text(self) -> str:
        return self.content or ""


class FunctionDefinition(Strict):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Strict):
    name: StrictStr


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # refused with a 400 when set: see serving_chat
    reasoning_effort: StrictStr | None = None
    functions: list[Any] | None = None
    function_call: Any = None


class TokenizeRequest(Strict):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(Strict):
    model: StrictStr | None = None
    tokens: list[StrictInt]


# ---------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprobEntry(BaseModel):
    """vLLM's prompt_logprobs entry, keyed by token id (as a string, JSON keys are)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprobEntry] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_empty(self, handler) -> dict[str, Any]:
        out = handler(self)
        if out.get("reasoning_content") is None:
            out.pop("reasoning_content", None)
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, PromptLogprobEntry] | None] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first carries id, type and name, the next ones
    pieces of the arguments text (OpenAI's chunks)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    """Only the fields a chunk carries: the role in a choice's first chunk, then content,
    reasoning content or tool call pieces."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagellm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
