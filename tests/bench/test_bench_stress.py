"""`infer bench stress`: the judgements as pure functions on synthetic data, then each phase end to end in
a tiny form (40 aborts; a 5 s overload and a 10 s soak on a server the command launches itself).

No test asserts a timing or a leak: a 10 s soak is too short to judge one (the command says so)."""

from __future__ import annotations

import argparse
import io
import json
import shlex
from collections import Counter

import httpx
import pytest

from infer.bench import stress
from infer.bench.cli import add_bench_parsers
from infer.bench.metrics import RequestRecord
from infer.bench.stress_checks import (
    ABORT_KINDS,
    LeakLimits,
    abort_outcome,
    abort_verdict,
    classify,
    fit_slope,
    overload_verdict,
    per_hour,
    plain_outcome,
    plan_aborts,
    soak_verdict,
)

IDLE = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "health": 200}

# ---- pure logic ----------------------------------------------------------------------------------------


def test_slopes_fit_a_line_and_skip_the_warm_up():
    assert fit_slope([(t, 2.0 * t + 3.0) for t in range(10)]) == pytest.approx(2.0)
    assert fit_slope([(t, 5.0 + (-1) ** t) for t in range(100)]) == pytest.approx(0.0, abs=1e-3)  # noise
    assert fit_slope([(1.0, 1.0)]) is None and fit_slope([(1.0, 1.0), (1.0, 2.0)]) is None
    # RSS jumps by 100 MiB while warming up, then grows 1 MiB a minute: the second half says 60 MiB/hour
    samples = [
        {"t": 60.0 * i, "rss_mib": 100.0 + (100.0 if i >= 2 else 0.0) + i, "fds": 30} for i in range(20)
    ]
    assert per_hour(samples, "rss_mib") == pytest.approx(60.0)
    assert per_hour(samples, "rss_mib", second_half=False) > 100.0
    assert per_hour(samples, "fds") == 0.0
    assert per_hour([{"t": 0.0, "rss_mib": None}, {"t": 1.0, "rss_mib": None}], "rss_mib") is None


def record(status: str = "ok", http_status: int | None = 200, tokens: int | None = 8, error=None):
    return RequestRecord(0, 0.0, status=status, http_status=http_status, num_completion_tokens=tokens,
                         error=error)  # fmt: skip


def test_each_streamed_answer_is_classified():
    assert classify(record(), 8) == "ok"
    assert classify(record(tokens=7), 8) == "wrong"  # complete, but usage counts other than asked
    assert classify(record("error", 429, None, "server overloaded: ..."), 8) == "refused"
    assert classify(record("error", 503, None, "draining"), 8) == "refused"
    assert classify(record("error", 429, None, ""), 8) == "lost"  # a refusal without a reason
    assert classify(record("error", 500, None, "internal error"), 8) == "server_error"
    assert classify(record("error", 400, None, "max_tokens"), 8) == "rejected"
    assert classify(record("timeout", None, None, "no complete answer"), 8) == "lost"
    assert classify(record("error", 200, None, "the stream ended without [DONE]"), 8) == "lost"


def test_abort_and_plain_outcomes():
    seen = {"stage": "decode", "status": 200, "error": None}
    assert abort_outcome(seen) == "left_decode"
    assert abort_outcome(seen | {"stage": "sent", "status": None}) == "left_sent"
    assert abort_outcome(seen | {"status": 429, "error": "overloaded"}) == "refused"
    assert abort_outcome(seen | {"status": 500, "error": "x"}) == "server_error"
    assert abort_outcome(seen | {"status": 400, "error": "x"}) == "rejected"
    assert abort_outcome(seen | {"error": "ReadError: connection reset"}) == "lost"
    usage = {"usage": {"completion_tokens": 4}}
    assert plain_outcome(httpx.Response(200, json=usage), 4) == "ok"
    assert plain_outcome(httpx.Response(200, json=usage), 5) == "wrong"
    error = {"error": {"message": "too long", "type": "invalid_request_error", "param": None, "code": None}}
    assert plain_outcome(httpx.Response(400, json=error), None) == "ok"  # the refusal that was asked for
    assert plain_outcome(httpx.Response(200, json=usage), None) == "unexpected"
    assert plain_outcome(httpx.Response(429, json=error), 4) == "refused"
    assert plain_outcome(httpx.Response(502, text="bad gateway"), 4) == "server_error"


def test_verdicts():
    assert abort_verdict(Counter(left_decode=30, refused=2), IDLE, True) == []
    problems = abort_verdict(Counter(lost=1), IDLE | {"kv_usage": 0.25, "waiting": 2.0}, False)
    assert len(problems) == 4 and any("blocks still held" in p for p in problems)
    assert overload_verdict(Counter(ok=10, refused=90)) == []
    assert overload_verdict(Counter(ok=10)) == [
        "nothing was refused: the load never passed the admission bound"
    ]
    assert overload_verdict(Counter(ok=10, refused=5, lost=1, server_error=2)) == ["1 lost", "2 server error"]
    limits = LeakLimits(rss_mib_per_hour=64.0, fd_growth=4, min_judge_seconds=300.0)
    leaky = {"rss_mib_per_hour": 500.0, "fd_growth": 20}
    assert soak_verdict(Counter(ok=50), IDLE, leaky, 10.0, limits) == []  # too short to judge a leak
    assert len(soak_verdict(Counter(ok=50), IDLE, leaky, 1800.0, limits)) == 2
    assert soak_verdict(Counter(ok=50), IDLE, {"rss_mib_per_hour": 3.0, "fd_growth": 0}, 1800.0, limits) == []
    assert soak_verdict(Counter(ok=50, lost=1, unexpected=2), IDLE, {}, 10.0, limits) == ["3 errors"]


def test_abort_plans_are_seeded_and_cover_every_kind():
    plans = plan_aborts(40, seed=3)
    assert plans == plan_aborts(40, seed=3) and plans != plan_aborts(40, seed=4)
    assert Counter(p.kind for p in plans) == dict.fromkeys(ABORT_KINDS, 10)
    assert all(0 <= p.delay <= 0.005 for p in plans if p.kind == "before_first_byte")
    assert all(1 <= p.num_chunks <= 8 for p in plans if p.kind == "mid_decode")
    assert stress.parse_phases("soak,aborts") == ["aborts", "soak"]
    with pytest.raises(ValueError, match="--phases"):
        stress.parse_phases("aborts,storm")


# ---- end to end ----------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="infer")
    add_bench_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "stress", *argv])
    args.argv = ["bench", "stress", *argv]
    return args


@pytest.mark.slow  # a benchmark's server
def test_aborts_give_everything_back(bench_server, tmp_path):
    out = io.StringIO()
    argv = ["--server", bench_server.url, "--phases", "aborts", "--aborts", "40", "--abort-concurrency", "8"]
    report = stress.run(parse([*argv, "--out", str(tmp_path / "aborts.json")]), out=out)
    aborts = report["phases"]["aborts"]
    assert aborts["problems"] == [], (aborts["problems"], aborts["errors"])
    assert report["passed"] and aborts["num_requests"] == 40 and aborts["served_after"]
    idle = aborts["idle"]
    assert idle["running"] == idle["waiting"] == idle["kv_usage"] == 0 and idle["health"] == 200
    assert aborts["engine_aborts"] >= 1  # some clients left while the engine held their request
    assert sum(aborts["by_kind"]["mid_decode"].values()) == 10
    assert "aborts" in out.getvalue() and "pass" in out.getvalue()
    assert json.loads((tmp_path / "aborts.json").read_text())["kind"] == "stress"


@pytest.mark.slow  # a benchmark's server
def test_overload_and_soak_on_a_launched_server(model_args, tmp_path):
    flags = shlex.join([*model_args, "--max-num-seqs", "2", "--max-queued-requests", "2"])
    argv = ["--infer-flags", flags, "--phases", "overload,soak", "--overload-seconds", "5",
            "--soak-seconds", "10", "--soak-concurrency", "3", "--sample-interval", "1",
            "--out", str(tmp_path / "stress.json")]  # fmt: skip
    out = io.StringIO()
    report = stress.run(parse(argv), out=out)
    overload, soak = report["phases"]["overload"], report["phases"]["soak"]
    assert overload["problems"] == [], (overload["problems"], overload["errors"])
    assert overload["num_workers"] == 40 and overload["admission_bound"] == 4
    assert overload["counts"]["ok"] >= 1 and overload["counts"]["refused"] >= 1
    assert "--max-queued-requests 2" in overload["refusals"][0]  # a 429 says why
    assert overload["ttft_ms"]["count"] == overload["counts"]["ok"]
    assert soak["problems"] == [], soak["problems"]
    assert set(soak["counts"]) <= {"ok", "refused"} and soak["counts"]["ok"] >= 5
    assert len(soak["samples"]) >= 5 and all(s["rss_mib"] > 0 and s["fds"] > 0 for s in soak["samples"])
    assert soak["leak"]["fd_growth"] is not None and "leaks not judged" in soak["note"]
    assert report["server"]["pid"] and report["server"]["launched"]
    assert "overload" in out.getvalue() and "soak" in out.getvalue()


@pytest.mark.slow  # a benchmark's server
def test_fairness_runs_a_bystander_beside_each_kind(bench_server, tmp_path):
    """The phase's mechanics (its ratios are measured on an idle machine, not judged here): every kind
    named runs beside a bystander, the heavy client's answers are counted, none is a 5xx."""
    argv = ["--server", bench_server.url, "--phases", "fairness", "--fairness-kinds",
            "long_prompt,n,stop_lists", "--fairness-tokens", "8", "--fairness-concurrency", "1",
            "--fairness-lead", "0.2", "--fairness-bound", "1000", "--fairness-repeat", "2"]  # fmt: skip
    report = stress.run(parse([*argv, "--out", str(tmp_path / "fair.json")]), out=io.StringIO())
    fairness = report["phases"]["fairness"]
    assert fairness["problems"] == [] and set(fairness["kinds"]) == {"long_prompt", "n", "stop_lists"}
    for kind, row in fairness["kinds"].items():
        assert sum(row["heavy_statuses"].values()) >= 1, kind
        assert all(s.isdigit() and not s.startswith("5") for s in row["heavy_statuses"]), row
        assert row["beside"]["total_ms"] > 0 and row["ratios"]["ttft_ms"] > 0
        assert len(row["runs"]) == 2  # the median of two runs, each beside a heavy client of its own
    assert fairness["alone"]["ttft_ms"] > 0 and fairness["counts"]["bystander runs"] == 2 + 3 * 2


def test_fairness_requests_are_what_the_server_allows():
    from infer.bench.stress_fairness import KINDS, heavy_request
    from infer.server.protocol import ChatCompletionRequest, CompletionRequest

    for kind in KINDS:
        route, body = heavy_request(kind, "m", 3, max_model_len=2048, max_n=8)
        schema = ChatCompletionRequest if route.endswith("chat/completions") else CompletionRequest
        schema.model_validate(body)  # within the API's bounds: a heavy request, not a refused one


def test_the_compilation_flood_is_100_distinct_schemas_none_compiled_by_the_grammars_kind():
    from infer.bench.stress_fairness import FLOODS, heavy_request

    schemas = {
        json.dumps(heavy_request(kind, "m", i, max_model_len=2048)[1]["structured_outputs"])
        for kind in ("grammars", "compilations")
        for i in range(100)
    }
    assert len(schemas) == 200 and FLOODS["compilations"][0] == 100
