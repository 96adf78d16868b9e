"""What completions and chat share: the server's state, admission (503 / 429), running the engine requests
of one HTTP request together, disconnect watching, sampling parameters and logprobs.

Lifetime of one HTTP request:

    admit(k)                 503 while loading or draining; 429 when the queue would exceed its bound
    Fanout(k jobs)           one asyncio task per engine request ("choice"), outputs merged into a queue
    accepted()               wait until the engine has accepted every choice: a refusal is still a 400
                             (not their first tokens: choices beyond the free seats would hold back the
                             stream's first byte until earlier choices finished)
    stream / collect         SSE chunks, or the whole response; a disconnect cancels the tasks, and the
                             engine generator closing aborts the request (its blocks go back to the pool)
    done                     each task's done-callback (which runs even for a task cancelled before it
                             started): the request no longer counts as in flight

Only this module touches `num_in_flight`, so the drain on SIGTERM can wait for it to reach 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from infer.core.slo import LateRequest, Objectives
from infer.engine.async_engine import AsyncEngine, CompileQueueFull, RequestFailed
from infer.engine.async_pooling import AsyncPoolingEngine
from infer.engine.llm_engine import StepOutput
from infer.engine.pooling import PoolingEngine, model_task
from infer.sampling_params import INT64_MIN, SamplingParams, StructuredOutputs, Unsatisfiable
from infer.server.args import ServerArgs
from infer.server.metrics import MeteredEngine, Metrics
from infer.server.protocol import APIError, bad_request
from infer.server.tools import tool_schema

logger = logging.getLogger("infer.server")
RETRY_AFTER_S = 1
LEASES_KEY = "infer.model_leases"  # in the ASGI scope: the models a request holds until its response is sent
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


class ServerState:
    """The engine plus the HTTP side's own counters. Lives on the event loop; never mutates the engine."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.metrics = Metrics(args.model_name)
        self.engine: AsyncEngine | None = None
        # a pooling model's engine instead (infer.engine.pooling), and what it serves: "embed" / "classify"
        self.pooling: AsyncPoolingEngine | None = None
        self.task = "generate"
        self.ready = False
        self.draining = False
        self.num_in_flight = 0  # engine requests admitted and not yet finished
        self.fanouts: set[Fanout] = set()
        # One token's text, decoded once: a prompt_logprobs response names ~20 tokens a prompt position,
        # mostly the same ones; bounded by the vocabulary.
        self.token_texts: dict[int, str] = {}
        # capture the decode graphs before serving; off where a request waits for the load (several models:
        # the graphs are then captured as batch sizes recur)
        self.warm_up = True

    async def load(self, on_fatal=None) -> None:
        """Load the model off the event loop (so /health can answer 503 meanwhile): on the engine thread,
        where it will run (see infer.engine.async_engine on why torch keeps to one thread). `on_fatal`:
        the engine stopped for good after loading (a tensor-parallel rank died)."""

        def fatal(exc: BaseException) -> None:
            self.ready = False  # /health answers 503 until the server is gone
            if on_fatal is not None:
                on_fatal(exc)

        def build() -> MeteredEngine:
            engine = MeteredEngine(self.args.engine, self.metrics)
            if self.warm_up:
                engine.warm_up()  # decode graphs and a frozen heap, before /health says ready
            return engine

        task = await asyncio.to_thread(model_task, self.args.engine)
        if task is not None:
            self.pooling = AsyncPoolingEngine(factory=lambda: PoolingEngine(self.args.engine))
            self.pooling.start()
            await self.pooling.ready()
            self.task, self.ready = task, True
            return
        engine = AsyncEngine(factory=build, on_fatal=fatal)
        engine.start()
        await engine.ready()
        self.engine = engine
        self.metrics.engine = engine.engine
        self.ready = True

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self.pooling is not None:
            self.pooling.shutdown()

    @property
    def llm(self) -> MeteredEngine:
        """The engine (a PoolingEngine for a pooling model: its tokenizer, model_config, max_model_len)."""
        return self.pooling.engine if self.pooling is not None else self.engine.engine

    @property
    def max_request_len(self) -> int:
        """Prompt + max_tokens that the engine will accept: the context, the KV pool, and with chunked
        prefill off the step budget (a preempted request recomputes all of it in one step)."""
        llm = self.llm
        limit = min(llm.max_model_len, llm.scheduler.kv_cache_manager.max_request_tokens + 1)
        if not llm.scheduler_config.enable_chunked_prefill:
            limit = min(limit, llm.scheduler_config.max_num_batched_tokens + 1)
        return limit

    def check_open(self, task: str | None = "generate") -> None:
        """503 while the model loads or the server drains; 400 for a `task` ("generate", "embed", "score")
        the served model does not do, naming the endpoints that it serves."""
        if self.draining:
            raise APIError(
                503, "the server is shutting down and admits no new requests", "service_unavailable"
            )
        if not self.ready:
            raise APIError(
                503, "the model is still loading; retry when GET /health answers 200", "service_unavailable"
            )
        if task is not None and task not in TASK_ENDPOINTS[self.task][0]:
            model = self.args.model_name
            raise bad_request(f"The model `{model}` {TASK_ENDPOINTS[self.task][1]}", param="model")

    def check_admissible(self, num_requests: int) -> None:
        """400 for more engine requests than are ever admitted at once: a retry could never succeed (not a
        429). Cheap, so that a huge batch is refused before it is tokenized."""
        max_num_seqs, max_queued = self.llm.scheduler_config.max_num_seqs, self.args.max_queued_requests
        if num_requests > max_num_seqs + max_queued:
            raise bad_request(
                f"this request needs {num_requests} sequences (prompts x n) but the server admits at most "
                f"{max_num_seqs + max_queued} at once (--max-num-seqs {max_num_seqs} + --max-queued-requests "
                f"{max_queued}); send fewer prompts or a smaller n",
                param="n",
            )

    def fits(self, num_prompt: int, max_tokens: int) -> bool:
        return num_prompt + max_tokens <= self.max_request_len

    def admit(self, num_requests: int, fits: bool = True) -> None:
        """Count num_requests engine requests as in flight, or refuse them all (429).

        Waiting = in flight beyond the max_num_seqs batch slots, counted here rather than read from the
        scheduler, so that it is exact at once (the engine takes new requests only between steps). When
        the KV pool rather than the slots limits the batch, the engine's queue can be longer by up to
        max_num_seqs - num_running.

        A request that does not fit (`fits` False) passes the queue bound: the engine refuses it at once
        with the numbers (a 400), where a 429 would have its client retry, in vain, for as long as the
        server stays busy."""
        self.check_open()
        self.check_admissible(num_requests)
        max_num_seqs, max_queued = self.llm.scheduler_config.max_num_seqs, self.args.max_queued_requests
        num_waiting = self.num_in_flight + num_requests - max_num_seqs
        if num_waiting > max_queued and fits:
            raise APIError(
                429,
                f"server overloaded: {self.num_in_flight} requests in flight and this one would make "
                f"{num_waiting} wait, beyond --max-queued-requests {max_queued}; "
                f"retry after {RETRY_AFTER_S}s",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.num_in_flight += num_requests

    @contextlib.contextmanager
    def pooling_admission(self, num_inputs: int):
        """Count a pooling request as in flight (the drain waits for it) while it runs, or refuse it (429)
        when the inputs already waiting exceed --max-num-seqs + --max-queued-requests."""
        self.check_open(task=None)
        bound = self.args.engine.max_num_seqs + self.args.max_queued_requests
        waiting = self.pooling.num_waiting
        if waiting and waiting + num_inputs > bound:
            raise APIError(
                429,
                f"server overloaded: {waiting} inputs are waiting to be embedded or scored and this request "
                f"would make {waiting + num_inputs}, beyond {bound}; retry after {RETRY_AFTER_S}s",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1

    def abort_all(self) -> None:
        """End every running choice with finish_reason "abort" (the drain timed out)."""
        for fanout in list(self.fanouts):
            fanout.close()


# what the served model does -> (the tasks it serves, what a request for another one is told)
TASK_ENDPOINTS = {
    "generate": (
        ("generate",),
        "generates text: use POST /v1/completions or /v1/chat/completions. Embeddings and scores need an "
        "embedding model or a cross-encoder (a decoder embedder is served with --runner pooling)",
    ),
    "embed": (
        ("embed", "score"),
        "is an embedding model: it does not generate text. Use POST /v1/embeddings, or /score and /rerank "
        "for the cosine similarity of two texts",
    ),
    "classify": (
        ("score",),
        "is a cross-encoder (a reranker): it scores pairs of texts. Use POST /score or /rerank; it neither "
        "generates text nor embeds",
    ),
}


def new_id(prefix: str) -> str:
    """An id a client sees: 128 random bits (as vLLM's random_uuid), so that no id tells another: an id
    with a counter or a clock in it let one client count its way to another's stored response."""
    return f"{prefix}-{secrets.token_hex(16)}"


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.args.model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves "
            f"`{state.args.model_name}` (see GET /v1/models)",
            param="model",
            code="model_not_found",
        )


async def model_state(request: Request, model: str | None, keep_alive=None) -> ServerState:
    """The state that serves `model`: the server's one (404 for another name), or, with several models,
    that model's, loaded if it was not and held until the response is sent (infer.server.model_manager)."""
    models = getattr(request.app.state, "models", None)
    if models is None:
        state = request.app.state.server
        check_model(state, model)
        return state
    return await models.acquire(model, keep_alive, request.scope.setdefault(LEASES_KEY, []))


# vLLM's and OpenAI's request fields that would change what is generated or returned, which this server
# does not implement, with the value it acts on anyway: sent with another value, they are refused (400)
# rather than ignored.
UNSUPPORTED_FIELDS: dict[str, object] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "logits_processors": None,
    "prediction": None,
    "audio": None,
}


def check_fields(body) -> None:
    """400 for an UNSUPPORTED_FIELDS field sent with another value than this server acts on; other
    unknown fields are ignored, and logged (as vLLM does: forward compatibility)."""
    extra = [(name, name, value) for name, value in (body.model_extra or {}).items()]
    if body.stream_options is not None:
        nested = body.stream_options.model_extra or {}
        extra += [(f"stream_options.{name}", name, value) for name, value in nested.items()]
    ignored = []
    for shown, name, value in extra:
        if name not in UNSUPPORTED_FIELDS:
            ignored.append(shown)
        elif value not in (UNSUPPORTED_FIELDS[name], None, [], {}):
            raise bad_request(f"{shown} is not supported by this server; leave it out", param=shown)
    if ignored:
        logger.warning("request fields ignored (unknown to this server): %r", sorted(ignored)[:20])


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    slo: Objectives | None = None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The n choices of one prompt: with a seed, choice j samples with seed + j (as vLLM), so the choices
    differ and the whole response is still reproducible; wrapped around within int64."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index - INT64_MIN) % 2**64 + INT64_MIN
    return dataclasses.replace(params, seed=seed)


_ABORTED = object()
_ACCEPTED = object()


class Fanout:
    """The engine requests of one HTTP request (prompts x n), run as concurrent tasks whose outputs are
    merged in arrival order, tagged with the job's index. `close()` cancels the tasks: each engine
    generator then closes, which aborts its request; the choice ends with finish_reason "abort"."""

    def __init__(self, state: ServerState, jobs: list[Job], prefix: str, arrival: float):
        self.state = state
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending: list[tuple[int, object]] = []  # taken by accepted(), to be yielded first
        self.num_open = len(jobs)
        self.last: dict[int, StepOutput] = {}
        self.req_ids = [f"{prefix}-{i}" for i in range(len(jobs))]
        self.group_id = prefix if len(jobs) > 1 else None  # its n choices share the batch fairly
        for req_id in self.req_ids:
            state.metrics.note_arrival(req_id, arrival)
        self.tasks = []
        for index, job in enumerate(jobs):
            task = asyncio.create_task(self._pump(index, job))
            task.add_done_callback(functools.partial(self._done, index))  # runs even if never started
            self.tasks.append(task)
        state.fanouts.add(self)

    async def _pump(self, index: int, job: Job) -> None:
        try:
            outputs = await self.state.engine.add(
                job.prompt_ids, job.params, self.req_ids[index], job.priority, job.slo, self.group_id
            )
            self.queue.put_nowait((index, _ACCEPTED))
            async with aclosing(outputs):
                async for out in outputs:
                    self.queue.put_nowait((index, out))
        except Exception as exc:  # ValueError: refused by the engine; RequestFailed: the engine failed it
            self.queue.put_nowait((index, exc))

    def _done(self, index: int, task: asyncio.Task) -> None:
        self.state.num_in_flight -= 1
        self.state.metrics.forget(self.req_ids[index])
        if task.cancelled():
            self.queue.put_nowait((index, _ABORTED))

    async def _next(self) -> tuple[int, StepOutput]:
        index, out = self.pending.pop(0) if self.pending else await self.queue.get()
        while out is _ACCEPTED:
            index, out = self.pending.pop(0) if self.pending else await self.queue.get()
        if out is _ABORTED:
            last = self.last.get(index)
            out = StepOutput(
                req_id=self.req_ids[index],
                text="",
                token_ids=[],
                finished=True,
                finish_reason="abort",
                num_prompt_tokens=last.num_prompt_tokens if last else 0,
                num_output_tokens=last.num_output_tokens if last else 0,
                num_cached_tokens=last.num_cached_tokens if last else 0,
            )
        elif isinstance(out, Exception):
            self.close()
            raise out
        return index, out

    async def accepted(self) -> bool:
        """Wait until the engine accepted every job, so that a refusal is known before a stream's 200;
        outputs that came meanwhile are kept for `outputs`. Raises the first refusal."""
        accepted, taken = set(), []
        while len(accepted) < len(self.tasks):
            index, out = await self.queue.get()
            if isinstance(out, Exception):
                self.close()
                raise out
            if out is _ACCEPTED or out is _ABORTED:  # an abort: the job was accepted, then cancelled
                accepted.add(index)
            if out is not _ACCEPTED:
                taken.append((index, out))
        self.pending = taken
        return True

    async def outputs(self) -> AsyncIterator[tuple[int, StepOutput]]:
        """(index, output) until every job finished; raises the first job's error (ValueError = 400)."""
        done: set[int] = set()
        try:
            while self.num_open:
                index, out = await self._next()
                if index in done:  # an abort marker that raced with the job's own last output
                    continue
                self.last[index] = out
                if out.finished:
                    done.add(index)
                    self.num_open -= 1
                yield index, out
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the jobs still running (synchronous: safe inside an already cancelled scope)."""
        for task in self.tasks:
            if not task.done():
                task.cancel()
        self.state.fanouts.discard(self)


class FanoutStream(StreamingResponse):
    """An SSE response that closes its Fanout however it ends: also when the client left before the body
    iterator even started (an unstarted generator runs no `finally`), so nothing generates for nobody."""

    def __init__(self, body: AsyncIterator[str], fanout: Fanout):
        super().__init__(body, media_type="text/event-stream")
        self.fanout = fanout

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.fanout.close()


async def cancel_on_disconnect(request: Request, coro):
    """Run coro; if the client disconnects first, cancel it (aborting its engine requests) and return None.

    The request body has been read, so the next ASGI message can only be `http.disconnect`."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            logger.info("client disconnected: request aborted")
    return work.result() if not work.cancelled() else None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def start_stream(request: Request, fanout: Fanout, param: str) -> bool:
    """Wait for every choice's first output; False if the client left meanwhile. Refusals raise 400."""
    try:
        started = await cancel_on_disconnect(request, fanout.accepted())
    except BaseException as exc:
        fanout.close()
        if isinstance(exc, ValueError | RuntimeError):
            raise engine_error(exc, param) from exc
        raise
    if started is None:
        fanout.close()
    return bool(started)


async def answer(request: Request, fanout: Fanout, handler, stream: bool, param: str) -> Response:
    """The HTTP answer of one request's Fanout: handler.stream(fanout) as server-sent events once every
    choice is accepted (a refusal is still a 400 naming `param`), or handler.collect(fanout) as one JSON
    body; 499 when the client left first (its requests are aborted)."""
    if stream:
        if not await start_stream(request, fanout, param):
            return Response(status_code=499)
        return FanoutStream(handler.stream(fanout), fanout)
    try:
        result = await cancel_on_disconnect(request, handler.collect(fanout))
    finally:
        fanout.close()  # also when the collecting task was cancelled before it started
    if result is None:
        return Response(status_code=499)
    if _has_prompt_logprobs(result):  # megabytes of JSON: written off the event loop, whose streams go on
        return Response(await asyncio.to_thread(json_body, result), media_type="application/json")
    return Response(json_body(result), media_type="application/json")


def _has_prompt_logprobs(result: dict) -> bool:
    return "prompt_logprobs" in result or any("prompt_logprobs" in c for c in result.get("choices", ()))


def json_body(payload: dict) -> bytes:
    """A JSON body, as JSONResponse writes it (compact, UTF-8) but with orjson, ~10x faster; what orjson
    refuses (a lone surrogate) goes to json.dumps, as in sse()."""
    try:
        return orjson.dumps(payload)
    except orjson.JSONEncodeError:
        return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


# the engine checks their token ids against the vocabulary (bad_words: that they tokenize)
_VOCAB_CHECKED = ("stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words")


def engine_error(exc: Exception, param: str) -> APIError:
    """A refusal (ValueError, with the numbers) is the client's 400; a request the engine failed is our
    500, whose body names the request but no internals (the log has the exception)."""
    if isinstance(exc, LateRequest):  # --slo-reject-late: the server's load, not the request, is the cause
        return APIError(429, str(exc), "rate_limit_error", code="slo_unattainable")
    if isinstance(exc, CompileQueueFull):
        return grammars_busy(exc)
    if isinstance(exc, ValueError):
        message = str(exc)
        code = "context_length_exceeded" if "max_model_len" in message or "KV" in message else None
        field = message.split(" ", 1)[0]  # the engine names a sampling field it checked first
        return bad_request(message, param=field if field in _VOCAB_CHECKED else param, code=code)
    unsatisfiable = f"{Unsatisfiable.__name__}: "
    if isinstance(exc, RequestFailed) and (exc.detail or "").startswith(unsatisfiable):
        return bad_request(exc.detail.removeprefix(unsatisfiable))  # the request's own parameters
    if isinstance(exc, RequestFailed):
        logger.error("%s: %s", exc, exc.detail)
        return APIError(500, f"internal error: {exc}; see the server log", "server_error")
    logger.error("engine failure: %s: %s", type(exc).__name__, exc)
    return APIError(500, "internal error; see the server log", "server_error")


def sampling_params(
    body, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    """SamplingParams from the fields shared by both endpoints; its ValueError becomes a 400."""
    try:
        return SamplingParams(
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            min_p=body.min_p,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            stop_token_ids=list(body.stop_token_ids or []),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            allowed_token_ids=body.allowed_token_ids,
            logit_bias=body.logit_bias or {},
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            structured_outputs=structured_outputs(body),
            bad_words=body.bad_words or [],
        )
    except ValueError as exc:  # its messages start with the field's name
        field = str(exc).split(" ", 1)[0].rstrip(":")
        known = field in type(body).model_fields or field in GUIDED_FIELDS or field == body.format_field
        raise bad_request(str(exc), param=field if known else None) from exc


# vLLM's request fields before `structured_outputs` replaced them (vLLM 0.11), still sent by older clients
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


OPTIONS = ("disable_any_whitespace", "disable_additional_properties")


def _constraints(body) -> tuple[list[tuple[str, dict]], dict]:
    """(field, StructuredOutputs arguments) of each field of the body that constrains the output, and
    structured_outputs' options, which apply to a response_format's constraint too (as in vLLM)."""
    found = []
    rf, rf_field = body.response_format, body.format_field
    if rf is not None and rf.type == "json_object":
        found.append((rf_field, {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            where = "schema" if rf_field == "text.format" else "json_schema.schema"
            raise ValueError(f"{rf_field} of type json_schema needs {where} (a JSON schema)")
        found.append((rf_field, {"json": rf.json_schema.schema_}))
    if getattr(body, "tools", None) is not None and (schema := tool_schema(body)) is not None:
        found.append(("tool_choice", {"json": schema}))
    so, options = body.structured_outputs, {}
    if so is not None:
        if so.model_extra:
            name = sorted(so.model_extra)[0]
            raise ValueError(f"structured_outputs {name!r} is not supported by this server; leave it out")
        fields = so.model_dump(exclude_none=True)
        options = {name: fields.pop(name) for name in OPTIONS}
        if "json_schema" in fields:
            fields["json"] = fields.pop("json_schema")
        if fields:
            found.append(("structured_outputs", fields))
    extra = body.model_extra or {}
    found += [
        (name, {kind: extra[name]}) for name, kind in GUIDED_FIELDS.items() if extra.get(name) is not None
    ]
    return found, options


def structured_outputs(body) -> StructuredOutputs | None:
    """The request's output constraint: from response_format, structured_outputs or a guided_* field, at
    most one of them (ValueError, its message starting with the field, otherwise). structured_outputs'
    options without a constraint to apply to (tool_choice "none", say) apply to nothing: free text."""
    found, options = _constraints(body)
    if len(found) > 1:
        raise ValueError(f"{found[0][0]} and {found[1][0]} both constrain the output; send one of them")
    if not found:
        return None
    name, fields = found[0]
    try:
        return StructuredOutputs(**fields, **options)
    except (TypeError, ValueError) as exc:
        raise ValueError(_named(name, str(exc))) from None


def _named(field: str, message: str) -> str:
    """A StructuredOutputs message ("structured_outputs regex ...") as the request field's."""
    return (
        message
        if field == "structured_outputs"
        else f"{field}: {message.removeprefix('structured_outputs ')}"
    )


async def check_grammar(state: ServerState, body, params: SamplingParams) -> None:
    """Await the request's grammar, compiled on the compiler's own threads (infer.runner.compile_pool):
    400 naming its field if it does not compile, 429 if too many distinct grammars are compiling."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.wrap_future(state.llm.grammars.compiled(params.structured_outputs))
    except CompileQueueFull as exc:
        raise grammars_busy(exc) from exc
    except ValueError as exc:
        field = _constraints(body)[0][0][0]
        raise bad_request(_named(field, str(exc)), param=field) from exc


def grammars_busy(exc: CompileQueueFull) -> APIError:
    return APIError(
        429,
        f"server overloaded: {exc}; retry after {RETRY_AFTER_S}s",
        "rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def objectives(state: ServerState, body) -> Objectives | None:
    """The request's own TTFT / TPOT objectives (seconds); None: its class's, if the server has classes.
    400 unless the server schedules by them."""
    if body.ttft_slo_ms is None and body.tpot_slo_ms is None:
        return None
    if state.llm.scheduler_config.policy != "slo":
        raise bad_request(
            f"ttft_slo_ms and tpot_slo_ms need --scheduling-policy slo (this server runs "
            f"{state.llm.scheduler_config.policy!r}); leave them out",
            param="ttft_slo_ms" if body.ttft_slo_ms is not None else "tpot_slo_ms",
        )
    return Objectives.from_ms(body.ttft_slo_ms, body.tpot_slo_ms)


def check_priority(state: ServerState, priority: int) -> None:
    if priority != 0 and state.llm.scheduler_config.policy != "priority":
        raise bad_request(
            f"priority {priority} needs --scheduling-policy priority (this server runs "
            f"{state.llm.scheduler_config.policy!r}); send priority 0",
            param="priority",
        )


def truncated(state: ServerState, body, prompt_ids: list[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last (truncation_side "left") or first N tokens; -1
    keeps as many as the context holds with one token to generate."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    limit = state.max_request_len
    if keep == -1:
        keep = limit - 1
    if keep > limit:
        raise bad_request(
            f"truncate_prompt_tokens ({keep}) cannot exceed the context ({limit} tokens)",
            param="truncate_prompt_tokens",
        )
    if keep == 0:
        raise bad_request("truncate_prompt_tokens 0 would leave no prompt", param="truncate_prompt_tokens")
    return prompt_ids[-keep:] if body.truncation_side == "left" else prompt_ids[:keep]


def continuous_usage(body) -> bool:
    opts = body.stream_options
    return bool(opts and opts.include_usage and opts.continuous_usage_stats)


def check_prompt_logprobs(state: ServerState, body) -> None:
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request(
            "prompt_logprobs are not streamed (as in vLLM): send stream false", param="prompt_logprobs"
        )
    if body.prompt_logprobs is not None and state.llm.config.tensor_parallel_size > 1:
        raise bad_request("prompt_logprobs are not served under tensor parallelism", param="prompt_logprobs")


def prompt_logprobs_of(outputs) -> list | None:
    """The prompt logprobs among a request's outputs (the engine attaches them to one), or None."""
    return next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)


def prompt_logprobs_json(state: ServerState, entries: list | None) -> list | None:
    """vLLM's shape: per prompt token, None for the first, then {token id: {logprob, rank,
    decoded_token}} for the token itself and the top-N (rank: 1 is the likeliest)."""
    if entries is None:
        return None
    out: list = [None]
    for entry in entries[1:]:
        if entry is None:  # a request aborted before its prompt was computed
            out.append(None)
            continue
        token_id, logprob, rank, top = entry
        row = {str(token_id): _logprob(state, token_id, logprob, rank)}
        for i, (alt, value) in enumerate(top, start=1):
            row.setdefault(str(alt), _logprob(state, alt, value, i))
        out.append(row)
    return out


def _logprob(state: ServerState, token_id: int, logprob: float, rank: int) -> dict:
    return {"logprob": floor_logprob(logprob), "rank": rank, "decoded_token": token_text(state, token_id)}


def floor_logprob(value: float) -> float:
    return value if value == value and value > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN and -inf too


def token_text(state: ServerState, token_id: int) -> str:
    text = state.token_texts.get(token_id)
    if text is None:
        text = state.token_texts[token_id] = state.llm.tokenizer.decode([token_id], skip_special_tokens=False)
    return text


def sampled_logprobs(state: ServerState, out: StepOutput, num_top: int, as_ids: bool = False) -> dict | None:
    """An output's sampled token as chat and the Responses API list it, with its top alternatives: token,
    logprob and bytes (the sampled token's those of its text, an alternative's those of its name, as
    vLLM's with return_tokens_as_token_ids); None for an output without one."""
    if out.logprobs is None or not out.token_ids:
        return None
    sampled, top = out.logprobs

    def entry(token_id: int, logprob: float, text: str | None = None) -> dict:
        name = token_name(state, token_id, as_ids)
        shown = name if text is None else text
        return {"token": name, "logprob": floor_logprob(logprob), "bytes": list(shown.encode())}

    token_id = out.token_ids[-1]
    head = entry(token_id, sampled, token_text(state, token_id))
    return {**head, "top_logprobs": [entry(t, v) for t, v in top[:num_top]]}


def token_name(state: ServerState, token_id: int, as_id: bool) -> str:
    """A token as logprobs name it: its text, or with vLLM's return_tokens_as_token_ids "token_id:N" (so
    that a token whose text is not whole UTF-8, or that shares its text with another, is identified)."""
    return f"token_id:{token_id}" if as_id else token_text(state, token_id)


def sse(payload: dict) -> str:
    """One SSE event. orjson: ~0.3 us a chunk against json.dumps' ~2.7 us (docs/optimizations.md). It writes
    UTF-8 unescaped as ensure_ascii=False does, but NaN/inf as null, not refused: the only floats here
    are logprobs, which floor_logprob already clamps. What orjson refuses (a lone surrogate, an unknown
    type) goes to json.dumps, so the error is json's as before (a ValueError becomes an error event)."""
    try:
        return f"data: {orjson.dumps(payload).decode()}\n\n"
    except orjson.JSONEncodeError:
        return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
