"""What a request body asks of the engine, read and checked before anything is admitted: its SamplingParams (a
ValueError there is a 400 naming the field), its output constraint (response_format, structured_outputs, a
tool_choice, or vLLM's older guided_* fields) and the wait for its grammar, its priority and objectives, the
prompt's truncation; and the fields of vLLM's and OpenAI's that this server refuses rather than ignores.
"""

from __future__ import annotations

import asyncio
import logging

from infer.core.slo import Objectives
from infer.sampling_params import SamplingParams
from infer.server.engine_errors import grammars_busy
from infer.server.protocol import bad_request
from infer.server.server_state import ServerState
from infer.structured_outputs.compile_pool import CompileQueueFull
from infer.structured_outputs.constraint import StructuredOutputs
from infer.structured_outputs.tool_calls import tool_schema

logger = logging.getLogger("infer.server")

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
    """Await the request's grammar, compiled on the compiler's own threads
    (infer.structured_outputs.compile_pool): 400 naming its field if it does not compile, 429 if too many
    distinct grammars are compiling."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.wrap_future(state.llm.grammars.compiled(params.structured_outputs))
    except CompileQueueFull as exc:
        raise grammars_busy(exc) from exc
    except ValueError as exc:
        field = _constraints(body)[0][0][0]
        raise bad_request(_named(field, str(exc)), param=field) from exc


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
