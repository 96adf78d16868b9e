"""The stop-string automaton against a plain scan: same first match, same held-back length."""

from __future__ import annotations

import random

import pytest

from infer.engine.stop_strings import StopStrings
from infer.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, SamplingParams


def first_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The first position where a stop string ends (the longest of those ending there)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def partial_len(text: str, stops: list[str]) -> int:
    return max((n for n in range(1, len(text) + 1) for s in stops if s.startswith(text[-n:])), default=0)


def test_against_a_plain_scan():
    rng = random.Random(5)
    for _ in range(2000):
        alphabet = "abc" if rng.random() < 0.7 else "ab世"
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 20)))
        matcher, fed, got = StopStrings(stops), 0, None
        while fed < len(text) and got is None:  # fed in random pieces, as tokens come
            piece = text[fed : fed + rng.randint(1, 4)]
            found = matcher.feed(piece)
            got = None if found is None else (fed + found[0], found[1])
            fed += len(piece)
            if got is None:
                assert matcher.partial_len == partial_len(text[:fed], stops), (stops, text[:fed])
        assert got == first_match(text, stops), (stops, text)


def test_many_long_stop_strings():
    rng = random.Random(1)
    stops = ["".join(rng.choices("xyz", k=MAX_STOP_STRING_LEN)) for _ in range(MAX_STOP_STRINGS)]
    matcher = StopStrings(stops)
    text = "".join(rng.choices("xyz", k=300)) + stops[77] + "tail"
    end, stop = matcher.feed(text)
    assert stop == stops[77] and text[:end].endswith(stop) and end <= len(text) - 4


def test_bounds():
    SamplingParams(stop=["x" * MAX_STOP_STRING_LEN] * MAX_STOP_STRINGS)
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_LEN + 1)])
    bad_values = dict(seed=2**63, top_k=2**63, temperature=float("inf"), top_p=float("nan"), min_p=-0.0 - 1)
    for name, value in bad_values.items():
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})
    assert SamplingParams(temperature=1e-50).greedy and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_requests_with_the_same_stop_strings_share_one_automaton_and_keep_their_own_place():
    stops = ["ab", "bc"]
    first, second = StopStrings(stops), StopStrings(tuple(stops))
    assert first._automaton is second._automaton  # built once (the server builds it off the engine thread)
    assert first.feed("xa") is None and first.partial_len == 1
    assert second.feed("xb") is None and second.partial_len == 1  # its own state, not first's
    assert first.feed("b") == (1, "ab") and second.feed("c") == (1, "bc")
