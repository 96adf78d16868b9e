"""The reasoning parsers (infer.server.reasoning), without a model: the outputs of vLLM's tests
(tests/reasoning/test_qwen3_reasoning_parser.py, test_deepseekr1_reasoning_parser.py), read whole and
streamed in random splits, which must accumulate to the same reasoning and content."""

# ruff: noqa: E501 (the model outputs read best one to a line)

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from infer.server.reasoning import REASONING_PARSERS, split, thinking

TOOL_CALL_BODY = "<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n</function>\n</tool_call>"

# (output, reasoning, content), for both parsers
COMMON = [
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is the rest", "This is the rest", None),  # thinking never closed (cut short): all reasoning
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This is a reasoning\nsection</think>This is the rest\nThat", "This is a reasoning\nsection", "This is the rest\nThat"),
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    ("This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("</think>This is the rest", None, "This is the rest"),
    ("", None, None),
    ("\n<think>This is a reasoning section</think>\nThis is the rest", "This is a reasoning section", "\nThis is the rest"),
    ("<thinking is not the tag</think>ok", "<thinking is not the tag", "ok"),
    ("<think>a </thin k> b</think>c", "a </thin k> b", "c"),
]  # fmt: skip
QWEN3_ONLY = [
    ("I need to read the file.\n\n" + TOOL_CALL_BODY, "I need to read the file.\n\n", TOOL_CALL_BODY),
    ("<think>I need to read the file.\n\n" + TOOL_CALL_BODY, "I need to read the file.\n\n", TOOL_CALL_BODY),
]


def _streamed(name: str, pieces: list[str], enabled: bool = True) -> tuple[str | None, str | None]:
    parser = REASONING_PARSERS[name](enabled)
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return (reasoning + r) or None, (content + c) or None


def _pieces(text: str, rng: random.Random) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _check(name: str, output: str, reasoning: str | None, content: str | None, enabled: bool = True) -> None:
    assert split(REASONING_PARSERS[name](enabled), output) == (reasoning, content)
    rng = random.Random(output)
    for pieces in [[output], list(output), *(_pieces(output, rng) for _ in range(20))]:
        assert _streamed(name, pieces, enabled) == (reasoning, content)


@pytest.mark.parametrize("output, reasoning, content", COMMON + QWEN3_ONLY)
def test_qwen3(output, reasoning, content):
    _check("qwen3", output, reasoning, content)


@pytest.mark.parametrize("output, reasoning, content", COMMON)
def test_deepseek_r1(output, reasoning, content):
    _check("deepseek_r1", output, reasoning, content)


def test_deepseek_r1_leaves_a_tool_call_in_the_thinking():
    _check("deepseek_r1", "think " + TOOL_CALL_BODY, "think " + TOOL_CALL_BODY, None)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize(
    "output", ["This is plain content", "I need to read the file.\n\n" + TOOL_CALL_BODY, "a</think>b"]
)
def test_thinking_disabled_is_all_content(name, output):
    _check(name, output, None, output, enabled=False)


@pytest.mark.parametrize(
    "deltas, reasoning, content",
    [
        (["<think>This is a reasoning section", "</think>", "This is the rest"], "This is a reasoning section", "This is the rest"),
        (["reasoning section", "</think>This is the rest"], "reasoning section", "This is the rest"),
        (["<think>reasoning</think>"], "reasoning", None),
        (["I need to read the file.\n\n", "<tool_call>\n<function=bash>"], "I need to read the file.\n\n", "<tool_call>\n<function=bash>"),
    ],
)  # fmt: skip
def test_multi_token_deltas(deltas, reasoning, content):
    assert _streamed("qwen3", deltas) == (reasoning, content)


def test_a_tag_split_across_deltas_is_held_not_sent():
    parser = REASONING_PARSERS["qwen3"]()
    assert parser.feed("<think>abc</th") == ("abc", "")
    assert parser.feed("ink>x") == ("", "x")


def test_enable_thinking():
    assert thinking(None) and thinking({}) and thinking({"enable_thinking": True})
    assert not thinking({"enable_thinking": False}) and not thinking({"thinking": False})


# the chat handler's reading of one choice: thinking apart, then the calls in the answer

THOUGHT_AND_CALL = (
    "<think>The user wants the weather; I call get_weather.</think>\n\nLet me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def _chat(tool_call_parser: str | None = "hermes", **fields):
    from infer.server.chat import _Chat
    from infer.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "weather?"}],
        tools=[{"type": "function", "function": {"name": "get_weather"}}],
        **fields,
    )
    state = SimpleNamespace(args=SimpleNamespace(tool_call_parser=tool_call_parser, model_name="m"))
    return _Chat(state, body, "chatcmpl-1", [1], "qwen3"), state, body


def _stream_message(pieces: list[str], **fields) -> tuple[dict, str | None]:
    """The deltas of `pieces` (the last finishing with "stop") accumulated as a client does."""
    from infer.server.chat import _Readers

    _, state, body = _chat(**fields)
    readers = _Readers(state, body, "qwen3")
    message, reason = {"reasoning_content": "", "content": "", "tool_calls": {}}, None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = SimpleNamespace(text=piece, finished=last, finish_reason="stop" if last else None)
        delta, reason = readers.delta(0, out)
        assert delta.get("reasoning") == delta.get("reasoning_content")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        message["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            entry = message["tool_calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                assert entry["name"] is None, "a call named twice"
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    return message, reason


def test_tool_calls_are_read_in_the_answer_after_the_thinking():
    chat, _, _ = _chat()
    message, reason = chat._message(THOUGHT_AND_CALL, "stop")
    assert reason == "tool_calls"
    assert (
        message["reasoning_content"]
        == message["reasoning"]
        == "The user wants the weather; I call get_weather."
    )
    assert message["content"] == "\n\nLet me check."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    rng = random.Random(0)
    for pieces in [
        [THOUGHT_AND_CALL],
        list(THOUGHT_AND_CALL),
        *(_pieces(THOUGHT_AND_CALL, rng) for _ in range(20)),
    ]:
        streamed, streamed_reason = _stream_message(pieces)
        assert streamed_reason == "tool_calls"
        assert streamed["reasoning_content"] == message["reasoning_content"]
        assert streamed["content"] == message["content"]
        assert streamed["tool_calls"] == {0: call["function"]}


def test_a_text_answer_and_thinking_cut_short():
    chat, _, _ = _chat(tool_call_parser=None)
    message, reason = chat._message("<think>I could call get_weather()</think>It is sunny.", "stop")
    assert (message["reasoning_content"], message["content"], reason) == (
        "I could call get_weather()",
        "It is sunny.",
        "stop",
    )
    chat, _, _ = _chat()
    message, reason = chat._message("<think>I should call get_weather with", "length")
    assert message["reasoning_content"] == "I should call get_weather with"
    assert message["content"] is None and "tool_calls" not in message and reason == "length"


def test_enable_thinking_false_makes_it_all_the_answer():
    chat, _, _ = _chat(tool_call_parser=None, chat_template_kwargs={"enable_thinking": False})
    message, _ = chat._message("No thinking here</think> still answer", "stop")
    assert (
        message["content"] == "No thinking here</think> still answer" and message["reasoning_content"] is None
    )


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_random_text_splits_the_same_however_it_streams(name):
    fragments = [
        "<think>",
        "</think>",
        "<th",
        "</thi",
        "<tool_call>",
        "<tool",
        "<",
        ">",
        "/",
        " ",
        "\n",
        "a",
        "é",
    ]
    rng = random.Random(name)
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 30)))
        reasoning, content = split(REASONING_PARSERS[name](), text)
        assert _streamed(name, _pieces(text, rng)) == (reasoning, content)


# a forced tool_choice: the model thinks first, then the grammar holds the calls after `</think>`

THOUGHT_AND_FORCED_CALL = (
    '<think>Paris, so get_weather.</think>[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
)


def _forced_stream(pieces: list[str], **fields) -> tuple[dict, str | None]:
    from infer.server.chat import _StreamedCalls

    _, _, body = _chat(tool_call_parser=None, tool_choice="required", **fields)
    calls = _StreamedCalls(body, "qwen3")
    message, reason = {"reasoning_content": "", "tool_calls": {}}, None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = SimpleNamespace(text=piece, finished=last, finish_reason="stop" if last else None)
        delta, reason = calls.delta(0, out)
        assert "content" not in delta and delta.get("reasoning") == delta.get("reasoning_content")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", ()):
            entry = message["tool_calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    return message, reason


def test_forced_calls_follow_the_thinking():
    chat, _, _ = _chat(tool_call_parser=None, tool_choice="required")
    message, reason = chat._message(THOUGHT_AND_FORCED_CALL, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == message["reasoning"] == "Paris, so get_weather."
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    rng = random.Random(1)
    for pieces in [
        list(THOUGHT_AND_FORCED_CALL),
        *(_pieces(THOUGHT_AND_FORCED_CALL, rng) for _ in range(10)),
    ]:
        streamed, streamed_reason = _forced_stream(pieces)
        assert streamed_reason == "tool_calls"
        assert streamed["reasoning_content"] == message["reasoning_content"]
        [entry] = streamed["tool_calls"].values()
        assert entry["name"] == "get_weather" and json.loads(entry["arguments"]) == {"city": "Paris"}


def test_forced_calls_cut_short_while_thinking_are_none():
    chat, _, _ = _chat(tool_call_parser=None, tool_choice="required")
    message, reason = chat._message("<think>Paris, so", "length")
    assert message["reasoning_content"] == "Paris, so" and "tool_calls" not in message
    assert reason == "length"


def test_forced_calls_without_thinking_are_the_whole_output():
    fields = {"tool_choice": "required", "chat_template_kwargs": {"enable_thinking": False}}
    chat, _, _ = _chat(tool_call_parser=None, **fields)
    message, reason = chat._message(THOUGHT_AND_FORCED_CALL.split("</think>")[1], "stop")
    assert reason == "tool_calls" and message["reasoning_content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_with_reasoning_starts_a_forced_call_grammar_after_the_thinking():
    from infer.sampling_params import SamplingParams
    from infer.server.chat import with_reasoning
    from infer.structured_outputs.constraint import StructuredOutputs

    _, _, body = _chat(tool_call_parser=None, tool_choice="required")
    end_ids = (7, 8)
    state = SimpleNamespace(
        args=SimpleNamespace(reasoning_parser="qwen3"),
        llm=SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text, add_special_tokens: list(end_ids))),
    )
    params = SamplingParams(structured_outputs=StructuredOutputs(json={"type": "array"}))
    reasoning, params = with_reasoning(state, body, params)
    assert reasoning == "qwen3" and params.grammar_after_ids == end_ids
