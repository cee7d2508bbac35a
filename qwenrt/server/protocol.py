"""Request bodies of the OpenAI endpoints (pydantic): types and ranges checked here, so a bad field is a 400 that
names it. Fields the OpenAI API has and qwenrt cannot honour are refused by name rather than ignored; unknown
fields are ignored, as vLLM does."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qwenrt.engine.core import MAX_LOGPROBS

MAX_CHOICES = 16
MAX_TOOLS = 128  # OpenAI's limit
TokenId = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    # strict: a bool is no number (the prompt `[true]` was token id 1), a string no bool ("yes" was true)
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields both endpoints share: which model, how many choices, how to sample, when to stop."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off (vLLM's -1 accepted)
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class FunctionDefinition(_Body):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    """A call in an earlier assistant turn; arguments as OpenAI sends them (a JSON string) or already an object."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: Annotated[str, Field(min_length=1)]
    arguments: str | dict[str, Any] | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of the conversation; extra keys (reasoning, name, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: legacy tool
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # the legacy form of one tool call
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatTemplateKwargs(_Body):
    enable_thinking: bool | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Annotated[list[FunctionDefinition], Field(max_length=MAX_TOOLS)] | None = None  # legacy tools
    function_call: Literal["none", "auto"] | NamedFunction | None = None  # legacy tool_choice
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] | \
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    # the legacy endpoint's default, as OpenAI and vLLM have it; 0 only with echo (lm-eval's log-likelihoods)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None  # vLLM takes it on completions too


class TokenizeRequest(_Body):
    """vLLM's POST /tokenize: a raw `prompt`, or chat `messages` rendered as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # accepted; qwenrt's prompts never get special tokens added
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


# ---- POST /v1/responses -----------------------------------------------------------------------------------------

class ResponseTool(_Body):
    """A Responses tool, flat (no `function` wrapper); types other than `function` are refused by name."""

    type: str
    name: Annotated[str, Field(min_length=1)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseNamedToolChoice(_Body):
    type: str
    name: str | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; no summaries are written


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow pydantic's method
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Body):
    """Input items stay plain objects here: responses_api checks each by its type, naming `input[i]`'s field."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: Annotated[list[ResponseTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # accepted; nothing is stored
    stream: bool = False
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # refused when given: qwenrt keeps no responses, runs nothing in the background, has no prompt store
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallInput(_Body):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str


class FunctionCallOutputInput(_Body):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[dict[str, Any]]


class ReasoningText(_Body):
    text: str


class ReasoningInput(_Body):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


class ClassificationRequest(_Body):
    """vLLM's POST /classify: one text or a list of them."""

    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]],
                                                            Field(min_length=1)]
    user: str | None = None
