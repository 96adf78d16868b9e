"""The FastAPI app: routes, OpenAI-shaped errors for everything (never FastAPI's 422), the API keys
(infer.server.auth).

    GET  /openapi.json         the OpenAPI schema: request bodies as the routes validate them, errors
    GET  /health               200 once the model is loaded (several models: once listening); 503 while
                               loading or draining
    GET  /metrics              Prometheus text (infer.server.metrics)
    GET  /v1/models            the one served model; with several (--models-dir), each with its status
    GET  /models, POST /models/load, /models/unload   with several models (infer.server.model_manager)
    POST /v1/completions       infer.server.completions
    POST /v1/chat/completions  infer.server.chat
    POST /v1/responses         infer.server.responses (and GET, DELETE /v1/responses/{id})
    POST /tokenize, /detokenize  vLLM's, infer.server.tokenization
    POST /v1/embeddings        a pooling model's: infer.server.embeddings
    POST /score, /rerank       (and /v1/score, /v1/rerank, /v2/rerank) infer.server.scoring
    GET  /debug/trace?seconds=S  the last S seconds of the engine trace (with --trace; infer.engine.trace)

The model loads in a thread started by the lifespan, so the server listens (and answers 503) meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from infer.server import chat, completions, embeddings, responses, scoring, tokenization
from infer.server.args import ServerArgs
from infer.server.auth import APIKeyMiddleware
from infer.server.model_manager import ModelLeases, ModelManager
from infer.server.model_manager import router as models_router
from infer.server.protocol import ERROR_RESPONSES, APIError, bad_request
from infer.server.request_body import RequestBody, is_json
from infer.server.server_state import ServerState, check_model

logger = logging.getLogger("infer.server")


def create_app(
    args: ServerArgs,
    on_ready: Callable[[ServerState], None] | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    state: ServerState | None = None,
) -> FastAPI:
    """on_ready runs once the engine is up; on_fatal if loading fails (the launcher then exits non-zero).
    state: a ServerState whose engine lives elsewhere (infer.deploy's replicas); default, this process's."""
    if state is None:
        state = ModelManager(args) if args.models is not None else ServerState(args)
    models = state if isinstance(state, ModelManager) else None
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(_load(state, on_ready, on_fatal))
        try:
            yield
        finally:
            loading.cancel()
            await asyncio.to_thread(state.shutdown)

    app = FastAPI(
        title="infer",
        lifespan=lifespan,
        docs_url=None,  # no Swagger UI: it would load scripts from a CDN
        redoc_url=None,
        openapi_url="/openapi.json",
        responses=ERROR_RESPONSES,
    )
    app.state.server = state
    app.state.models = models
    app.state.created = created
    if models is not None:
        app.include_router(models_router)
        app.add_middleware(ModelLeases)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses.router)
    app.state.responses = responses.ResponseStore(args.responses_store_mb * 2**20)
    app.include_router(tokenization.router)
    app.include_router(embeddings.router)
    app.include_router(scoring.router)
    _add_error_handlers(app)
    if args.api_key_owners:
        app.add_middleware(APIKeyMiddleware, owners=args.api_key_owners)
    app.add_middleware(RequestBody, max_bytes=args.max_request_bytes)
    # outermost: a preflight is answered before the API key is asked for, and errors carry the headers
    # too, so that a page can read them
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(args.allowed_origins),
        allow_methods=list(args.allowed_methods),
        allow_headers=list(args.allowed_headers),
        allow_credentials=args.allow_credentials,
    )

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return APIError(503, "draining: the server is shutting down", "service_unavailable").response()
        if not state.ready:
            return APIError(503, "the model is still loading", "service_unavailable").response()
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        body, content_type = state.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    def model_card() -> dict:
        card = {"id": args.model_name, "object": "model", "created": created, "owned_by": "infer",
                "root": _public_name(args.engine.model or "embedded"), "parent": None}  # fmt: skip
        if state.ready:
            card["max_model_len"] = state.llm.max_model_len
            card["task"] = state.task  # generate, embed (an embedding model) or classify (a cross-encoder)
        return card

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        """The effective configuration (as vLLM's dev route), so benchmark reports can record it."""
        server = dataclasses.asdict(args)
        engine = server.pop("engine")
        server.pop("api_key_owners")
        info = {"engine": engine, "server": server}
        if models is not None:
            info["models"] = models.cards(created)
        elif state.ready and state.pooling is not None:
            info["task"], info["max_model_len"] = state.task, state.llm.max_model_len
            info["dtype"] = str(state.llm.dtype).removeprefix("torch.")
        elif state.ready:
            info["kv_capacity_tokens"] = state.llm.kv_capacity_tokens
            info["max_model_len"] = state.llm.max_model_len
            info["dtype"] = str(state.llm.runner.dtype).removeprefix("torch.")  # what `auto` resolved to
            info["kv_cache_dtype"] = str(state.llm.kv_cache_dtype).removeprefix("torch.")
            info["quantization"] = state.llm.quantization
        return JSONResponse(info)

    @app.get("/debug/trace")
    async def debug_trace(
        seconds: Annotated[float | None, Query(gt=0, allow_inf_nan=False)] = None,
    ) -> Response:
        """The engine trace's last `seconds` (all that its ring holds without), as Chrome trace-event JSON
        (`{"traceEvents": [...]}`), to see what just happened without a restart."""
        if args.engine.trace_path is None:
            raise APIError(
                404, "the engine trace is off: start the server with --trace FILE", "not_found_error"
            )
        if not state.ready:
            raise APIError(503, "the model is still loading", "service_unavailable")
        trace = state.llm.trace
        since = None if seconds is None else trace.now_us() - seconds * 1e6
        body = await asyncio.to_thread(trace.dumps, since)  # up to the whole ring: off the event loop
        return Response(body, media_type="application/json")

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = models.cards(created) if models is not None else [model_card()]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if models is not None:
            return JSONResponse(models.card(models.entry(model), created))
        check_model(state, model)
        return JSONResponse(model_card())

    return app


def _public_name(model: str) -> str:
    """A local folder by its name alone: clients need not learn the server's file system."""
    return Path(model).name if Path(model).exists() else model


async def _load(state: ServerState, on_ready, on_fatal) -> None:
    try:
        await state.load(on_fatal)
    except Exception as exc:
        logger.error("could not load the model: %s: %s", type(exc).__name__, exc)
        if on_fatal is not None:
            on_fatal(exc)
        return
    if on_ready is not None:
        on_ready(state)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        if not is_json(content_type) and any(e.get("loc") == ("body",) for e in exc.errors()):
            # FastAPI leaves such a body unparsed, and pydantic would only say "not a dictionary"
            got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            message = f"send the body as JSON with Content-Type: application/json (got {got})"
            return bad_request(message).response()
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = exc.detail
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's "error parsing the body"
            detail = _unparsable_body(exc.__cause__)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {detail}", kind).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)  # the details stay in the log
        return APIError(500, "internal error; see the server log", "server_error").response()


def _unparsable_body(cause: BaseException) -> str:
    """Why json.loads failed on a body, where FastAPI says only "There was an error parsing the body"."""
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"the body is not valid UTF-8 (byte {cause.object[cause.start]:#04x} at offset {cause.start}); "
            "send JSON encoded as UTF-8"
        )
    if isinstance(cause, RecursionError):
        return "the body is not valid JSON: nested too deeply"
    if isinstance(cause, ValueError):  # e.g. a number of more than 4300 digits
        return f"the body is not valid JSON: {str(cause).split(';')[0]}"
    return "the body could not be parsed as JSON"


def validation_error(errors) -> APIError:
    """pydantic's error list as one readable 400: 'messages.0.role: Field required; ...'."""
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query")]
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        if err.get("type") == "missing" and not loc:
            parts.append("the body is empty: send a JSON object")
            continue
        if err.get("type") == "value_error" and not loc:  # a check of the whole request, named by its field
            message = str(err.get("ctx", {}).get("error", err.get("msg")))
            field = re.split(r"[\s:\[.]", message, maxsplit=1)[0]
            if isinstance(err.get("input"), dict) and field in err["input"]:
                param = param or field
            parts.append(message)
            continue
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return APIError(400, "; ".join(parts) or "invalid request", param=param)
