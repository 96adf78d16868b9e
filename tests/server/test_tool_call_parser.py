"""The streaming parser of forced tool-call output (infer.server.tool_call_parser), without a model:
however the text is split, the deltas announce each call once and concatenate to its `parameters`
text exactly as written."""

from __future__ import annotations

import json
import random

import pytest

from infer.server.tool_call_parser import CallDelta, CallListParser, NamedCallParser, parse_calls

TWO_CALLS = (
    '[{"name":"get_weather","parameters":{"city":"Paris","days":[1,2]}},'
    '{"name":"get_time","parameters":{"zone":"CET"}}]'
)


def _streamed(text: str, pieces: list[str]) -> tuple[CallListParser, list[CallDelta]]:
    parser = CallListParser()
    assert "".join(pieces) == text
    return parser, [d for piece in pieces for d in parser.feed(piece)]


def _accumulated(deltas: list[CallDelta]) -> list[tuple[int, str, str]]:
    """(index, name, arguments) per call, as a client accumulates them; a name must come once, first."""
    calls: dict[int, list] = {}
    for d in deltas:
        if d.name is not None:
            assert d.index not in calls, "a call announced twice"
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments
    return [(i, name, args) for i, (name, args) in sorted(calls.items())]


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_two_calls_one_character_at_a_time():
    parser, deltas = _streamed(TWO_CALLS, list(TWO_CALLS))
    assert parser.complete and not parser.failed
    assert _accumulated(deltas) == [
        (0, "get_weather", '{"city":"Paris","days":[1,2]}'),
        (1, "get_time", '{"zone":"CET"}'),
    ]
    # the name comes once it is complete, before any argument, with arguments "" ...
    announced = [d for d in deltas if d.name is not None]
    assert [(d.index, d.name, d.arguments) for d in announced] == [
        (0, "get_weather", ""),
        (1, "get_time", ""),
    ]
    # ... and the arguments stream: one delta per character of them
    assert sum(1 for d in deltas if d.index == 0 and d.arguments) == len('{"city":"Paris","days":[1,2]}')


TEXTS = [
    TWO_CALLS,
    # whitespace anywhere JSON allows it: a call's arguments keep their own, not what surrounds them
    '  [ {\n "name" : "a" ,\t"parameters" :  { "x" : [ 1 , 2 ] , "y" : { } }  } ,'
    '{"name":"b","parameters":{}} ]',
    # brackets, quotes and escapes inside strings are text, not structure
    r'[{"name":"q","parameters":{"s":"}]{[\"\\","t":"\u00e9 ,"}}]',
    # the name's key or value written with escapes
    r'[{"n\u0061me":"get\u005ftime","parameters":{"zone":"UTC"}}]',
    # keys other than name and parameters are skipped, even when they hold a name
    '[{"name":"a","extra":{"name":"z","parameters":{}},"parameters":{"k":null},"more":[1,"]"]}]',
    # scalars as parameters, ended by what follows them
    '[{"name":"a","parameters":-1.5e3},{"name":"b","parameters":true }]',
]


@pytest.mark.parametrize("text", TEXTS)
def test_any_split_gives_the_calls_json_reads(text):
    """Whatever the pieces, the accumulated calls are json's reading of the list, each call's
    arguments the exact text of its parameters value."""
    expected = [(c["name"], c["parameters"]) for c in json.loads(text)]
    whole = parse_calls(CallListParser(), text)
    assert [(c["name"], json.loads(c["arguments"])) for c in whole] == expected
    rng = random.Random(0)
    for _ in range(50):
        parser, deltas = _streamed(text, _random_pieces(text, rng))
        assert parser.complete
        assert _accumulated(deltas) == [(i, c["name"], c["arguments"]) for i, c in enumerate(whole)]


def test_arguments_are_the_text_as_written():
    text = '[{"name":"a","parameters": {"x" : 1 }\n}]'
    assert parse_calls(CallListParser(), text) == [{"name": "a", "arguments": '{"x" : 1 }'}]


def test_parameters_before_the_name_wait_for_it():
    parser = CallListParser()
    assert parser.feed('[{"parameters":{"x":1},"na') == []
    assert parser.feed('me":"f"') == [CallDelta(0, name="f", arguments='{"x":1}')]
    assert parser.feed("}]") == [] and parser.complete


def test_a_call_without_parameters_has_empty_arguments():
    assert parse_calls(CallListParser(), '[{"name":"f"}]') == [{"name": "f", "arguments": "{}"}]


def test_one_feed_holds_one_delta_per_call():
    """A piece that ends one call and starts the next: the first's last arguments, then the second's
    name with what it has of its arguments."""
    parser = CallListParser()
    parser.feed('[{"name":"a","parameters":{"x":')
    assert parser.feed('1}},{"name":"b","parameters":{"y"') == [
        CallDelta(0, arguments="1}"),
        CallDelta(1, name="b", arguments='{"y"'),
    ]


def test_cut_short_keeps_what_was_generated():
    """max_tokens ends the text anywhere: calls whose name is complete keep their partial arguments;
    a name not yet complete is no call; the list is not complete."""
    text = TWO_CALLS[: TWO_CALLS.index("CET")]
    parser = CallListParser()
    assert parse_calls(parser, text) == [
        {"name": "get_weather", "arguments": '{"city":"Paris","days":[1,2]}'},
        {"name": "get_time", "arguments": '{"zone":"'},
    ]
    assert not parser.complete
    assert parse_calls(CallListParser(), '[{"name":"get_wea') == []


def test_text_after_the_list_is_ignored():
    parser = CallListParser()
    calls = parse_calls(parser, '[{"name":"a","parameters":{}}] and then {"name":"b"}')
    assert calls == [{"name": "a", "arguments": "{}"}] and parser.complete
    assert parser.feed('{"name":"c","parameters":{}}') == []


@pytest.mark.parametrize(
    "text", ["hello", '{"name":"a","parameters":{}}', '[{"name":1,"parameters":{}}]', '[{"name" "a"}]']
)
def test_what_is_not_a_list_of_calls_gives_none(text):
    parser = CallListParser()
    assert parse_calls(parser, text) == [] and parser.failed and not parser.complete


def test_a_mismatched_bracket_stops_the_parse():
    parser = CallListParser()
    assert parse_calls(parser, '[{"name":"a","parameters":{"x":[1}}]') == [
        {"name": "a", "arguments": '{"x":[1'}
    ]
    assert parser.failed and not parser.complete


def test_a_named_call_is_announced_with_the_first_piece():
    parser = NamedCallParser("f")
    assert parser.feed("") == [CallDelta(0, name="f", arguments="")]
    assert parser.feed('{"x"') == [CallDelta(0, arguments='{"x"')]
    assert parser.feed("") == []
    assert parse_calls(NamedCallParser("f"), '{"x":1}') == [{"name": "f", "arguments": '{"x":1}'}]
