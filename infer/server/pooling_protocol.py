"""Request bodies of a pooling model's endpoints, with vLLM's fields and OpenAI's: POST /v1/embeddings
(OpenAI's), /score and /rerank (vLLM's, Jina's and Cohere's shapes). Validated at the edge like the
generation bodies of infer.server.protocol; the responses are dicts built by the handlers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from infer.server.protocol import ChatMessage, TokenId, _Request

# inputs of one request at most: a batch beyond this belongs in several requests
MAX_INPUTS = 2048
Texts = Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request and vLLM's extensions: truncate_prompt_tokens, add_special_tokens, and
    a chat (`messages`, rendered through the model's chat template, as vLLM's EmbeddingChatRequest: one
    embedding; add_special_tokens then defaults to off, the template writing them)."""

    model: str | None = None
    input: (
        str | Texts | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)] | None
    ) = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # only with --trust-request-chat-template, as in chat completions
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _input_or_messages(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError(
                "input: send either `input` (texts or token ids) or `messages` (a chat), not both"
            )
        return self


class _Scoring(_Request):
    model: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    use_activation: bool | None = None  # vLLM's: false returns a cross-encoder's logit, not its sigmoid


class ScoreRequest(_Scoring):
    """vLLM's /score: `text_1` against each of `text_2`, or pairwise (also spelt queries / documents)."""

    text_1: str | Texts | None = None
    text_2: str | Texts | None = None
    queries: str | Texts | None = None
    documents: str | Texts | None = None

    @model_validator(mode="after")
    def _one_spelling(self):
        first = [v for v in (self.text_1, self.queries) if v is not None]
        second = [v for v in (self.text_2, self.documents) if v is not None]
        if len(first) != 1 or len(second) != 1:
            raise ValueError("text_1: send text_1 and text_2 (or queries and documents), each once")
        self.text_1, self.text_2 = first[0], second[0]
        return self


class RerankRequest(_Scoring):
    """Jina's and Cohere's rerank request, as vLLM serves it on /rerank, /v1/rerank and /v2/rerank."""

    query: str
    documents: Texts
    top_n: Annotated[int, Field(ge=0)] | None = None  # 0 or none: every document
    return_documents: bool = True
