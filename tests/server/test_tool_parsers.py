"""The parsers of a model's own tool calls (infer.server.tool_parsers), without a model: the outputs of
vLLM's parser tests (tests/tool_parsers in vLLM's repository) and our own edge cases, read whole and
streamed in random splits. A stream must name each call once, never send call text as content, and
accumulate to what the whole text gives."""

# ruff: noqa: E501 (the model outputs read best one to a line)

from __future__ import annotations

import json
import random

import pytest

from infer.server.tool_call_parser import CallDelta
from infer.server.tool_parsers import TOOL_PARSERS, extract, tool_parser_class


def _whole(name: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    found = extract(tool_parser_class(name)(), text)
    for call in found.calls:
        assert call["type"] == "function" and call["id"]
    return found.content, [(c["function"]["name"], c["function"]["arguments"]) for c in found.calls]


def _pieces(text: str, rng: random.Random) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 20))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _streamed(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], bool]:
    """(content, calls, broken) as a client accumulates the deltas of `pieces`."""
    parser = tool_parser_class(name)()
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        out = parser.feed(piece) + (parser.finish() if i == len(pieces) - 1 else [])
        for item in out:
            if isinstance(item, str):
                assert item, "an empty content delta"
                content += item
                continue
            assert isinstance(item, CallDelta)
            if item.name is not None:
                assert item.index not in calls, "a call named twice"
                assert item.index == len(calls), "calls out of order"
                calls[item.index] = [item.name, ""]
            calls[item.index][1] += item.arguments
    return content, [tuple(c) for _, c in sorted(calls.items())], parser.broken


def _check(name: str, text: str, content: str | None, calls: list[tuple[str, object]]) -> None:
    """Read whole and in 30 random splits: the content, and each call's name and arguments (as JSON)."""
    whole_content, whole_calls = _whole(name, text)
    assert whole_content == (content if calls else text or None)
    assert [(n, json.loads(a)) for n, a in whole_calls] == calls
    rng = random.Random(text)
    for pieces in [[text], list(text), *(_pieces(text, rng) for _ in range(30))]:
        streamed_content, streamed_calls, broken = _streamed(name, pieces)
        assert not broken
        assert streamed_calls == whole_calls  # argument text exactly as the response that is not streamed
        assert streamed_content == (content or "" if calls else text)


# hermes: vLLM's tests/tool_parsers/test_hermes_tool_parser.py


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("This is some prior text that has nothing to do with tool calling.", None, []),
        (
            '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>',
            None,
            [("final_answer", {"trigger": True})],
        ),
        (
            '<tool_call>{"name": "get_current_temperature",\n"arguments": {"location":\n'
            '"San Francisco, California, United States", "unit": "celsius"}}</tool_call>',
            None,
            [
                (
                    "get_current_temperature",
                    {"location": "San Francisco, California, United States", "unit": "celsius"},
                )
            ],
        ),
        (
            'Sure, let me check the weather.<tool_call>{"name": "get_weather", "arguments": {"city": "NYC"}}'
            "</tool_call>",
            "Sure, let me check the weather.",
            [("get_weather", {"city": "NYC"})],
        ),
        (
            '<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>',
            None,
            [("search", {"q": "cats"}), ("search", {"q": "dogs"})],
        ),
        ('Hi!<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "Hi!", [("f", {"x": 1})]),
        # a call that runs to the end of the output without its closing tag is still a call
        (
            '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}',
            None,
            [("final_answer", {"trigger": True})],
        ),
    ],
)
def test_hermes(text, content, calls):
    _check("hermes", text, content, calls)


def test_hermes_arguments_are_the_text_as_written():
    _, calls = _whole(
        "hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>'
    )
    assert calls == [("final_answer", '{"trigger": true}')]


@pytest.mark.parametrize(
    "value, arguments",
    [
        (
            '{"param": "max_connections"}',
            '{"param": "max_connections"}',
        ),  # serialized arguments: unwrapped once
        ("hello", '"hello"'),  # any other string stays the JSON string it is
        ("{hello world}", '"{hello world}"'),
        ("[oops", '"[oops"'),
        ('{"a": 1} tail text', '"{\\"a\\": 1} tail text"'),
    ],
)
def test_hermes_string_arguments(value, arguments):
    text = "<tool_call>" + json.dumps({"name": "f", "arguments": value}) + "</tool_call>"
    assert _whole("hermes", text) == (None, [("f", arguments)])
    _check("hermes", text, None, [("f", json.loads(arguments))])


def test_hermes_invalid_json_is_text():
    """vLLM's: a call missing its closing brace is no call; the whole output is the content."""
    text = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}'
    assert _whole("hermes", text) == (text, [])


# llama3_json: vLLM's tests/tool_parsers/test_llama3_json_tool_parser.py


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}', None,
         [("searchTool", {"query": "test query", "limit": 10})]),
        ("This is just some text without any tool calls", None, []),
        ('{"name": "searchTool", "arguments": {"query": "test"}}', None, [("searchTool", {"query": "test"})]),
        (
            '{"name": "searchTool", "parameters": {"query": "test1"}}; '
            '{"name": "getOpenIncidentsTool", "parameters": {}}; '
            '{"name": "searchTool", "parameters": {"query": "test2"}}',
            None,
            [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})],
        ),
        (
            '{"name": "searchTool", "parameters": {"query": "test1"}} ; '
            '{"name": "getOpenIncidentsTool", "parameters": {}} ;\n'
            '{"name": "searchTool", "parameters": {"query": "test2"}}',
            None,
            [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})],
        ),
        (
            '{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}}',
            None,
            [("complexTool", {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}})],
        ),
        (
            '{"name": "searchTool", "parameters": {"query": "test {value} [complex]",'
            '"nested": {"inner": "more {brackets}"}}}',
            None,
            [("searchTool", {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}})],
        ),
        (
            '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
            None,
            [("parserTool", {"text": 'He said "Hello {world}"'})],
        ),
        # trailing prose after the call, with braces or JSON in it, does not undo the call
        ('{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.', None,
         [("searchTool", {"query": "test"})]),
        ('{"name": "searchTool", "parameters": {"query": "test"}} The arguments I passed were {"query": "test"}',
         None, [("searchTool", {"query": "test"})]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
         [("get_weather", {"city": "Paris"})]),
        # an object that is no call (no name, or no arguments) stays text
        ('{"parameters": {}}', None, []),
        ('{"name": "toolWithoutParams"}', None, []),
        # text before a call is the content
        ('Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
         "Here is the result: ", [("getOpenIncidentsTool", {})]),
    ],
)  # fmt: skip
def test_llama3_json(text, content, calls):
    _check("llama3_json", text, content, calls)


def test_llama3_json_invalid_json_is_text():
    text = '{"name": "invalidTool", "parameters": {invalid json}'
    assert _whole("llama3_json", text) == (text, [])


# mistral: vLLM's tests/tool_parsers/test_mistral_tool_parser.py

ADD = ("add", {"a": 3.5, "b": 4})
WEATHER_SF = ("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("This is a test", None, []),
        ('[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', None, [ADD]),
        ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", '
         '"unit": "celsius"}}]', None, [WEATHER_SF]),
        ('[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, '
         '"name": "get_current_weather"}]', None, [WEATHER_SF]),
        ('[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', None,
         [("get_age", {"name": "John Doe"})]),
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", '
         '"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]', None, [ADD, WEATHER_SF]),
        ('Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]', "Hello", [("add", {"a": 1, "b": 2})]),
        ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", "state": "TX", '
         '"unit": "fahrenheit"}}]\nextra trailing data', None,
         [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})]),
        ('[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]', None, [("add", {"a": 3, "b": 4})]),
        # tokenizers v11 on: the name, then the arguments object
        ('[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', None, [("add_this_and_that", {"a": 3.5, "b": 4})]),
        ('[TOOL_CALLS]get_current_weather{"city": "San Francisco", "state": "CA", "unit": "celsius"}', None,
         [WEATHER_SF]),
        ('[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', None,
         [ADD, ("multiply", {"a": 3, "b": 6})]),
        ('bla[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', "bla", [("add_this_and_that", {"a": 3.5, "b": 4})]),
        ('hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}', "hi{hi",
         [("bash", {"command": "print(\"hello world!\")\nre.compile(r'{}')"})]),
    ],
)  # fmt: skip
def test_mistral(text, content, calls):
    _check("mistral", text, content, calls)


def test_mistral_ids_are_nine_letters_and_digits():
    found = extract(tool_parser_class("mistral")(), '[TOOL_CALLS]add{"a": 1}')
    [call] = found.calls
    assert len(call["id"]) == 9 and call["id"].isalnum()


def test_mistral_not_json_after_the_token_is_text():
    text = "[TOOL_CALLS] not json at all"
    assert _whole("mistral", text) == (text, [])


# pythonic: vLLM's tests/tool_parsers/test_pythonic_tool_parser.py

SIMPLE = "get_weather(city='San Francisco', metric='celsius')"
SIMPLE_CALL = ("get_weather", {"city": "San Francisco", "metric": "celsius"})
MORE_TYPES = (
    "register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, role=None, "
    "passed_test=True, aliases=['John', 'Johnny'])"
)
MORE_TYPES_CALL = (
    "register_user",
    {
        "name": "John Doe",
        "age": 37,
        "address": {"city": "San Francisco", "state": "CA"},
        "role": None,
        "passed_test": True,
        "aliases": ["John", "Johnny"],
    },
)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("How can I help you today?", None, []),
        (f"[{SIMPLE}]", None, [SIMPLE_CALL]),
        (f"[{MORE_TYPES}]", None, [MORE_TYPES_CALL]),
        ("[get_weather()]", None, [("get_weather", {})]),
        ("[do_something_cool(additional_data={})]", None, [("do_something_cool", {"additional_data": {}})]),
        ("[do_something_cool(steps=[])]", None, [("do_something_cool", {"steps": []})]),
        (r"[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]", None,
         [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})]),
        (f"[{SIMPLE}, {MORE_TYPES}]", None, [SIMPLE_CALL, MORE_TYPES_CALL]),
        (f"[{SIMPLE}, get_weather(), do_something_cool(steps=[])]", None,
         [SIMPLE_CALL, ("get_weather", {}), ("do_something_cool", {"steps": []})]),
        # a call with no JSON form is left out, its siblings kept
        (f"[bad(x=b'z'), {SIMPLE}]", None, [SIMPLE_CALL]),
        (f"[calc(x=1e999), {SIMPLE}]", None, [SIMPLE_CALL]),
    ],
)  # fmt: skip
def test_pythonic(text, content, calls):
    _check("pythonic", text, content, calls)


def test_pythonic_exact_arguments():
    assert _whole("pythonic", f"[{SIMPLE}]")[1] == [
        ("get_weather", '{"city": "San Francisco", "metric": "celsius"}')
    ]


@pytest.mark.parametrize("text", ["[f(a='x 'y' 'z), g(b='p 'q' 'r)]", "[foo(x=1])]", "Sure: [get_weather()]"])
def test_pythonic_no_call_is_text(text):
    assert _whole("pythonic", text) == (text, [])


# our own edge cases, for every parser


def _written(name: str, calls: list[tuple[str, str]]) -> str:
    """`calls` (name, arguments text) as the parser's model family writes them."""
    if name == "hermes":
        return "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>\n' for n, a in calls)
    if name == "llama3_json":
        return "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls)
    if name == "mistral":
        return "".join(f"[TOOL_CALLS]{n}{a}" for n, a in calls)
    args = [", ".join(f"{k}={v!r}" for k, v in json.loads(a).items()) for _, a in calls]
    return "[" + ", ".join(f"{n}({a})" for (n, _), a in zip(calls, args, strict=True)) + "]"


TWO = [("get_weather", '{"city": "Zürich", "days": [1, 2], "opts": {"unit": "°C", "nested": {"deep": [{}]}}}'),
       ("get_time", '{"zone": "日本"}')]  # fmt: skip


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_two_calls_with_nested_unicode_arguments(name):
    text = _written(name, TWO)
    _check(name, text, None, [(n, json.loads(a)) for n, a in TWO])


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_text_before_a_call_is_the_content(name):
    text = "Let me look that up. " + _written(name, TWO[:1])
    _check(name, text, "Let me look that up. ", [(TWO[0][0], json.loads(TWO[0][1]))])


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("cut", [5, 12, 25, -3, -1])
def test_a_call_cut_short_is_text_and_never_leaks_into_a_stream(name, cut):
    """A call cut by max_tokens: the response that is not streamed returns the text (vLLM's); the
    stream has sent no part of the call as content."""
    whole = _written(name, TWO[:1]).rstrip()
    if name == "hermes":
        whole = whole.removesuffix("</tool_call>").rstrip()
    text = whole[:cut]
    assert _whole(name, text) == (text, [])
    for pieces in ([text], list(text)):
        content, calls, _ = _streamed(name, pieces)
        assert content in ("", text)  # held call text is content only when no call was announced
        assert not (content and calls)


@pytest.mark.parametrize(
    "name, text",
    [
        ("hermes", "<tool_call>not json</tool_call> and more"),
        ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
        ("hermes", "I use <tool_ tags <tool_call"),
        ("llama3_json", 'a {set} of {braces} and {"quoted": 1}'),
        ("mistral", "[TOOL_CALLS] [1, 2]"),
        ("mistral", "[TOOL_"),
        ("pythonic", "[1, 2, 3]"),
        ("pythonic", "[]"),
    ],
)
def test_malformed_calls_are_text(name, text):
    _check(name, text, None, [])


def test_every_parser_is_registered_under_vllms_name():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="hermes"):
        tool_parser_class("qwen_xml")


FRAGMENTS = ['<tool_call>', '</tool_call>', '<tool_', '[TOOL_CALLS]', '<|python_tag|>', '{', '}', '[', ']', '(',
             ')', '"', '\\', ':', ',', ';', '=', "'", ' ', '\n', '"name"', '"arguments"', '"parameters"', '"f"',
             'f', 'x', '1', 'true', 'null', 'é', '日']  # fmt: skip


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_random_text_never_fails_and_streams_as_it_reads_whole(name):
    """Text built from the formats' own pieces, at random: no exception (a 500), every call's arguments
    that the response returns are JSON, and a stream that ends well accumulates to the same calls."""
    rng = random.Random(name)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40)))
        content, calls = _whole(name, text)
        for _, arguments in calls:
            json.loads(arguments)
        if not calls:
            assert content == (text or None)
        streamed_content, streamed_calls, broken = _streamed(name, _pieces(text, rng))
        if calls:
            assert streamed_calls == calls and streamed_content == (content or "")
        elif not broken and not streamed_calls:
            assert streamed_content == text
