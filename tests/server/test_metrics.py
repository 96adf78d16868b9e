"""/metrics through prometheus-client: the exposition read back by the library's own parsers, every metric
name that infer.server.metrics documents present (and none undocumented), vLLM's buckets, and registries
that do not leak between two apps in one process."""

from __future__ import annotations

import re

import httpx
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from infer.server import metrics as metrics_module
from infer.server.metrics import ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS, Metrics

# the names the module docstring lists (the documentation of /metrics), by their vLLM suffixes
DOCUMENTED = set(re.findall(r"\b[a-z0-9_]+_(?:seconds|total|running|waiting|perc)\b", metrics_module.__doc__))
HISTOGRAM_BUCKETS = {
    "time_to_first_token_seconds": TTFT_BUCKETS,
    "inter_token_latency_seconds": ITL_BUCKETS,
    "e2e_request_latency_seconds": LATENCY_BUCKETS,
    "request_queue_time_seconds": LATENCY_BUCKETS,
}


def families(text: str) -> dict:
    """name as documented (a counter's with its `_total`) -> the parsed family."""
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("infer:"), family.name
        name = family.name.removeprefix("infer:") + ("_total" if family.type == "counter" else "")
        out[name] = family
    return out


def value(family, suffix: str = "", **labels) -> float:
    return sum(
        s.value for s in family.samples if s.name.endswith(suffix) and labels.items() <= s.labels.items()
    )


def test_documented_names_are_vllms_thirteen_and_one_of_ours():
    assert len(DOCUMENTED) == 14 and set(HISTOGRAM_BUCKETS) <= DOCUMENTED, DOCUMENTED
    assert "num_interrupted_steps_total" in DOCUMENTED


def test_exposition_parses_with_every_documented_name(server, client, model):
    prompt = "In the beginning God created the heaven and the earth. " * 6  # whole KV blocks: a prefix hit
    for _ in range(2):
        client.completions.create(model=model, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
    resp = httpx.get(server.url + "/metrics", timeout=10)
    assert resp.headers["content-type"].startswith("text/plain")
    found = families(resp.text)
    assert set(found) == DOCUMENTED
    for name, family in found.items():
        assert all(s.labels["model_name"] == "embedded" for s in family.samples), name
    for name, buckets in HISTOGRAM_BUCKETS.items():
        family = found[name]
        assert family.type == "histogram"
        bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
        assert bounds == [*buckets, float("inf")], name  # vLLM's buckets, so that quantiles compare
        assert value(family, "_count") > 0 and value(family, "_bucket", le="+Inf") == value(family, "_count")
    assert value(found["generation_tokens_total"]) >= 4 and value(found["prompt_tokens_total"]) > 0
    assert value(found["request_success_total"], finished_reason="length") >= 1
    assert {s.labels["finished_reason"] for s in found["request_success_total"].samples} == {
        "stop",
        "length",
        "abort",
    }
    assert value(found["prefix_cache_queries_total"]) >= value(found["prefix_cache_hits_total"]) > 0
    assert 0.0 <= value(found["kv_cache_usage_perc"]) <= 1.0
    for name in ("num_requests_running", "num_requests_waiting", "num_preemptions_total"):
        assert found[name].type == ("counter" if name.endswith("_total") else "gauge")
        assert value(found[name]) >= 0


def test_openmetrics_when_asked(server):
    """A scraper that asks for OpenMetrics (Prometheus does) gets it, and the library's parser reads it."""
    accept = "application/openmetrics-text; version=1.0.0"
    resp = httpx.get(server.url + "/metrics", headers={"Accept": accept}, timeout=10)
    assert resp.headers["content-type"].startswith("application/openmetrics-text")
    names = {f.name.removeprefix("infer:") for f in parse_openmetrics(resp.text)}
    assert {"time_to_first_token_seconds", "prompt_tokens", "num_requests_running"} <= names


def test_each_app_has_its_own_registry():
    """Two servers in one process (as in tests) keep separate counts; no engine yet means no gauges."""
    first, second = Metrics("a"), Metrics("b")
    first.ttft.observe(0.003)
    first.finished["stop"].inc()
    a = families(first.render(None)[0].decode())
    b = families(second.render(None)[0].decode())
    assert value(a["time_to_first_token_seconds"], "_count") == 1
    assert value(a["time_to_first_token_seconds"], "_bucket", le="0.005") == 1
    assert value(a["request_success_total"], finished_reason="stop") == 1
    assert value(b["time_to_first_token_seconds"], "_count") == 0
    assert value(b["request_success_total"]) == 0
    assert "num_requests_running" not in a  # read from the engine at scrape time, which is not loaded


def test_spec_decode_counters_with_a_speculative_config():
    """vLLM's spec_decode_* counters, read from the scheduler; absent without a speculative config."""
    from types import SimpleNamespace

    from infer.config import SpeculativeConfig
    from infer.server.metrics import _EngineCollector

    kv = SimpleNamespace(usage=0.5, num_query_tokens=0, num_hit_tokens=0)
    sched = SimpleNamespace(num_running=1, num_waiting=0, num_preemptions=0, kv_cache_manager=kv)
    sched.num_spec_drafts, sched.num_spec_draft_tokens, sched.num_spec_accepted_tokens = 5, 15, 7
    sched.num_spec_accepted_per_pos = [4, 3]
    metrics = SimpleNamespace(engine=None)
    collector = _EngineCollector(metrics, "m")
    for spec, expected in (
        (None, set()),
        (SpeculativeConfig(num_speculative_tokens=3), {"drafts", "per_pos"}),
    ):
        metrics.engine = SimpleNamespace(
            scheduler=sched, config=SimpleNamespace(speculative_config=spec), num_interrupted_steps=0
        )
        found = {f.name.removeprefix("infer:"): f for f in collector.collect()}
        spec_names = {n for n in found if n.startswith("spec_decode")}
        if not expected:
            assert not spec_names
            continue
        assert spec_names == {
            "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos",
        }
        assert found["spec_decode_num_accepted_tokens"].samples[0].value == 7
        per_pos = {
            s.labels["position"]: s.value for s in found["spec_decode_num_accepted_tokens_per_pos"].samples
        }
        assert per_pos == {"0": 4, "1": 3, "2": 0}


def test_pooling_inputs_count_as_finished_requests_with_their_prompt_tokens():
    """vLLM's engine runs each input of a pooling request (an embedded text, a scored pair) as a request
    that stops after its prefill: success{stop} and prompt tokens per input, one e2e latency each."""
    metrics = Metrics("m")
    metrics.observe_pooling([5, 7, 9], latency=0.25)
    metrics.observe_pooling([4], latency=2.0)
    found = families(metrics.render(None)[0].decode())
    assert value(found["prompt_tokens_total"]) == 25
    assert value(found["request_success_total"], finished_reason="stop") == 4
    assert value(found["request_success_total"], finished_reason="length") == 0
    assert value(found["generation_tokens_total"]) == 0
    e2e = found["e2e_request_latency_seconds"]
    assert value(e2e, "_count") == 4 and value(e2e, "_sum") == 0.25 * 3 + 2.0
    assert value(e2e, "_bucket", le="0.3") == 3
