"""What the engine's refusal or failure of a request becomes over HTTP: a refusal (a ValueError with the
numbers) is the client's 400, a full grammar queue or an objective the server cannot meet a 429, a request the
engine failed our 500, whose body names no internals (the log has the exception).
"""

from __future__ import annotations

import logging

from infer.core.slo import LateRequest
from infer.engine.async_engine import RequestFailed
from infer.sampling_params import Unsatisfiable
from infer.server.protocol import APIError, bad_request, overloaded
from infer.structured_outputs.compile_pool import CompileQueueFull

logger = logging.getLogger("infer.server")

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


def grammars_busy(exc: CompileQueueFull) -> APIError:
    return overloaded(f"server overloaded: {exc}")
