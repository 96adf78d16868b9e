"""Every string of a request body, nested anywhere, must be valid Unicode; the walk skips the numbers (a
1,024-entry logit_bias is numbers only) but no string, whatever holds it."""

from __future__ import annotations

import pydantic
import pytest

from infer.server import protocol
from infer.server.app import validation_error
from infer.server.protocol import ChatCompletionRequest, CompletionRequest

LONE = "a\ud800b"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": LONE},
        {"prompt": ["ok", LONE]},
        {"prompt": "hi", "stop": ["x", LONE]},
        {"prompt": "hi", "bad_words": [LONE]},
        {"prompt": "hi", "logit_bias": {"1": 2.0}, "stop": [LONE]},
    ],
)
def test_a_lone_surrogate_anywhere_is_refused(body):
    with pytest.raises(pydantic.ValidationError, match="Unicode"):
        CompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "hi", "chat_template_kwargs": {"name": LONE}}, "chat_template_kwargs"),
        ({"prompt": "hi", "chat_template_kwargs": {LONE: True}}, "chat_template_kwargs"),
        ({"prompt": "hi", "some_extension": [LONE]}, "some_extension"),
    ],
)
def test_fields_kept_unvalidated_are_checked_and_named(body, field):
    with pytest.raises(pydantic.ValidationError, match="Unicode") as caught:
        CompletionRequest.model_validate(body)
    error = validation_error(caught.value.errors())
    assert error.status == 400 and error.message.startswith(field)
    assert error.param == field


def test_a_tool_argument_deep_in_a_chat_is_checked_too():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"enum": [1, LONE]}}}]
    with pytest.raises(pydantic.ValidationError, match="Unicode"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools})


def test_a_large_logit_bias_is_accepted():
    bias = {str(t): 1.0 for t in range(100, 1124)}
    req = CompletionRequest.model_validate({"prompt": "hi", "logit_bias": bias})
    assert len(req.logit_bias) == 1024 and req.logit_bias[100] == 1.0


def test_a_valid_body_is_checked_without_walking_it_in_python(monkeypatch):
    """The walk runs only to name the field of a body that holds a lone surrogate: a 128-tool body checked
    string by string holds the GIL that the engine thread shares for milliseconds."""
    from infer.bench.stress_fairness import heavy_request

    walked, walk = [], protocol._check_unicode
    monkeypatch.setattr(protocol, "_check_unicode", lambda *args: walked.append(args) or walk(*args))
    _, body = heavy_request("tools", "m", 0, max_model_len=2048)
    ChatCompletionRequest.model_validate(body)
    assert walked == []
    body["tools"][-1]["function"]["description"] = LONE
    with pytest.raises(pydantic.ValidationError, match=r"tools\[127\]\.function\.description holds invalid"):
        ChatCompletionRequest.model_validate(body)
