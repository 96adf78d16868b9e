"""POST /v1/completions: a prompt (text or token ids, or a batch of either) x n choices.

Choice i*n + j is the j-th sample of prompt i, as OpenAI numbers them. usage counts each prompt once and
every choice's generated tokens; cached_tokens is each prompt's prefix-cache hit (its first choice's).

vLLM's return_token_ids adds each choice's `prompt_token_ids` (in a stream: its first chunk) and
`token_ids` (in a stream: each chunk's new ids); as in vLLM, echo then leaves the prompt's text out (its
ids are there), while echo's logprobs and their text_offset still count the prompt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from infer.server.auth import request_owner
from infer.server.bulk_answers import build_in_background
from infer.server.engine_errors import engine_error
from infer.server.fanout import Fanout, Job, answer, choice_params
from infer.server.json_encoding import SSE_DONE, sse
from infer.server.logprobs_json import (
    floor_logprob,
    prompt_logprobs_json,
    prompt_logprobs_of,
    token_name,
    token_text,
)
from infer.server.protocol import GENERATE_RESPONSES, CompletionRequest, bad_request, new_id, usage
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

router = APIRouter()


@router.post("/v1/completions", responses=GENERATE_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request):
    arrival = time.monotonic()
    state = await model_state(request, body.model, body.keep_alive)
    check_fields(body)
    state.check_open()
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of not in (None, 1, body.n):
        raise bad_request(
            "best_of must equal n (or be omitted): best-of selection is not supported", param="best_of"
        )
    if body.max_tokens == 0 and not body.echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 only with echo: the prompt alone)", param="max_tokens"
        )
    check_prompt_logprobs(state, body)
    check_priority(state, body.priority)
    state.check_admissible(_num_prompts(body.prompt) * body.n)  # before tokenizing a huge batch
    # tokenizing (and decoding for echo) is CPU work: off the event loop
    prompts = await asyncio.to_thread(_prompt_ids, state, body.prompt, body.add_special_tokens)
    prompts = [truncated(state, body, p) for p in prompts]
    echo_text = await asyncio.to_thread(_echo_text, state, prompts) if body.echo else [""] * len(prompts)
    # echo with logprobs: the prompt's logprobs too, as vLLM and OpenAI's legacy API give them
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    max_tokens = 16 if body.max_tokens is None else max(body.max_tokens, 1)  # echo of 0: one, not shown
    params = sampling_params(body, max_tokens, body.logprobs, prompt_logprobs)
    await check_grammar(state, body, params)
    slo = objectives(state, body)
    jobs = [Job(ids, choice_params(params, j), body.priority, slo) for ids in prompts for j in range(body.n)]
    state.admit(len(jobs), fits=all(state.fits(len(ids), params.max_tokens) for ids in prompts))
    cmpl_id = new_id("cmpl")
    fanout = Fanout(state, jobs, cmpl_id, arrival, request_owner(request))
    completion = _Completion(state, body, cmpl_id, prompts, echo_text)
    return await answer(request, fanout, completion, body.stream, "prompt")


def _is_single(prompt) -> bool:
    return isinstance(prompt, str) or bool(prompt and isinstance(prompt[0], int))


def _num_prompts(prompt) -> int:
    return 1 if _is_single(prompt) else len(prompt)


def _prompt_ids(state: ServerState, prompt, special: bool = True) -> list[list[int]]:
    """The batch of prompts as token id lists (text is encoded here, with the tokenizer's BOS)."""
    if _is_single(prompt):
        prompt = [prompt]
    if not prompt:
        raise bad_request(
            "prompt is empty: send a string, a list of token ids, or a batch of either", param="prompt"
        )
    tokenizer = state.llm.tokenizer
    prompts = [
        tokenizer.encode(p, add_special_tokens=special) if isinstance(p, str) else list(p) for p in prompt
    ]
    if any(not p for p in prompts):
        raise bad_request("a prompt is empty: each prompt needs at least one token", param="prompt")
    vocab = state.llm.model_config.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:  # the engine would refuse them too; checked here so that echo never decodes them
        raise bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", param="prompt")
    return prompts


def _echo_text(state: ServerState, prompts: list[list[int]]) -> list[str]:
    return [state.llm.tokenizer.decode(p) for p in prompts]


class _Completion:
    def __init__(
        self,
        state: ServerState,
        body: CompletionRequest,
        cmpl_id: str,
        prompts: list[list[int]],
        echo_text: list[str],
    ):
        self.state, self.body, self.id, self.prompts = state, body, cmpl_id, prompts
        self.created = int(time.time())
        self.n = body.n
        self.echo_text = echo_text
        self.echo_only = body.echo and body.max_tokens == 0  # the one token generated is not shown
        self.as_ids = body.return_tokens_as_token_ids

    def _shown_echo(self, index: int) -> str:
        """The echoed prompt's text as the choice shows it: none beside its ids (vLLM's return_token_ids)."""
        return "" if self.body.return_token_ids else self.echo_text[index // self.n]

    def _usage(self, last: dict) -> dict:
        num_prompt = sum(len(p) for p in self.prompts)
        num_cached = sum(
            last[i * self.n].num_cached_tokens for i in range(len(self.prompts)) if i * self.n in last
        )
        num_output = 0 if self.echo_only else sum(o.num_output_tokens for o in last.values())
        return usage(num_prompt, num_output, num_cached)

    def _logprobs(self, outs, offset: int) -> dict | None:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs, text_offset."""
        if self.body.logprobs is None:
            return None
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for out in outs:
            if out.logprobs is None or not out.token_ids:
                continue
            sampled, top = out.logprobs
            token_id = out.token_ids[-1]
            lp["tokens"].append(token_name(self.state, token_id, self.as_ids))
            lp["token_logprobs"].append(floor_logprob(sampled))
            lp["top_logprobs"].append(
                {
                    token_name(self.state, t, self.as_ids): floor_logprob(v)
                    for t, v in top[: self.body.logprobs]
                }
            )
            lp["text_offset"].append(offset)
            offset += len(token_text(self.state, token_id))  # into the text, also for "token_id:N" names
        return lp

    def _echoed_logprobs(self, index: int, outs, entries: list | None) -> dict | None:
        """The legacy logprobs of an echoed prompt (the first token's None; `entries`: its prompt
        logprobs), then of the output."""
        generated = self._logprobs([] if self.echo_only else outs, len(self.echo_text[index // self.n]))
        if generated is None or entries is None:
            return generated
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset, tokenizer = 0, self.state.llm.tokenizer
        for token_id, entry in zip(self.prompts[index // self.n], entries, strict=True):
            lp["tokens"].append(token_name(self.state, token_id, self.as_ids))
            lp["text_offset"].append(offset)
            offset += len(tokenizer.decode([token_id]))  # as in the echoed text: special tokens take none
            if entry is None:
                lp["token_logprobs"].append(None)
                lp["top_logprobs"].append(None)
                continue
            lp["token_logprobs"].append(floor_logprob(entry[1]))
            # the token itself, then the top N (as vLLM: never empty, whatever N)
            top = [(entry[0], entry[1]), *entry[3][: self.body.logprobs]]
            lp["top_logprobs"].append(
                {token_name(self.state, t, self.as_ids): floor_logprob(v) for t, v in top}
            )
        return {key: lp[key] + generated[key] for key in lp}

    def _choice(self, index: int, text: str, outs, finish_reason) -> dict:
        choice = {"index": index, "text": text}
        entries = prompt_logprobs_of(outs)
        if self.body.echo:
            choice["logprobs"] = self._echoed_logprobs(index, outs, entries)
        else:
            choice["logprobs"] = self._logprobs(outs, 0)
        shown_length = self.echo_only and finish_reason in ("stop", "length")  # its one token was not shown
        choice["finish_reason"] = "length" if shown_length else finish_reason
        if entries is not None:  # vLLM's field, beside OpenAI's legacy logprobs
            choice["prompt_logprobs"] = prompt_logprobs_json(self.state, entries)
        if self.body.return_token_ids:
            choice["prompt_token_ids"] = self.prompts[index // self.n]
            choice["token_ids"] = self._token_ids(outs)
        return choice

    def _token_ids(self, outs) -> list[int]:
        """The generated ids of these outputs (none under echo with max_tokens 0, as its text has none)."""
        return [] if self.echo_only else [t for out in outs for t in out.token_ids]

    def _head(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.args.model_name,
        }

    async def collect(self, fanout: Fanout) -> dict:
        outputs: dict[int, list] = {i: [] for i in range(len(fanout.tasks))}
        try:
            async for index, out in fanout.outputs():
                outputs[index].append(out)
        except (ValueError, RuntimeError) as exc:
            raise engine_error(exc, "prompt") from exc
        last = {index: outs[-1] for index, outs in outputs.items()}
        if any(prompt_logprobs_of(outs) is not None for outs in outputs.values()):
            # a decode per prompt token and alternative: ~100 ms for 4,096 x top 20 (bulk_answers.py)
            choices = await build_in_background(self._choices, outputs)
        else:
            choices = self._choices(outputs)
        return {**self._head(), "choices": choices, "usage": self._usage(last)}

    def _choices(self, outputs: dict[int, list]) -> list[dict]:
        choices = []
        for index, outs in outputs.items():
            text = self._shown_echo(index) + ("" if self.echo_only else "".join(o.text for o in outs))
            choices.append(self._choice(index, text, outs, outs[-1].finish_reason))
        return choices

    async def stream(self, fanout: Fanout) -> AsyncIterator[str]:
        opts = self.body.stream_options
        include_usage = bool(opts and opts.include_usage)
        # text so far, echoed prompt included (also where return_token_ids shows it not): logprobs' offsets
        offsets = dict.fromkeys(range(len(fanout.tasks)), 0)
        started, last = set(), {}
        try:
            async for index, out in fanout.outputs():
                last[index] = out
                text = "" if self.echo_only else out.text
                first = index not in started
                started.add(index)
                shown = self._shown_echo(index) + text if first else text
                if first:
                    offsets[index] += len(self.echo_text[index // self.n])
                per_token = self.body.logprobs is not None or self.body.return_token_ids
                if not (shown or first and self.body.echo or out.finished or per_token and out.token_ids):
                    continue  # text held back (it may begin a stop string): nothing to send yet
                if first and (self.body.echo or self.body.return_token_ids):
                    choice = self._choice(index, shown, [out], out.finish_reason)
                else:
                    choice = {
                        "index": index,
                        "text": shown,
                        "logprobs": None if self.echo_only else self._logprobs([out], offsets[index]),
                        "finish_reason": "length" if self.echo_only and out.finished else out.finish_reason,
                    }
                    if self.body.return_token_ids:
                        choice["token_ids"] = self._token_ids([out])
                offsets[index] += len(text)
                chunk = {**self._head(), "choices": [choice]}
                if include_usage:  # the usage so far with continuous_usage_stats (vLLM's), else null
                    chunk["usage"] = self._usage(last) if continuous_usage(self.body) else None
                yield sse(chunk)
        except (ValueError, RuntimeError) as exc:
            yield sse(engine_error(exc, "prompt").body())
        else:
            if include_usage:
                yield sse({**self._head(), "choices": [], "usage": self._usage(last)})
        yield SSE_DONE
