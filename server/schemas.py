"""OpenAI wire formats as msgspec Structs (field names are OpenAI's, plus vLLM's extensions).

Requests are decoded strictly: an unknown field is a 400 naming it, and the fields OpenAI
defines but ksana-jax does not implement (`best_of`, `suffix`, `functions`, ...) are
declared only so that a request using them gets a 400 saying so instead of being silently
served without them. Ranges that are fixed live here as `Meta` constraints (they show in
the OpenAPI schema); ranges that depend on the engine (`logprobs` <= max_logprobs, prompt +
max_tokens <= max_model_len) are checked by the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

NonNegInt = Annotated[int, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
Seed = Annotated[int, Meta(ge=0, lt=2**32)]
Stop = str | list[str]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False

    def __post_init__(self) -> None:
        _null_means_default(self)


def _null_means_default(struct: msgspec.Struct) -> None:
    """OpenAI's spec makes most request fields nullable, and clients (LiteLLM, LangChain, the
    openai package given None) send null for "not set": a field declared `X | None` with a
    default other than None takes that default. (`max_tokens: null` stays None: no limit
    but the context, as in vLLM.)"""
    for field in msgspec.structs.fields(struct):
        if field.name == "max_tokens" or field.default in (None, msgspec.NODEFAULT):
            continue
        if getattr(struct, field.name) is None:
            setattr(struct, field.name, field.default)


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by completions and chat completions (null: the default, see
    `_null_means_default`)."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    # null or absent: the model's default (generation_config.json), else OpenAI's (1.0)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # these three too: the model's default
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    min_tokens: NonNegInt | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # {json | regex | choice | grammar | json_object} (server/structured.py)
    structured_outputs: dict[str, Any] | None = None
    # {"type": "text" | "json_object" | "json_schema", ...} (server/structured.py)
    response_format: dict[str, Any] | None = None
    # OpenAI fields the engine does not implement: a request that sets one gets a 400.
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    suffix: str | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _null_means_default(self)


UNSUPPORTED_FIELDS = ("best_of", "suffix", "functions", "function_call")


class CompletionRequest(_Sampling, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str | int | list[int]]
    max_tokens: NonNegInt | None = 16  # 0 only with echo: the prompt scored, nothing generated
    logprobs: NonNegInt | None = None
    echo: bool | None = False


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct, forbid_unknown_fields=True):
    """A tool call in an assistant message (a response's, or one a client sends back)."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallOut] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    # What a client sends back of an earlier answer's message, unused by the template.
    reasoning_content: str | None = None
    refusal: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    # [{"type": "function", "function": {name, description, parameters}}] (server/tools.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | named
    parallel_tool_calls: bool | None = None  # None: true
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: NonNegInt | None = None
    add_generation_prompt: bool | None = True
    # vLLM's: leave the last (assistant) message open, a template of the request's own
    # (sandboxed Jinja, as the checkpoint's), more template variables
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /tokenize body: `prompt` text, or chat `messages` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: list[dict[str, Any]] | None = None  # given to the chat template with messages
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False  # as in ChatCompletionRequest
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------- responses


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens found in the prefix cache


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # --enable-prompt-tokens-details only (vLLM's flag): cache hits say what others sent
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended it


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # --reasoning-parser


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # OpenAI's streamed calls: {index, id, type, function: {name, arguments: ""}} first,
    # then {index, function: {arguments: fragment}}
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    owned_by: str = "ksana-jax"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo
