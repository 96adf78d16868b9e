"""The mixed-traffic harness (`infer bench traffic`): the YAML config without a server, then one
experiment end to end that starts our server itself (`launch`), checking every output file and that
goodput is computed, not typed in (one class with an SLO nothing can meet, one with an SLO everything
meets)."""

from __future__ import annotations

import contextlib
import io
import json

import httpx
import pytest

from infer.bench.client import StreamingClient
from infer.bench.html_report import write_html
from infer.bench.request_timeline import load_trace, request_timelines
from infer.bench.traffic import TRACE_NAME, run_config
from infer.bench.traffic_config import DEFAULTS, build_requests, load_experiments

CONFIG = """
defaults:
  num_requests: 12
  arrival: {mode: poisson, rate: 20, max_concurrency: 4}
  timeout_s: 60
  window: {warmup_s: 0.0, cooldown_s: 0.0}
  metrics_poll_s: 0.1
  classes:
    siso: {share: 0.5, prompt_tokens: [8, 16], output_tokens: [2, 4], slo: {ttft_ms: 0.001}}
    lilo: {share: 0.5, prompt_tokens: [48, 64], output_tokens: [6, 8], slo: {e2e_ms: 600000}}
experiments:
  launched: {}
"""


def test_defaults_experiments_and_sweeps():
    exps = load_experiments(
        """
defaults: {num_requests: 7, arrival: {rate: 3}}
experiments:
  base: {}
  capped: {arrival: {max_concurrency: 2}}
  rates: {sweep: {param: arrival.rate, values: [1, 2]}}
"""
    )
    assert list(exps) == ["base", "capped", "rates[arrival.rate=1]", "rates[arrival.rate=2]"]
    assert exps["base"]["num_requests"] == 7 and exps["base"]["arrival"]["mode"] == "poisson"
    assert exps["base"]["arrival"]["rate"] == 3 and exps["capped"]["arrival"]["rate"] == 3  # dicts merge
    assert exps["capped"]["arrival"]["max_concurrency"] == 2
    assert [exps[f"rates[arrival.rate={r}]"]["arrival"]["rate"] for r in (1, 2)] == [1, 2]
    assert set(exps["base"]["classes"]) == set(DEFAULTS["classes"]) == {"siso", "silo", "liso", "lilo"}


def test_config_classes_replace_the_builtin_ones_and_shares_hold():
    (cfg,) = load_experiments(CONFIG).values()
    assert set(cfg["classes"]) == {"siso", "lilo"}
    specs = build_requests({**cfg, "num_requests": 400}, "n")
    assert {s.req_class for s in specs} == {"siso", "lilo"}
    assert 0.4 < sum(s.req_class == "siso" for s in specs) / 400 < 0.6
    for s in specs:
        lo, hi = cfg["classes"][s.req_class]["output_tokens"]
        assert lo <= s.max_tokens <= hi
    assert build_requests(cfg, "n") == build_requests(cfg, "n")  # seeded


def test_a_class_can_add_body_fields_per_experiment():
    """`extra_body` (a class's priority, say) goes into its requests' bodies (an experiment's classes
    replace the defaults' whole)."""
    siso = "{share: 0.5, prompt_tokens: [8, 16], output_tokens: [2, 4], extra_body: {priority: 0}}"
    lilo = "{share: 0.5, prompt_tokens: [48, 64], output_tokens: [6, 8], extra_body: {priority: 2}}"
    prio = f"{{classes: {{siso: {siso}, lilo: {lilo}}}}}"
    text = CONFIG.replace("  launched: {}", f"  plain: {{}}\n  prio: {prio}")
    exps = load_experiments(text)
    plain, prio = build_requests(exps["plain"], "n"), build_requests(exps["prio"], "n")
    assert all(s.extra_body is None for s in plain)
    assert {(s.req_class, s.extra_body["priority"]) for s in prio} == {("siso", 0), ("lilo", 2)}
    client = StreamingClient("http://127.0.0.1:1", "m")
    assert client.body(prio[0])["priority"] == prio[0].extra_body["priority"]
    assert "priority" not in client.body(plain[0])


@pytest.mark.parametrize(
    "text, match",
    [
        ("experiments: {a: {bogus: 1}}", "unknown keys"),
        ("other: {}", "two top-level keys"),
        ("experiments: {a: {arrival: {mode: uniform}}}", "unknown arrival mode"),
        ("experiments: {a: {classes: {x: {share: 1, prompt_tokens: [5, 2], output_tokens: [1, 2]}}}}",
         "lo <= hi"),
        ("experiments: {a: {classes: {x: {share: 1, prompt_tokens: [1, 2], output_tokens: [1, 2], "
         "slo: {ttft: 1}}}}}", "unknown SLO keys"),
        ("experiments: {a: {sweep: {param: nope.rate, values: [1]}}}", "not a block"),
    ],
)  # fmt: skip
def test_bad_configs_say_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        load_experiments(text)


@pytest.fixture(scope="module")
def traffic_run(model_args, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("traffic")
    config = tmp / "traffic.yaml"
    flags = json.dumps([*model_args, "--max-batch-size", "4"])
    config.write_text(CONFIG.replace("  num_requests: 12", f"  launch: {flags}\n  num_requests: 12"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run_config(config, tmp / "out", trace=True)
    return result, tmp / "out", out.getvalue()


@pytest.mark.slow  # a traffic run against a server it launches
def test_every_request_is_accounted_for(traffic_run):
    result, out_dir, text = traffic_run
    lines = (out_dir / "launched" / "requests.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted(r["req_id"] for r in records) == list(range(12))
    assert all(r["status"] == "ok" and r["num_completion_tokens"] == r["max_tokens"] for r in records)
    (summary,) = result["summaries"]
    assert summary["all"]["num_requests"] == 12
    w = summary["window"]
    assert w["num_kept"] + w["num_dropped_warmup"] + w["num_dropped_cooldown"] == 12
    assert sum(c["num_requests"] for c in summary["goodput"]["per_class"].values()) == w["num_kept"]
    assert summary["timeline"] and "infer:kv_cache_usage_perc" in summary["timeline"][0]
    assert "SLO compliance" in text and "launched" in text


@pytest.mark.slow  # a traffic run against a server it launches
def test_goodput_is_computed_from_the_slos(traffic_run):
    result, _, _ = traffic_run
    (summary,) = result["summaries"]
    per_class = summary["goodput"]["per_class"]
    assert per_class["siso"]["compliance"] == 0.0  # a 1 us TTFT objective: nothing meets it
    assert per_class["lilo"]["compliance"] == 1.0  # a 10 min end-to-end objective: everything does
    assert (
        0
        < summary["goodput"]["goodput_tokens_per_s"]
        < summary["stable"]["throughput"]["output_tokens_per_s"]
    )
    assert result["classes"] == ["lilo", "siso"] and result["compliance"] == [[1.0], [0.0]]


@pytest.mark.slow  # a traffic run against a server it launches
def test_outputs_and_the_launched_server_is_stopped(traffic_run):
    result, out_dir, _ = traffic_run
    for name in ("heatmap", "fate", "latency", "timeline", "goodput"):
        assert (out_dir / "launched" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert (out_dir / "tradeoff.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out_dir / "tradeoff.json").read_text())["experiments"] == ["launched"]
    with pytest.raises(httpx.TransportError):  # the harness stopped the server it started
        httpx.get(result["summaries"][0]["url"] + "/health", timeout=2)


@pytest.mark.slow  # a traffic run against a server it launches
def test_the_trace_of_the_launched_server_and_its_timeline_in_the_report(traffic_run):
    """`bench traffic --trace`: the server it launched wrote its engine trace as it stopped, one request
    track per request; the HTML report draws that experiment's per-request timeline."""
    _, out_dir, _ = traffic_run
    events = load_trace(out_dir / "launched" / TRACE_NAME)
    timelines = request_timelines(events)
    assert len(timelines) == 12 and all(t.segments for t in timelines)
    html = write_html(out_dir / "tradeoff.json", out=io.StringIO()).read_text()
    assert "experiment launched: per-request timeline" in html
