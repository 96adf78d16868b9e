"""Logprobs in vLLM's and OpenAI's JSON: the prompt's (vLLM's prompt_logprobs), and a sampled token's with its
top alternatives (chat and the Responses API), a token named by its text or, with return_tokens_as_token_ids,
as "token_id:N". JSON has no -inf: a logprob is floored at LOGPROB_FLOOR.
"""

from __future__ import annotations

from infer.engine.llm_engine import StepOutput
from infer.server.server_state import ServerState

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


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
