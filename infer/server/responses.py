"""POST /v1/responses (OpenAI's Responses API); GET and DELETE /v1/responses/{id}.

A responses request is the chat request it amounts to: `instructions` as a system message, then, with
`previous_response_id`, that response's conversation (its input and its answer, from this server's
store), then `input` as chat messages (infer.server.responses_input: messages of text, function calls
and their outputs). The conversation goes through the model's chat template and chat's sampling
(protocol.ResponsesRequest). The output is a message item holding one output_text part; with function
`tools`, a `function_call` item per call (forced by tool_choice "required" or a named function, or read
out of the text under "auto" with --enable-auto-tool-choice: infer.server.tools), after the message of
the text before them; with --reasoning-parser, a `reasoning` item of the thinking first.

Streaming sends OpenAI's typed events (`event: TYPE`, `data: JSON` with a sequence_number, no [DONE]):

    response.created, response.in_progress           the response, status in_progress, no output yet
    response.output_item.added, response.content_part.added
    response.output_text.delta ...                   the text as it comes (with its logprobs if included)
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed                               the whole response, usage included; as OpenAI,
                                                     response.incomplete when max_output_tokens cut it
                                                     short (vLLM 0.32 sends response.completed either way)

With tools or a reasoning parser, the items open as the output reads (infer.server.responses_items).
An engine error mid-stream sends `error` and then response.failed.

The store: `store` is true by default (OpenAI's default). A stored response can be read back (GET),
deleted, and continued (previous_response_id). It lives in this process's memory, the least recently
stored evicted first beyond --responses-store-mb (vLLM keeps a store only behind
VLLM_ENABLE_RESPONSES_API_STORE, unbounded); a response evicted, deleted or never stored is a 404.
A response is kept as the JSON that GET returns (its instructions, metadata and logprobs included, which
a client sizes), so that the bound counts what is held. Messages are shared between a response and the
ones that continue it, so a chain of N turns holds each turn's text once; the bound counts each
response's whole conversation, so it errs high (an evicted turn's text stays alive while a stored response
continues it).

A stored response is its owner's: the API key that stored it (infer.server.auth; with no key, every client
is the one anonymous owner). For another key, GET, DELETE and previous_response_id answer the same 404 as
an id never stored, so that they do not tell that it exists. Its id is 128 random bits: there is no
counting one's way to another's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from infer.engine.llm_engine import StepOutput
from infer.server import tools
from infer.server.auth import request_owner, same_owner
from infer.server.chat import chat_prompt_ids, with_reasoning
from infer.server.engine_errors import engine_error
from infer.server.fanout import Fanout, Job, answer
from infer.server.json_encoding import sse
from infer.server.logprobs_json import sampled_logprobs
from infer.server.protocol import (
    GENERATE_RESPONSES,
    APIError,
    ChatCompletionRequest,
    ResponsesRequest,
    bad_request,
    new_id,
)
from infer.server.reasoning import REASONING_PARSERS, split, thinking
from infer.server.request_params import (
    check_fields,
    check_grammar,
    check_priority,
    objectives,
    sampling_params,
)
from infer.server.responses_input import input_messages
from infer.server.responses_items import StreamedItems, call_item, plain_call, reasoning_item
from infer.server.server_state import ServerState, model_state
from infer.server.tool_parsers import extract

router = APIRouter()

_LOGPROBS = "message.output_text.logprobs"


@dataclass
class Stored:
    id: str
    owner: str  # the digest of the API key that stored it (infer.server.auth)
    body: bytes  # the response's JSON, as GET returns it
    conversation: list[dict]  # the messages that produced it, instructions left out (OpenAI's rule)
    reply: dict  # its output as the assistant's chat message (content, tool_calls)
    size: int  # bytes counted against the store's bound


class ResponseStore:
    """Responses kept for GET and previous_response_id, least recently stored out first beyond
    max_bytes (0: nothing is kept)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, entry: Stored) -> bool:
        if entry.size > self.max_bytes:
            return False
        self.entries[entry.id] = entry
        self.num_bytes += entry.size
        while self.num_bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.num_bytes -= old.size
        return True

    def get(self, response_id: str, owner: str, param: str = "response_id") -> Stored:
        """The owner's response; another owner's is not found, as one never stored."""
        entry = self.entries.get(response_id)
        if entry is None or not same_owner(entry.owner, owner):
            raise APIError(
                404,
                f"no stored response with id {response_id!r}: never stored (store false), stored with "
                "another API key, deleted, or evicted (--responses-store-mb bounds the store)",
                param=param,
                code="response_not_found",
            )
        return entry

    def delete(self, response_id: str, owner: str) -> None:
        self.num_bytes -= self.get(response_id, owner).size
        del self.entries[response_id]


@router.post("/v1/responses", responses=GENERATE_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request):
    arrival = time.monotonic()
    state = await model_state(request, body.model, body.keep_alive)
    store: ResponseStore = request.app.state.responses
    owner = request_owner(request)
    check_fields(body)
    state.check_open()
    check_priority(state, body.priority)
    conversation = input_messages(body.input)
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id, owner, param="previous_response_id")
        conversation = [*previous.conversation, previous.reply, *conversation]
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages = system + conversation
    chat = ChatCompletionRequest(
        messages=messages,
        chat_template_kwargs=body.chat_template_kwargs,
        tools=tools.as_chat_tools(body.tools),
    )
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, state, chat)  # CPU work off the event loop
    limit = state.max_request_len
    if body.truncation == "auto":  # the conversation's start goes, as vLLM's (a prompt's last tokens)
        keep = limit - (body.max_output_tokens or 1)
        if keep < 1:
            raise bad_request(
                f"max_output_tokens ({body.max_output_tokens}) leaves no room for input in the context "
                f"({limit} tokens)",
                param="max_output_tokens",
            )
        prompt_ids = prompt_ids[-keep:]
    max_tokens = body.max_output_tokens or max(1, limit - len(prompt_ids))
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if _wants_logprobs(body) else None)
    parser = tools.auto_parser(state.args.tool_call_parser, body)
    if parser is not None and parser.keeps_special_tokens:  # as in chat
        params = dataclasses.replace(params, skip_special_tokens=False)
    reasoning, params = with_reasoning(state, body, params)
    await check_grammar(state, body, params)
    slo = objectives(state, body)
    state.admit(1, fits=state.fits(len(prompt_ids), max_tokens))
    response_id = new_id("resp")
    job = Job(prompt_ids, params, body.priority, slo)
    fanout = Fanout(state, [job], response_id, arrival, owner)
    run = _Response(state, store, body, response_id, conversation, owner, reasoning)
    return await answer(request, fanout, run, body.stream, "input")


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> Response:
    stored = request.app.state.responses.get(response_id, request_owner(request))
    return Response(stored.body, media_type="application/json")


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    request.app.state.responses.delete(response_id, request_owner(request))
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _wants_logprobs(body: ResponsesRequest) -> bool:
    return _LOGPROBS in (body.include or ())


class _Response:
    def __init__(
        self,
        state: ServerState,
        store: ResponseStore,
        body,
        response_id: str,
        conversation,
        owner: str,
        reasoning_parser: str | None = None,
    ):
        self.state, self.store, self.body, self.id = state, store, body, response_id
        self.reasoning_parser = reasoning_parser
        self.conversation, self.owner = conversation, owner
        self.created = int(time.time())
        self.item_id = new_id("msg")
        self.include_logprobs = _wants_logprobs(body)
        self.forced = body.tools is not None and tools.forces_calls(body)
        self.reads_calls = self.forced or tools.auto_parser(state.args.tool_call_parser, body) is not None

    def token_logprobs(self, out: StepOutput) -> list[dict]:
        if not self.include_logprobs:
            return []
        entry = sampled_logprobs(self.state, out, self.body.top_logprobs or 0)
        return [entry] if entry is not None else []

    def text_part(self, text: str, logprobs: list[dict] | None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def message(self, status: str, content: list[dict]) -> dict:
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def reasoning_reader(self):
        """A parser of the output's thinking (--reasoning-parser), or None."""
        if self.reasoning_parser is None:
            return None
        return REASONING_PARSERS[self.reasoning_parser](thinking(self.body.chat_template_kwargs))

    def _response(
        self, status: str, output: list[dict], last: StepOutput | None = None, num_reasoning: int = 0
    ) -> dict:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        usage = None
        if last is not None:
            usage = {
                "input_tokens": last.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
                "output_tokens": last.num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": num_reasoning},
                "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.state.args.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": body.store and self.store.max_bytes > 0,
            "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": body.tool_choice,
            "tools": body.tools or [],
            "top_logprobs": body.top_logprobs or 0,
            "top_p": body.top_p,
            "truncation": body.truncation,
            "usage": usage,
            "user": body.user,
        }

    def _output(self, text: str, reason: str | None) -> tuple[str, list[dict]]:
        """A whole output's message text and calls ([{"id", "function": {"name", "arguments"}}]), as chat
        reads them."""
        if self.forced:
            calls, _ = tools.calls_and_reason(self.body, text, reason)
            return "", calls or []
        parser = tools.auto_parser(self.state.args.tool_call_parser, self.body)
        if parser is None:
            return text, []
        found = extract(parser, text)
        return found.content or "", found.calls

    def _finish(
        self, items: list[dict], text: str, calls: list[dict], last: StepOutput, num_reasoning: int = 0
    ) -> dict:
        """The whole response once the output ended (its items, as they were streamed); stored if asked.
        The stored reply is the answer: the thinking stays out of the history (as the templates of
        thinking models leave it out of earlier turns)."""
        status = {"stop": "completed", "length": "incomplete"}.get(last.finish_reason, "cancelled")
        response = self._response(status, items, last, num_reasoning)
        if self.body.store and status != "cancelled":
            reply = {"role": "assistant", "content": text}
            if calls:
                reply["tool_calls"] = [{**c, "type": "function"} for c in calls]
            # the body holds the output, the instructions, metadata and logprobs: all sized by the client
            body = orjson.dumps(response)
            size = len(body) + len(orjson.dumps(reply)) + len(orjson.dumps(self.conversation))
            stored = Stored(self.id, self.owner, body, self.conversation, reply, size + 1024)
            response["store"] = self.store.put(stored)
        return response

    def _message_item(self, text: str, logprobs: list[dict], status: str) -> dict:
        return self.message(status, [self.text_part(text, logprobs if self.include_logprobs else None)])

    async def collect(self, fanout: Fanout) -> dict:
        texts, logprobs, last = [], [], None
        counter, num_reasoning = self.reasoning_reader(), 0
        try:
            async for _, out in fanout.outputs():
                texts.append(out.text)
                logprobs += self.token_logprobs(out)
                last = out
                if counter is not None and not counter.in_content:  # a token that ends the thinking counts
                    num_reasoning += len(out.token_ids)
                    counter.feed(out.text)
        except (ValueError, RuntimeError) as exc:
            raise engine_error(exc, "input") from exc
        text = "".join(texts)
        status = "incomplete" if last.finish_reason == "length" else "completed"
        items = []
        parser = self.reasoning_reader()
        if parser is not None:
            thought, text = split(parser, text)
            text = text or ""
            if thought:
                answered = parser.in_content or status == "completed"
                items.append(reasoning_item(new_id("rs"), thought, "completed" if answered else "incomplete"))
        text, calls = self._output(text, last.finish_reason)
        if text or not (calls or items):
            items.append(self._message_item(text, logprobs, status))
        items += [call_item(new_id("fc"), c["id"], **c["function"]) for c in calls]
        return self._finish(items, text, [plain_call(c) for c in calls], last, num_reasoning)

    async def stream(self, fanout: Fanout) -> AsyncIterator[str]:
        if self.reads_calls or self.reasoning_parser is not None:
            async for event in self._stream_items(fanout):
                yield event
            return
        events = _Events()
        started = self._response("in_progress", [])
        yield events("response.created", response=started)
        yield events("response.in_progress", response=started)
        yield events("response.output_item.added", output_index=0, item=self.message("in_progress", []))
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield events("response.content_part.added", **where, part=self.text_part("", []))
        texts, logprobs, last = [], [], None
        try:
            async for _, out in fanout.outputs():
                last = out
                entries = self.token_logprobs(out)
                if out.text or entries:
                    texts.append(out.text)
                    logprobs += entries
                    yield events("response.output_text.delta", **where, delta=out.text, logprobs=entries)
        except (ValueError, RuntimeError) as exc:
            for event in _failed(events, self._response("failed", []), exc):
                yield event
            return
        text = "".join(texts)
        status = "incomplete" if last.finish_reason == "length" else "completed"
        response = self._finish([self._message_item(text, logprobs, status)], text, [], last)
        (item,) = response["output"]
        yield events("response.output_text.done", **where, text=item["content"][0]["text"], logprobs=logprobs)
        yield events("response.content_part.done", **where, part=item["content"][0])
        yield events("response.output_item.done", output_index=0, item=item)
        for event in _ended(events, response):
            yield event

    async def _stream_items(self, fanout: Fanout) -> AsyncIterator[str]:
        """A stream whose output may hold calls: the items open as the output reads (_StreamedItems)."""
        events = _Events()
        started = self._response("in_progress", [])
        yield events("response.created", response=started)
        yield events("response.in_progress", response=started)
        items = StreamedItems(self, events)
        last = None
        try:
            async for _, out in fanout.outputs():
                last = out
                for event in items.feed(out):
                    yield event
        except (ValueError, RuntimeError) as exc:
            for event in _failed(events, self._response("failed", []), exc):
                yield event
            return
        for event in items.close(last.finish_reason):
            yield event
        response = self._finish(items.items, items.text, items.calls, last, items.num_reasoning)
        for event in _ended(events, response):
            yield event


def _failed(events: _Events, failed: dict, exc: Exception) -> list[str]:
    error = engine_error(exc, "input")
    failed["error"] = {"code": error.code or error.type, "message": error.message}
    return [
        events("error", code=error.code or error.type, message=error.message, param=error.param),
        events("response.failed", response=failed),
    ]


def _ended(events: _Events, response: dict) -> list[str]:
    if response["status"] == "cancelled":  # the server aborted it (a drain that timed out)
        response["error"] = {"code": "cancelled", "message": "the server aborted this response"}
    kinds = {"completed": "response.completed", "incomplete": "response.incomplete"}
    return [events(kinds.get(response["status"], "response.failed"), response=response)]


class _Events:
    """OpenAI's streaming events: `event: TYPE` then the JSON, numbered in order."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n{sse(payload)}"
