"""The server's state for one served model: its engine, loaded off the event loop, the HTTP side's counters,
and admission (503 while the model loads or the server drains, 400 for a task the model does not do or a batch
that is never admitted, 429 beyond the queue bound). `model_state` finds the state that serves a request's
model.

`num_in_flight` is counted here (`admit`, `pooling_admission`) and in infer.server.fanout (a choice's end)
alone, so that the drain on SIGTERM can wait for it to reach 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from fastapi import Request

from infer.engine.async_engine import AsyncEngine
from infer.engine.async_pooling import AsyncPoolingEngine
from infer.engine.pooling import PoolingEngine, model_task
from infer.server.args import ServerArgs
from infer.server.metrics import MeteredEngine, Metrics
from infer.server.protocol import APIError, bad_request, overloaded

if TYPE_CHECKING:
    from infer.server.fanout import Fanout

LEASES_KEY = "infer.model_leases"  # in the ASGI scope: the models a request holds until its response is sent


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
            raise overloaded(
                f"server overloaded: {self.num_in_flight} requests in flight and this one would make "
                f"{num_waiting} wait, beyond --max-queued-requests {max_queued}"
            )
        self.num_in_flight += num_requests

    async def encode(self, inputs: list) -> list[list[float]]:
        """A pooling request's inputs (PoolingInputs) through the pooling engine: admitted
        (`pooling_admission`), then counted in /metrics as vLLM counts its pooling requests."""
        start = time.monotonic()
        with self.pooling_admission(len(inputs)):
            outputs = await self.pooling.encode(inputs)
        self.metrics.observe_pooling([len(x.token_ids) for x in inputs], time.monotonic() - start)
        return outputs

    @contextlib.contextmanager
    def pooling_admission(self, num_inputs: int):
        """Count a pooling request as in flight (the drain waits for it) while it runs, or refuse it (429)
        when the inputs already waiting exceed --max-num-seqs + --max-queued-requests."""
        self.check_open(task=None)
        bound = self.args.engine.max_num_seqs + self.args.max_queued_requests
        waiting = self.pooling.num_waiting
        if waiting and waiting + num_inputs > bound:
            raise overloaded(
                f"server overloaded: {waiting} inputs are waiting to be embedded or scored and this request "
                f"would make {waiting + num_inputs}, beyond {bound}"
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
