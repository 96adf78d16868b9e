"""The five serving workloads without a server: shapes, scale presets, reproducible prompts, the cache
buster."""

from __future__ import annotations

import pytest

from infer.bench.prompts import PromptFactory, load_corpus
from infer.bench.workloads import SCALES, WORKLOADS, Scale, Workload, get_workloads


def test_the_five_workloads_of_seed_002():
    w = WORKLOADS
    assert list(w) == [
        "baseline",
        "continuous_batching",
        "paged_attention",
        "chunked_prefill",
        "prefix_caching",
    ]
    assert [x.num_requests for x in w.values()] == [10, 32, 48, 48, 48]
    assert w["baseline"].arrival == "synchronous" and w["paged_attention"].arrival == "burst"
    assert w["continuous_batching"].arrival == "constant:4" and w["chunked_prefill"].arrival == "poisson:6"
    assert w["prefix_caching"].shared_prefix_tokens == 1024
    assert w["chunked_prefill"].prompt_tokens == ((0.75, 1024, 2048), (0.25, 64, 128))


@pytest.mark.parametrize("scale", list(SCALES))
def test_scales_keep_each_workloads_character(scale):
    for w in get_workloads("all", scale):
        full = WORKLOADS[w.name]
        assert w.arrival.split(":")[0] == full.arrival.split(":")[0]
        assert len(w.prompt_tokens) == len(full.prompt_tokens)
        assert [s for s, _, _ in w.prompt_tokens] == [s for s, _, _ in full.prompt_tokens]
        assert (w.shared_prefix_tokens > 0) == (full.shared_prefix_tokens > 0)
        if scale != "full":
            assert w.longest() <= 0.8 * 1024  # fits the embedded model's context
    cp = get_workloads("chunked_prefill", scale)[0].prompt_tokens
    assert cp[0][1] > cp[1][2]  # long prompts stay longer than short ones


def test_build_is_reproducible_and_follows_the_shape():
    w = get_workloads("chunked_prefill", "small")[0]
    a, b = w.build(42), w.build(42)
    assert a == b and len(a) == w.num_requests
    assert a != w.build(43)
    (_, long_lo, long_hi), (_, short_lo, short_hi) = w.prompt_tokens
    for spec in a:
        assert (
            long_lo <= spec.target_prompt_tokens <= long_hi
            or short_lo <= spec.target_prompt_tokens <= short_hi
        )
        assert w.max_tokens[0] <= spec.max_tokens <= w.max_tokens[1]
    # workloads with the same seed still draw different text
    assert get_workloads("baseline", "small")[0].build(42)[0].prompt[:40] != a[0].prompt[:40]


def test_cache_buster_and_shared_prefix():
    w = get_workloads("prefix_caching", "small")[0]
    specs = w.build(42, nonce="abc")
    head = specs[0].prompt[: w.shared_prefix_tokens * 3]
    assert specs[0].prompt.startswith("[abc] ")
    assert all(s.prompt.startswith(head) for s in specs)  # one shared prefix in this run
    assert not w.build(42, nonce="xyz")[0].prompt.startswith(head)  # another run: another prefix
    plain = get_workloads("baseline", "small")[0].build(42, nonce="abc")
    assert [s.prompt.split("]")[0] for s in plain[:2]] == ["[abc 0", "[abc 1"]


def test_build_fits_the_context():
    w = Workload("long", 4, ((1.0, 2000, 2000),), (100, 100), "burst")
    for spec in w.build(0, max_model_len=1024):
        assert spec.target_prompt_tokens + spec.max_tokens <= 0.8 * 1024
    with pytest.raises(ValueError, match="smaller --scale"):
        Workload("huge", 1, ((1.0, 8, 8),), (1000, 1000), "burst").build(0, max_model_len=1024)


def test_prompts_are_english_of_about_the_asked_length():
    f = PromptFactory(1)
    text = f.text(100)
    assert 300 <= len(text) <= 400 and " the " in text
    assert text in load_corpus()


def test_bad_names_and_shapes():
    with pytest.raises(ValueError, match="unknown workload"):
        get_workloads("nope")
    with pytest.raises(ValueError, match="unknown scale"):
        get_workloads("all", "huge")
    with pytest.raises(ValueError, match="shares"):
        Workload("x", 1, ((0.5, 1, 2),), (1, 1), "burst")
    with pytest.raises(ValueError, match="arrival"):
        Workload("x", 1, ((1.0, 1, 2),), (1, 1), "uniform")
    assert get_workloads("baseline", Scale(requests=0.01))[0].num_requests == 2
