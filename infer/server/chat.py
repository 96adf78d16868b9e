"""POST /v1/chat/completions: messages -> the model's chat template -> token ids -> n choices.

The rendered prompt already holds its special tokens (BOS), so it is encoded with add_special_tokens=False
(vLLM's default for chat; a request may set it).
Without max_tokens / max_completion_tokens a reply may use the rest of the context, as in vLLM: the
longest that the context, the KV pool and (without chunked prefill) the step budget accept.

vLLM's extensions, as vLLM 0.32 serves them:
- the reply's role is "assistant", or with add_generation_prompt false the last message's role;
- continue_final_message: the template rendered without a generation prompt and the last message left
  open (transformers' rule: a tag appended to it, the rendering cut where the tag appears), so the model
  continues it; refused together with add_generation_prompt (which defaults to true);
- echo: the last message's content leads the reply when that message has the reply's role (in a stream:
  one chunk of it after the role's); without a stream it also asks for the prompt's logprobs, top
  top_logprobs (0 when not given), which the response then carries as prompt_logprobs, as vLLM's does;
- return_token_ids: `prompt_token_ids` beside the choices (in a stream: on each role chunk) and each
  choice's `token_ids` (in a stream: each chunk's new ids);
- return_tokens_as_token_ids: logprobs name tokens "token_id:N"; `bytes` stays the sampled token's text
  (its alternatives': their name's), as in vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from infer.sampling_params import SamplingParams
from infer.server import tools
from infer.server.auth import request_owner
from infer.server.bulk_answers import build_in_background
from infer.server.engine_errors import engine_error
from infer.server.fanout import Fanout, Job, answer, choice_params
from infer.server.json_encoding import SSE_DONE, sse
from infer.server.logprobs_json import prompt_logprobs_json, prompt_logprobs_of, sampled_logprobs
from infer.server.protocol import (
    GENERATE_RESPONSES,
    ChatCompletionRequest,
    TokenizeRequest,
    bad_request,
    new_id,
    usage,
)
from infer.server.reasoning import REASONING_PARSERS, THINKING_END, split, thinking
from infer.server.request_params import (
    check_fields,
    check_grammar,
    check_priority,
    check_prompt_logprobs,
    continuous_usage,
    objectives,
    sampling_params,
    truncated,
)
from infer.server.server_state import ServerState, model_state
from infer.server.tool_parsers import extract

router = APIRouter()


@router.post("/v1/chat/completions", responses=GENERATE_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    arrival = time.monotonic()
    state = await model_state(request, body.model, body.keep_alive)
    check_fields(body)
    state.check_open()
    check_priority(state, body.priority)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, state, body)  # CPU work off the event loop
    prompt_ids = truncated(state, body, prompt_ids)
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, state.max_request_len - len(prompt_ids))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    check_prompt_logprobs(state, body)
    params = sampling_params(body, max_tokens, logprobs, _prompt_logprobs(state, body))
    parser = tools.auto_parser(state.args.tool_call_parser, body)
    if parser is not None and parser.keeps_special_tokens:  # vLLM's: its markers may be special tokens
        params = dataclasses.replace(params, skip_special_tokens=False)
    reasoning, params = with_reasoning(state, body, params)
    await check_grammar(state, body, params)
    slo = objectives(state, body)
    jobs = [Job(prompt_ids, choice_params(params, j), body.priority, slo) for j in range(body.n)]
    state.admit(len(jobs), fits=state.fits(len(prompt_ids), max_tokens))
    chat_id = new_id("chatcmpl")
    fanout = Fanout(state, jobs, chat_id, arrival, request_owner(request))
    chat = _Chat(state, body, chat_id, prompt_ids, reasoning)
    return await answer(request, fanout, chat, body.stream, "messages")


def with_reasoning(state: ServerState, body, params: SamplingParams) -> tuple[str | None, SamplingParams]:
    """The request's reasoning parser (--reasoning-parser), and its params with a constraint that holds
    for the answer after the thinking (vLLM's), forced tool calls too: the model thinks, then calls."""
    reasoning = state.args.reasoning_parser
    if reasoning is None or params.structured_outputs is None:
        return reasoning, params
    if thinking(body.chat_template_kwargs):
        end_ids = state.llm.tokenizer.encode(THINKING_END, add_special_tokens=False)
        params = dataclasses.replace(params, grammar_after_ids=tuple(end_ids))
    return reasoning, params


def _prompt_logprobs(state: ServerState, body: ChatCompletionRequest) -> int | None:
    """The request's prompt_logprobs; as vLLM's, echo asks for them too (top_logprobs of them), which only a
    response that is not streamed shows (so a stream does not compute them)."""
    if body.prompt_logprobs is not None or not body.echo or body.stream:
        return body.prompt_logprobs
    if state.llm.config.tensor_parallel_size > 1:
        raise bad_request(
            "echo asks for the prompt's logprobs (as in vLLM), which are not served under tensor "
            "parallelism; send stream true, or leave echo out",
            param="echo",
        )
    return body.top_logprobs or 0


def reply_role(body: ChatCompletionRequest) -> str:
    """vLLM's: the reply is the assistant's, or without a generation prompt the last message's role."""
    return "assistant" if body.add_generation_prompt else body.messages[-1].role


def echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's echo: the last message's content when that message has the reply's role, else nothing."""
    last = body.messages[-1]
    if not body.echo or last.role != reply_role(body):
        return ""
    if isinstance(last.content, list):  # as render_chat joins text parts
        return "\n".join(str(p.get("text", "")) for p in last.content)
    return last.content or ""


# the arguments render_chat passes to apply_chat_template itself (and its `self`)
_OWN_ARGUMENTS = {"self", "messages", "add_generation_prompt", "continue_final_message", "tools", "max_chars"}


def chat_prompt_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids (runs on a worker thread: templates and tokenizing can take a while)."""
    prompt_ids = state.llm.tokenizer.encode(
        render_chat(state, body), add_special_tokens=body.add_special_tokens
    )
    if not prompt_ids:
        raise bad_request("the rendered chat prompt is empty", param="messages")
    return prompt_ids


def render_chat(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> str:
    """The prompt text of body's messages through the model's chat template (also used by /tokenize):
    the fields read are messages, add_generation_prompt, continue_final_message, tools, chat_template and
    chat_template_kwargs."""
    if body.continue_final_message and body.add_generation_prompt:  # vLLM's check and message
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    kwargs = dict(body.chat_template_kwargs or {})
    if clash := sorted(kwargs.keys() & _OWN_ARGUMENTS):
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(clash)}: send add_generation_prompt, "
            "continue_final_message and tools as the request's own fields; messages and the rendering "
            "bound are the server's",
            param="chat_template_kwargs",
        )
    if body.chat_template is not None:
        kwargs["chat_template"] = body.chat_template
    if "chat_template" in kwargs and not state.args.trust_request_chat_template:
        raise bad_request(
            "this server renders only the model's own chat template; a request's chat_template is refused "
            "unless the server runs with --trust-request-chat-template",
            param="chat_template",
        )
    messages = []
    for i, message in enumerate(body.messages):
        m = message.model_dump(exclude_none=True)
        if isinstance(m.get("content"), list):  # content parts: text only (no multimodal models here)
            parts = m["content"]
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in parts):
                raise bad_request(
                    f"messages[{i}].content: only parts of type 'text' are supported", param="messages"
                )
            m["content"] = "\n".join(str(p.get("text", "")) for p in parts)
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            m = _with_call_arguments(m, i)
        messages.append(m)
    try:
        text = state.llm.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=body.tools,
            max_chars=2 * state.args.max_request_bytes,  # the model's template adds little to its input
            **kwargs,
        )
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from exc
    except TypeError as exc:  # e.g. a chat_template_kwargs key that clashes with an argument
        raise bad_request(f"chat_template_kwargs: {exc}", param="chat_template_kwargs") from exc
    return text


def _with_call_arguments(message: dict, i: int) -> dict:
    """An assistant message's tool calls as chat templates read them (vLLM's, after transformers'):
    each call's `arguments` an object, not the JSON text OpenAI's format carries; a missing content is
    "" (templates that write `message['content']` then render the call alone)."""
    calls = []
    for j, call in enumerate(message["tool_calls"]):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise bad_request(f"messages[{i}].tool_calls[{j}] needs a function", param="messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments.strip():
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise bad_request(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not JSON", param="messages"
                ) from None
        elif not arguments:
            arguments = {}
        calls.append({**call, "function": {**function, "arguments": arguments}})
    return {"content": "", **message, "tool_calls": calls}


class _Chat:
    def __init__(
        self,
        state: ServerState,
        body: ChatCompletionRequest,
        chat_id: str,
        prompt_ids: list[int],
        reasoning_parser: str | None = None,
    ):
        self.state, self.body, self.id, self.prompt_ids = state, body, chat_id, prompt_ids
        self.reasoning_parser = reasoning_parser
        self.num_prompt = len(prompt_ids)
        self.created = int(time.time())
        self.role, self.echo = reply_role(body), echo_text(body)
        self.as_ids = body.return_tokens_as_token_ids

    def _usage(self, last: dict) -> dict:
        num_cached = last[0].num_cached_tokens if 0 in last else 0
        return usage(self.num_prompt, sum(o.num_output_tokens for o in last.values()), num_cached)

    def _logprobs(self, outs) -> dict | None:
        if not self.body.logprobs:
            return None
        num_top, as_ids = self.body.top_logprobs or 0, self.as_ids
        entries = (sampled_logprobs(self.state, out, num_top, as_ids) for out in outs)
        return {"content": [e for e in entries if e is not None], "refusal": None}

    def _message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """A choice's message and finish_reason. With a reasoning parser, the thinking is
        `reasoning_content` (and vLLM's `reasoning`) and the rest is read as the answer: its tool calls
        when tool_choice forced them (infer.server.tools), those an auto tool parser finds, or its text.
        What echo repeats stays the content beside the calls (vLLM's; the stream sends it as a content
        chunk). Forced output cut short before any call's name is complete has no call, and its partial
        JSON is no content (vLLM's: content empty)."""
        message: dict = {"role": self.role}
        reader = _Reader(self.state, self.body, self.reasoning_parser)
        if reader.reasoning is not None:
            thought, text = split(reader.reasoning, text)
            message["reasoning_content"] = message["reasoning"] = thought
            text = text or ""
        calls, reason = tools.calls_and_reason(self.body, text, reason)
        if calls is not None:
            message["content"] = self.echo or (None if calls else "")
            if calls:
                message["tool_calls"] = calls
            return message, reason
        if reader.tools is not None:
            found = extract(reader.tools, text)
            if found.calls:
                content = self.echo + (found.content or "")
                message.update(content=content or None, tool_calls=found.calls)
                return message, tools.auto_finish_reason(True, reason)
        content = self.echo + text
        message["content"] = None if reader.reasoning is not None and not content else content
        return message, reason

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.args.model_name}

    async def collect(self, fanout: Fanout) -> dict:
        outputs: dict[int, list] = {i: [] for i in range(len(fanout.tasks))}
        try:
            async for index, out in fanout.outputs():
                outputs[index].append(out)
        except (ValueError, RuntimeError) as exc:
            raise engine_error(exc, "messages") from exc
        choices = []
        for index, outs in outputs.items():
            message, reason = self._message("".join(o.text for o in outs), outs[-1].finish_reason)
            choice = {"index": index, "message": message, "logprobs": self._logprobs(outs)}
            choice["finish_reason"] = reason
            if self.body.return_token_ids:
                choice["token_ids"] = [t for out in outs for t in out.token_ids]
            choices.append(choice)
        last = {index: outs[-1] for index, outs in outputs.items()}
        response = {**self._head("chat.completion"), "choices": choices, "usage": self._usage(last)}
        if self.body.return_token_ids:
            response["prompt_token_ids"] = self.prompt_ids
        entries = prompt_logprobs_of(outputs[0])
        if entries is not None:  # vLLM's: once for the prompt, beside the choices (decoded off the loop)
            response["prompt_logprobs"] = await build_in_background(prompt_logprobs_json, self.state, entries)
        return response

    async def stream(self, fanout: Fanout) -> AsyncIterator[str]:
        opts = self.body.stream_options
        include_usage = bool(opts and opts.include_usage)
        head = self._head("chat.completion.chunk")
        extra = {"usage": None} if include_usage else {}
        # the role comes first, as OpenAI sends it (with return_token_ids the prompt's ids, as vLLM)
        ids = {"prompt_token_ids": self.prompt_ids} if self.body.return_token_ids else {}
        for index in range(len(fanout.tasks)):
            delta = {"role": self.role, "content": ""}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            yield sse({**head, "choices": [choice], **ids, **extra})
        for index in range(len(fanout.tasks)) if self.echo else ():  # then what echo repeats
            choice = {
                "index": index,
                "delta": {"content": self.echo},
                "logprobs": None,
                "finish_reason": None,
            }
            yield sse({**head, "choices": [choice], **extra})
        per_token = self.body.logprobs or self.body.return_token_ids
        last, calls = {}, None
        if tools.forces_calls(self.body):
            calls = _StreamedCalls(self.body, self.reasoning_parser)
        elif not _Reader(self.state, self.body, self.reasoning_parser).is_plain:
            calls = _Readers(self.state, self.body, self.reasoning_parser)
        try:
            async for index, out in fanout.outputs():
                last[index] = out
                if not (out.text or out.finished or per_token and out.token_ids):
                    continue  # text held back (it may begin a stop string): nothing to send yet
                delta = {"content": out.text} if out.text else {}
                reason = out.finish_reason
                if calls is not None:
                    delta, reason = calls.delta(index, out)
                    if not (delta or reason or per_token):
                        continue  # text that is no call's (brackets, a name not yet complete)
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": self._logprobs([out]),
                    "finish_reason": reason,
                }
                if self.body.return_token_ids:
                    choice["token_ids"] = out.token_ids
                if continuous_usage(self.body):  # vLLM's: the usage so far in every chunk
                    extra = {"usage": self._usage(last)}
                yield sse({**head, "choices": [choice], **extra})
        except (ValueError, RuntimeError) as exc:
            yield sse(engine_error(exc, "messages").body())
        else:
            if include_usage:
                yield sse({**head, "choices": [], "usage": self._usage(last)})
        yield SSE_DONE


class _StreamedCalls:
    """Each choice's forced tool calls as deltas, read out of its output as it is generated: its thinking
    first (--reasoning-parser), then a call's id and name once (with its name complete), then its
    arguments as they come (infer.server.tool_call_parser)."""

    def __init__(self, body: ChatCompletionRequest, reasoning_parser: str | None):
        self.body, self.reasoning_parser = body, reasoning_parser
        self.parsers: dict[int, tools.NamedCallParser | tools.CallListParser] = {}
        self.reasonings: dict = {}

    def delta(self, index: int, out) -> tuple[dict, str | None]:
        if index not in self.parsers:
            self.parsers[index] = tools.call_parser(self.body)
            if self.reasoning_parser is not None:
                parser = REASONING_PARSERS[self.reasoning_parser](thinking(self.body.chat_template_kwargs))
                self.reasonings[index] = parser
        delta, answer = {}, out.text
        reasoning = self.reasonings.get(index)
        if reasoning is not None:
            thought, answer = reasoning.feed_output(out.text, out.finished)
            if thought:
                delta = {"reasoning_content": thought, "reasoning": thought}
        parser = self.parsers[index]
        calls = [tools.streamed_call(d) for d in parser.feed(answer)]
        if calls:
            delta["tool_calls"] = calls
        return delta, tools.finish_reason(parser, out.finish_reason)


class _Reader:
    """One choice's free output read as it streams: the thinking apart (--reasoning-parser), then the
    calls the model writes in its answer (--tool-call-parser, under tool_choice "auto")."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, reasoning_parser: str | None):
        self.reasoning = None
        if reasoning_parser is not None:
            self.reasoning = REASONING_PARSERS[reasoning_parser](thinking(body.chat_template_kwargs))
        self.tools = tools.auto_parser(state.args.tool_call_parser, body)

    @property
    def is_plain(self) -> bool:
        return self.reasoning is None and self.tools is None

    def delta(self, out) -> tuple[dict, str | None]:
        """A chunk's delta: reasoning, content, tool calls (each only when it has something)."""
        thought, answer = "", out.text
        if self.reasoning is not None:
            thought, answer = self.reasoning.feed_output(out.text, out.finished)
        delta: dict = {"reasoning_content": thought, "reasoning": thought} if thought else {}
        if self.tools is None:
            if answer:
                delta["content"] = answer
            return delta, out.finish_reason
        parser = self.tools
        pieces = parser.feed(answer) + (parser.finish() if out.finished else [])
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = [tools.streamed_call(p, parser.call_id) for p in pieces if not isinstance(p, str)]
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, tools.auto_finish_reason(parser.num_calls > 0 and not parser.broken, out.finish_reason)


class _Readers:
    """A _Reader per choice."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, reasoning_parser: str | None):
        self.state, self.body, self.reasoning_parser = state, body, reasoning_parser
        self.readers: dict[int, _Reader] = {}

    def delta(self, index: int, out) -> tuple[dict, str | None]:
        if index not in self.readers:
            self.readers[index] = _Reader(self.state, self.body, self.reasoning_parser)
        return self.readers[index].delta(out)
