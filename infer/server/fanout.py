"""The engine requests of one HTTP request (prompts x n) run together, and the HTTP answer they make:
server-sent events or one JSON body, the client's disconnect watched throughout.

Lifetime of one HTTP request:

    admit(k)                 ServerState.admit (infer.server.server_state): 503 while loading or draining;
                             429 when the queue would exceed its bound
    Fanout(k jobs)           one asyncio task per engine request ("choice"), outputs merged into a queue
    accepted()               wait until the engine has accepted every choice: a refusal is still a 400
                             (not their first tokens: choices beyond the free seats would hold back the
                             stream's first byte until earlier choices finished)
    stream / collect         SSE chunks, or the whole response; a disconnect cancels the tasks, and the
                             engine generator closing aborts the request (its blocks go back to the pool)
    done                     each task's done-callback (which runs even for a task cancelled before it
                             started): the request no longer counts as in flight
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from infer.core.slo import Objectives
from infer.engine.llm_engine import StepOutput
from infer.sampling_params import INT64_MIN, SamplingParams
from infer.server.bulk_answers import build_in_background
from infer.server.engine_errors import engine_error
from infer.server.json_encoding import json_body
from infer.server.server_state import ServerState

logger = logging.getLogger("infer.server")


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


def batch_group(state: ServerState, owner: str, prefix: str, num_jobs: int) -> str | None:
    """The engine's group of these requests, whose rows share the batch as one (infer.core.group_shares,
    group_decode_bound): where the server tells clients apart (several API keys), all of a client's
    requests, so that 100 requests of one client weigh as one client's; else an API request's n choices."""
    if len(state.args.api_key_owners) > 1:
        return "client-" + owner[:16]
    return prefix if num_jobs > 1 else None


_ABORTED = object()
_ACCEPTED = object()


class Fanout:
    """The engine requests of one HTTP request (prompts x n), run as concurrent tasks whose outputs are
    merged in arrival order, tagged with the job's index. `close()` cancels the tasks: each engine
    generator then closes, which aborts its request; the choice ends with finish_reason "abort"."""

    def __init__(self, state: ServerState, jobs: list[Job], prefix: str, arrival: float, owner: str):
        self.state = state
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending: list[tuple[int, object]] = []  # taken by accepted(), to be yielded first
        self.num_open = len(jobs)
        self.last: dict[int, StepOutput] = {}
        self.req_ids = [f"{prefix}-{i}" for i in range(len(jobs))]
        self.group_id = batch_group(state, owner, prefix, len(jobs))
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
    if _has_prompt_logprobs(result):  # megabytes of JSON: off the event loop, behind the engine
        return Response(await build_in_background(json_body, result), media_type="application/json")
    return Response(json_body(result), media_type="application/json")


def _has_prompt_logprobs(result: dict) -> bool:
    return "prompt_logprobs" in result or any("prompt_logprobs" in c for c in result.get("choices", ()))
