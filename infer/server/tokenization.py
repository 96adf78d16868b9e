"""POST /tokenize and POST /detokenize, with vLLM's request and response shapes.

    /tokenize    {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}
                 (+ "token_strs" with return_token_strs)
    /detokenize  {"tokens": [ids]} -> {"prompt": text}

Benchmark clients use them: `vllm bench serve` calls /tokenize to size its prompts and warns when it is
missing. The ids are exactly those a completion (`prompt`) or chat completion (`messages`) would run on,
through the same tokenizer and chat template. A prompt longer than the context is still counted (the
count is what a client wants to know); the body size limit bounds the work. Both sit behind --api-key.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from infer.server.chat import render_chat
from infer.server.protocol import DetokenizeRequest, TokenizeRequest, bad_request
from infer.server.server_state import ServerState, model_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    state = await model_state(request, body.model)
    state.check_open(task=None)
    token_ids = await asyncio.to_thread(_tokenize, state, body)  # templates and tokenizing: CPU work
    result = {"count": len(token_ids), "max_model_len": state.llm.max_model_len, "tokens": token_ids}
    if body.return_token_strs:
        tokenizer = state.llm.tokenizer
        result["token_strs"] = [tokenizer.id_to_token(t) for t in token_ids]
    return JSONResponse(result)


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    if body.messages is not None:
        text, add_special_tokens = render_chat(state, body), bool(body.add_special_tokens)
    else:
        text, add_special_tokens = body.prompt, body.add_special_tokens is not False
    return state.llm.tokenizer.encode(text, add_special_tokens=add_special_tokens)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    state = await model_state(request, body.model)
    state.check_open(task=None)
    vocab = state.llm.model_config.vocab_size
    if bad := [t for t in body.tokens if t >= vocab]:
        raise bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
    # as vLLM: special tokens stay in the text, so that tokenize(detokenize(ids)) can give the ids back
    text = await asyncio.to_thread(state.llm.tokenizer.decode, body.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})
