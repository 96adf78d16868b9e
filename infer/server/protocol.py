"""OpenAI wire format: request bodies (validated by pydantic), responses, and OpenAI-shaped errors.

Request models keep OpenAI's field names and defaults, plus the vLLM extensions (top_k, min_p, min_tokens,
ignore_eos, priority) that clients pass through `extra_body`. Unknown fields are ignored, as vLLM and
OpenAI's own server do for forward compatibility. Responses are plain dicts built by the handlers: the
shapes are documented here once, and the official `openai` client parses them in the tests.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # as vLLM's default --max-logprobs
MAX_N = 128


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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: int = 0  # vLLM: 0 or -1 = off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0  # vLLM: lower is served first; only with --scheduling-policy priority
    user: str | None = None  # accepted and ignored
    presence_penalty: float = 0.0  # accepted; only 0 is supported
    frequency_penalty: float = 0.0


PromptType = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... reach the template untouched

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # deprecated by OpenAI, still sent by clients
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True  # vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension, e.g. {"enable_thinking": False}
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }
