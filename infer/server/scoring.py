"""POST /score (and /v1/score) and POST /rerank (/v1/rerank, /v2/rerank), as vLLM serves them.

/score pairs `text_1` with each of `text_2` (one text_1), or text_1[i] with text_2[i]:
    {"object": "list", "data": [{"object": "score", "index": 0, "score": 0.93}], "usage": {...}}
/rerank scores `query` against each of `documents` and returns them best first, `top_n` of them,
Jina's and Cohere's shape:
    {"results": [{"index": 1, "document": {"text": ...}, "relevance_score": 0.93}], "usage": {...}}

A cross-encoder scores each pair in one forward (its classifier, a sigmoid over one label); an embedding
model scores the cosine similarity of the two texts' embeddings (each distinct text embedded once).
"""

from __future__ import annotations

import asyncio
import time

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from infer.engine.pooling_inputs import ScoreJob, pair_up
from infer.server.embeddings import param_of
from infer.server.pooling_protocol import RerankRequest, ScoreRequest
from infer.server.protocol import bad_request, new_id
from infer.server.server_state import ServerState, model_state

router = APIRouter()


async def _score(state: ServerState, body, pairs_of) -> tuple[list[float], ScoreJob]:
    state.check_open("score")
    try:
        pairs = pair_up(*pairs_of(body))
        job = await asyncio.to_thread(
            ScoreJob.build, state.llm, pairs, body.truncate_prompt_tokens, body.use_activation
        )
    except ValueError as exc:
        raise bad_request(str(exc), param=param_of(str(exc), "text_1")) from exc
    outputs = await state.encode(job.inputs)
    return job.scores(outputs), job


def _json(body: dict) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


@router.post("/score")
@router.post("/v1/score")
async def create_score(body: ScoreRequest, request: Request) -> Response:
    state = await model_state(request, body.model)
    scores, job = await _score(state, body, lambda b: (b.text_1, b.text_2))
    num_tokens = job.num_prompt_tokens()
    return _json(
        {
            "id": new_id("score"),
            "object": "list",
            "created": int(time.time()),
            "model": state.args.model_name,
            "data": [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
        }
    )


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(body: RerankRequest, request: Request) -> Response:
    state = await model_state(request, body.model)
    scores, job = await _score(state, body, lambda b: (b.query, b.documents))
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    num_tokens = job.num_prompt_tokens()
    return _json(
        {
            "id": new_id("rerank"),
            "model": state.args.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            "results": results,
        }
    )
