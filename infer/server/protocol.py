"""OpenAI wire format: request bodies (validated by pydantic), responses, and OpenAI-shaped errors.

Request models keep OpenAI's field names and defaults, plus the vLLM extensions (top_k, min_p, min_tokens,
ignore_eos, repetition_penalty, allowed_token_ids, bad_words, include_stop_str_in_output, skip_special_tokens,
spaces_between_special_tokens, return_token_ids, return_tokens_as_token_ids, structured_outputs, priority,
chat's continue_final_message and echo) and ours (ttft_slo_ms, tpot_slo_ms) that clients pass through
`extra_body`. Unknown fields are ignored and logged, as vLLM does, but for those of vLLM's and OpenAI's that
would change the output (request_params.check_fields: a 400). Everything a request can carry is bounded here,
at the edge, so that no value reaches the engine that could fail a step shared with other requests: ints fit
int64, floats are finite, and every string is valid Unicode (JSON may carry lone UTF-16 surrogates, which no
tokenizer can encode). Responses are plain dicts built by the handlers: the shapes are documented here once,
and the official `openai` client parses them in the tests."""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from infer.sampling_params import INT64_MAX, INT64_MIN, MAX_BAD_WORDS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from infer.server.tools import as_chat_tool_choice, as_chat_tools, check_tools, check_unique_names

MAX_LOGPROBS = 20  # as vLLM's default --max-logprobs
MAX_N = 128
# logit_bias / allowed_token_ids entries at most: as many as the largest vocabularies (262,144)
MAX_TOKEN_ID_LIST = 2**18
# `lt=INT64_END` rather than `le=INT64_MAX`: /openapi.json writes bounds as floats, and 2**63 - 1 would
# round up to 2**63, which a client reading the schema would then send and see refused.
INT64_END = INT64_MAX + 1
Int64 = Annotated[int, Field(ge=INT64_MIN, lt=INT64_END)]
TokenId = Annotated[int, Field(ge=0, lt=INT64_END)]


class APIError(Exception):
    """An error the client should see, as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


RETRY_AFTER_S = 1  # what a refused client is told to wait (the Retry-After header)


def overloaded(why: str, status: int = 429, code: str = "rate_limit_exceeded") -> APIError:
    """A refusal the client should retry: 429 (this server is busy) or 503 (it cannot serve now), with
    Retry-After, as OpenAI's API and vLLM answer."""
    kind = "rate_limit_error" if status == 429 else "service_unavailable"
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    return APIError(status, f"{why}; retry after {RETRY_AFTER_S}s", kind, code=code, headers=headers)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error (documented in /openapi.json; `APIError.body` builds it)."""

    error: ErrorDetail


# Every route's error answers in the schema, in place of FastAPI's 422 (which this server never sends).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "An OpenAI-shaped error: the request is at fault"},
    "5XX": {"model": ErrorResponse, "description": "An OpenAI-shaped error: loading, draining, or failed"},
}

# The 200 of the two generating routes: JSON, or with `stream: true` server-sent events ending in [DONE].
GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion; with `stream: true`, server-sent events ending in `data: [DONE]`",
        "content": {"text/event-stream": {}},
    }
}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_SCALARS = frozenset({int, float, bool, type(None)})  # hold no text: a 1,024-entry logit_bias costs ~0


def _check_unicode(value: Any, where: str = "body") -> None:
    """Every string, key or value, nested anywhere, must encode as UTF-8 (no lone surrogates)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{where} holds invalid Unicode (a lone surrogate at index {exc.start})"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                _check_unicode(key, where)
            if type(item) not in _SCALARS:
                _check_unicode(item, f"{where}.{key}" if isinstance(key, str) and key.isascii() else where)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if type(item) not in _SCALARS:
                _check_unicode(item, f"{where}[{i}]")
    elif isinstance(value, BaseModel):
        _check_unicode(value.__dict__, where)
        _check_unicode(value.__pydantic_extra__ or {}, where)


def _fields(model: BaseModel) -> dict:
    if not isinstance(model, BaseModel):
        raise TypeError(type(model).__name__)
    return {**model.__dict__, **(model.__pydantic_extra__ or {})}


def _all_unicode(model: BaseModel) -> bool:
    """Whether every string of the model encodes as UTF-8, told at once by the C JSON encoder: walking a
    body of 128 tools in Python takes milliseconds of the GIL that the engine thread shares. False also
    for what JSON cannot hold (the walk then answers)."""
    try:
        json.dumps(_fields(model), ensure_ascii=False, check_circular=False, default=_fields).encode()
    except (UnicodeEncodeError, TypeError, ValueError, RecursionError):
        return False
    return True


class _Request(BaseModel):
    # extras are kept (not validated) so that the handlers can name them: request_params.check_fields
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _valid_unicode(self):
        if _all_unicode(self):
            return self
        for name, value in self.__dict__.items():
            _check_unicode(value, name)
        # the extras too: they are kept, and a handler may read or log them (chat_template_kwargs reaches
        # a template); pydantic refuses a lone surrogate in a key of the body itself
        for name, value in (self.__pydantic_extra__ or {}).items():
            _check_unicode(value, name if name.isascii() else "body")
        return self


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far in every chunk


class StructuredOutputsBody(_Request):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): exactly one constraint. `json` is a JSON
    schema (an object, or its text). Its other options (whitespace_pattern, structural_tag) are refused."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # `json` would shadow BaseModel's
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class JsonSchemaFormat(_Request):
    """OpenAI's response_format.json_schema: `schema` is the JSON schema; name, description and strict are
    accepted (the output follows the schema strictly either way)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: free text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by completions, chat completions and responses. A field sent as null takes its
    default, as OpenAI's API reads null for its optional fields (`"temperature": null` is 1.0, not a 400)."""

    format_field: ClassVar[str] = "response_format"  # the field errors name for response_format

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None
        }

    model: str | None = None
    keep_alive: str | float | None = None  # Ollama's: with several models, how long this one stays loaded
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, lt=INT64_END)] = 0  # vLLM: 0 or -1 = off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Field(ge=0, lt=INT64_END)] = 0
    ignore_eos: bool = False
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: Int64 | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int64 = 0  # vLLM: lower is served first; only with --scheduling-policy priority
    # objectives for --scheduling-policy slo (extensions, like priority); None: the request's class's
    ttft_slo_ms: Annotated[float, Field(gt=0.0, le=1e9, allow_inf_nan=False)] | None = None
    tpot_slo_ms: Annotated[float, Field(gt=0.0, le=1e9, allow_inf_nan=False)] | None = None
    user: str | None = None  # accepted and ignored
    # OpenAI's: {token id (a string in JSON): bias}; ids checked against the vocabulary by the engine
    logit_bias: (
        Annotated[
            dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_TOKEN_ID_LIST)
        ]
        | None
    ) = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0  # vLLM's extension
    allowed_token_ids: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_ID_LIST)] | None = None  # vLLM's
    include_stop_str_in_output: bool = False  # vLLM's
    skip_special_tokens: bool = True  # vLLM's
    # vLLM's: false writes an added token after another without the decoder's space (special tokens shown)
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N", not by text
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None  # vLLM's
    # vLLM's: keep only N tokens of the prompt (-1: as many as the context allows), its last N by default
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, lt=INT64_END)] | None = None
    truncation_side: Literal["left", "right"] = "left"  # left: drop the prompt's start; right: its end
    # vLLM's: each prompt token's logprob, rank and top-N (not streamed, as in vLLM)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None  # OpenAI's; vLLM takes it on completions too
    structured_outputs: StructuredOutputsBody | None = None  # vLLM's


PromptType = str | list[int] | list[str] | list[list[int]]  # ids checked against the vocabulary


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt
    # OpenAI's default for completions; 0 only with echo (the prompt and its logprobs alone, as vLLM)
    max_tokens: Annotated[int, Field(ge=0, lt=INT64_END)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # name, tool_calls, ... reach the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, lt=INT64_END)] | None = None  # deprecated, still sent by clients
    max_completion_tokens: Annotated[int, Field(ge=1, lt=INT64_END)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True  # vLLM extension
    # vLLM's: the final message left open for the model to continue (with add_generation_prompt false)
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the reply starts with the last message's content when it has its role
    add_special_tokens: bool = False  # vLLM's: the template writes BOS; true adds the tokenizer's too
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension, e.g. {"enable_thinking": False}
    chat_template: str | None = None  # vLLM extension; only with --trust-request-chat-template
    tools: list[dict[str, Any]] | None = None
    # a named function or "required": the output is constrained to tool calls (infer.server.tools)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call under "required"

    @model_validator(mode="after")
    def _tools(self):
        check_tools(self.tools, self.tool_choice)
        return self


class TextFormat(_Request):
    """The Responses API's text.format: chat's response_format with the schema's fields in the format
    itself ({"type": "json_schema", "name": ..., "schema": {...}, "strict": true})."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted: a hint this server has no use for


RESPONSE_INCLUDES = Literal[
    "message.output_text.logprobs",  # the one acted on; the others name outputs this server never makes
    "reasoning.encrypted_content",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "web_search_call.action.sources",
]
MAX_METADATA = 16  # OpenAI's bound on metadata pairs


class ResponsesRequest(_SamplingFields):
    """POST /v1/responses: OpenAI's Responses API over the chat template. Function tools as chat's
    (infer.server.tools); reasoning options and background runs are refused. The sampling fields
    are chat's (vLLM's extensions included); chat's own output fields are refused: one output per
    request (n), text.format in place of response_format, truncation in place of truncate_prompt_tokens."""

    format_field: ClassVar[str] = "text.format"

    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, lt=INT64_END)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    include: list[RESPONSE_INCLUDES] | None = None
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA)] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    background: bool = False
    conversation: str | dict[str, Any] | None = None  # OpenAI's stored conversations: refused
    prompt: dict[str, Any] | None = None  # OpenAI's stored prompt templates: refused
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, as in chat completions

    @model_validator(mode="after")
    def _responses_fields(self):
        for name, instead in (
            ("response_format", "text.format"),
            ("truncate_prompt_tokens", 'truncation: "auto"'),
            ("stream_options", "nothing: a stream's last event holds the usage"),
            ("prompt_logprobs", "/v1/completions"),
            ("return_token_ids", "/v1/completions or /v1/chat/completions"),
            ("return_tokens_as_token_ids", "/v1/completions or /v1/chat/completions"),
        ):
            if getattr(self, name) not in (None, False):
                raise ValueError(f"{name} is not a Responses API field; use {instead}")
        if self.n != 1:
            raise ValueError("n: a response has one output; send several requests, or use chat completions")
        if self.tools is not None:
            check_unique_names([tool.get("name") for tool in self.tools])
            for i, tool in enumerate(self.tools):
                if tool.get("type") != "function":
                    raise ValueError(
                        f"tools[{i}]: tools of type {tool.get('type')!r} are not supported; this server "
                        'calls functions ({"type": "function", "name": ..., "parameters": {...}})'
                    )
        choice = None if self.tool_choice == "auto" and not self.tools else self.tool_choice  # the default
        try:
            check_tools(as_chat_tools(self.tools), as_chat_tool_choice(choice))
        except ValueError as exc:
            raise ValueError(str(exc).replace(".function.", ".")) from None
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise ValueError(
                "reasoning: effort and summaries are not supported; leave it out (a thinking model's "
                "thinking comes back as a reasoning item when the server runs with --reasoning-parser)"
            )
        if self.background:
            raise ValueError("background: responses run in the foreground here; stream it instead")
        if self.conversation is not None or self.prompt is not None:
            name = "conversation" if self.conversation is not None else "prompt"
            raise ValueError(f"{name}: this server keeps no {name}s; send the input, or previous_response_id")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_)
            self.response_format = ResponseFormat(type=fmt.type, json_schema=schema)
        return self


class TokenizeRequest(_Request):
    """POST /tokenize: vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`,
    rendered through the chat template) in one body, so that either is accepted and a body with both or
    neither gets one clear 400. `add_special_tokens` defaults as in vLLM: on for a prompt, off for messages
    (the template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as in chat completions
    return_token_strs: bool = False
    chat_template: str | None = None  # only with --trust-request-chat-template, as in chat completions
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either `prompt` (text) or `messages` (a chat), not both nor neither")
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize, as vLLM's: token ids back to text (special tokens kept as text)."""

    model: str | None = None
    tokens: list[TokenId]


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def new_id(prefix: str) -> str:
    """An id a client sees: 128 random bits (as vLLM's random_uuid), so that no id tells another: an id
    with a counter or a clock in it let one client count its way to another's stored response."""
    return f"{prefix}-{secrets.token_hex(16)}"
