"""POST /v1/embeddings: OpenAI's embeddings API (and vLLM's truncate_prompt_tokens, add_special_tokens, and
a chat's `messages` as the input).

    {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]}],
     "model": ..., "usage": {"prompt_tokens": N, "total_tokens": N}}

`encoding_format: "base64"` (what the openai client asks for by default) sends each vector as the
base64 of its little-endian float32 bytes. Tokenizing runs on a worker thread and the forwards on the
pooling engine's own (infer.engine.async_pooling): the event loop only parses and writes JSON.
"""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from infer.engine.pooling_inputs import embedding_inputs
from infer.server.chat import render_chat
from infer.server.pooling_protocol import EmbeddingRequest
from infer.server.protocol import bad_request, new_id
from infer.server.server_state import model_state

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state = await model_state(request, body.model)
    state.check_open("embed")
    if body.messages is not None:  # a chat: its prompt through the chat template, one embedding
        prompts = [await asyncio.to_thread(render_chat, state, body)]
    elif isinstance(body.input, str) or isinstance(body.input[0], int):
        prompts = [body.input]
    else:
        prompts = body.input
    special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
    try:
        inputs = await asyncio.to_thread(
            embedding_inputs, state.llm, prompts, body.truncate_prompt_tokens, body.dimensions, special
        )
    except ValueError as exc:
        raise bad_request(str(exc), param=param_of(str(exc), "input")) from exc
    outputs = await state.encode(inputs)
    num_tokens = sum(len(x.token_ids) for x in inputs)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(out, body.encoding_format)}
        for i, out in enumerate(outputs)
    ]
    return Response(
        orjson.dumps(
            {
                "id": new_id("embd"),
                "object": "list",
                "created": int(time.time()),
                "model": state.args.model_name,
                "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
            }
        ),
        media_type="application/json",
    )


def _encoded(embedding: list[float], encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


def param_of(message: str, default: str) -> str:
    """The request field a pooling ValueError is about, for the error's `param`."""
    for name in ("truncate_prompt_tokens", "dimensions", "text_1"):
        if name in message or (name == "dimensions" and "Matryoshka" in message):
            return name
    return default
