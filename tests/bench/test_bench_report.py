"""The offline HTML report (`infer bench report`) from small records built with the benchmarks' own
functions (no server): every command's record through the one renderer, files from before records said
their kind, the per-request Gantt from a synthetic engine trace, and the page opened in a real headless
Chromium (skipped, saying why, where there is none)."""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import re
import shutil
import subprocess

import pytest

from infer.bench.arrivals import Arrivals
from infer.bench.cli import add_bench_parsers
from infer.bench.html_report import Page, find_report, timeline_section, write_html
from infer.bench.metrics import RequestRecord, summarize
from infer.bench.record import new_record, read_record, table, write_record
from infer.bench.report import fmt
from infer.bench.request_timeline import request_timelines

pytest.importorskip("matplotlib")


def record(i: int, ok: bool = True) -> RequestRecord:
    t = 0.1 * i
    chunks = [t + 0.05 + 0.01 * k for k in range(8)]
    return RequestRecord(
        req_id=i, intended_send=t, sent=t + 0.001, first_token=chunks[0] if ok else None,
        chunk_times=chunks if ok else [], end=chunks[-1] if ok else t + 0.2, status="ok" if ok else "error",
        num_prompt_tokens=40 + 10 * i if ok else None, num_completion_tokens=8 if ok else None,
        num_cached_tokens=0, target_prompt_tokens=40 + 10 * i, max_tokens=8,
    )  # fmt: skip


def serving_report() -> dict:
    records = [record(i, ok=i != 3) for i in range(6)]
    result = {
        "name": "baseline",
        "measures": "raw speed",
        "workload": {"num_requests": 6, "arrival": Arrivals("synchronous").describe()},
        "summary": summarize(records),
        "requests": [r.to_dict() for r in records],
    }
    from infer.bench.serving import comparison_spec, detail_spec, serving_plots

    return new_record(
        "serving",
        "infer bench serve --workload baseline --scale tiny --seed 42",
        {"workload": "baseline", "scale": "tiny", "seed": 42},
        started="2026-11-24T10:15:00+00:00",
        server={"url": "http://127.0.0.1:8000", "is_infer": True, "flags": {"dtype": "float32"}},
        tables=[table(*comparison_spec([result])), table(*detail_spec(result))],
        plots=serving_plots([result]),
        roofline=None,
        workloads=[result],
    )


def async_pair(name: str, req_id: str, b: float, e: float, args: dict | None = None) -> list[dict]:
    common = {"cat": "request", "id": req_id, "pid": 1, "tid": 1, "name": name}
    return [{**common, "ph": "b", "ts": b}, {**common, "ph": "e", "ts": e, "args": args or {}}]


def synthetic_trace() -> list[dict]:
    """Three requests as infer.engine.trace writes them: r0 queued, 2 prefill chunks, decode; r1 queued,
    prefill, decode, preempted, prefill, decode; r2 still decoding when the trace ends (open)."""
    ev = [{"name": "step", "ph": "X", "ts": 0, "dur": 1000, "pid": 1, "tid": 1}]
    ev += async_pair("r0", "r0", 0, 900, {"finish_reason": "length", "prompt_tokens": 40, "output_tokens": 8})
    ev += async_pair("queued", "r0", 0, 100) + async_pair("prefill", "r0", 100, 200)
    ev += async_pair("prefill", "r0", 200, 300) + async_pair("decode", "r0", 300, 900)
    ev += async_pair("r1", "r1", 50, 1500, {"finish_reason": "stop"})
    ev += async_pair("queued", "r1", 50, 300) + async_pair("prefill", "r1", 300, 400)
    ev += async_pair("decode", "r1", 400, 600) + async_pair("preempted", "r1", 600, 800)
    ev += async_pair("prefill", "r1", 800, 900) + async_pair("decode", "r1", 900, 1500)
    common = {"cat": "request", "id": "r2", "pid": 1, "tid": 1, "ph": "b"}
    ev += [{**common, "name": "r2", "ts": 100}] + async_pair("queued", "r2", 100, 400)
    ev += async_pair("prefill", "r2", 400, 500) + [{**common, "name": "decode", "ts": 500}]
    counter = {"name": "requests", "ph": "C", "pid": 1, "tid": 1}
    ev += [{**counter, "ts": t, "args": {"running": t // 500, "waiting": 1}} for t in (0, 500, 1000, 2000)]
    return ev


EXTERNAL = re.compile(r"""(src|href)\s*=\s*["']?\s*(https?:)?//|@import|url\(\s*["']?\s*(https?:)?//""", re.I)


def images(text: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'<img [^>]*src="data:image/png;base64,([^"]+)"', text)]


@pytest.fixture(scope="module")
def serving_html(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    path = tmp / "serving-embedded-baseline-20261124-101500.json"
    report = serving_report()
    path.write_text(json.dumps(report))
    (tmp / "engine.json").write_text(json.dumps({"traceEvents": synthetic_trace()}))
    parser = argparse.ArgumentParser(prog="infer")
    add_bench_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "report", str(tmp), "--trace", str(tmp / "engine.json")])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    html_path = path.with_suffix(".html")
    assert f"html report: {html_path}" in out.getvalue()
    return report, html_path


def test_the_page_holds_the_command_tables_machine_and_plots(serving_html):
    report, html_path = serving_html
    text = html_path.read_text()
    assert "infer bench serve --workload baseline --scale tiny --seed 42" in text
    s = report["workloads"][0]["summary"]
    for value in (s["ttft_ms"]["p50"], s["ttft_ms"]["p99"], s["throughput"]["output_tokens_per_s"]):
        assert f"<td>{fmt(value)}</td>" in text  # the number as the terminal table prints it
    assert "<td>5 / 6</td>" in text and "cross-workload comparison" in text
    assert report["machine"]["cpu"] in text and report["machine"]["python"] in text
    pngs = images(text)  # latency per workload, heatmap, fate; the Gantt and the counters
    assert len(pngs) == 5 and all(p[:4] == b"\x89PNG" for p in pngs)


def test_the_page_loads_nothing_from_the_network(serving_html):
    text = serving_html[1].read_text()
    assert not EXTERNAL.search(text), EXTERNAL.search(text)
    assert "<script" not in text and "<link" not in text
    assert EXTERNAL.search('<img src="https://cdn.example/x.png">')  # the check can fail


def test_gantt_has_one_bar_per_slice_from_the_trace():
    timelines = request_timelines(synthetic_trace())
    assert [t.req_id for t in timelines] == ["r0", "r1", "r2"]
    r0, r1, r2 = timelines
    assert [s.phase for s in r0.segments] == ["queued", "prefill", "prefill", "decode"]
    assert [s.phase for s in r1.segments] == ["queued", "prefill", "decode", "preempted", "prefill", "decode"]
    assert r0.end_args["finish_reason"] == "length" and r0.total_us("prefill") == 200
    assert r2.segments[-1].open and r2.segments[-1].end_us == 2000 and r2.end_args == {}
    page = Page("t")
    assert timeline_section(page, synthetic_trace()) == 4 + 6 + 3  # a bar per slice
    body = "\n".join(page.parts)
    assert page.num_images == 2 and body.count("<tr><td>r") == 3 and "(open)" in body


BATCHES = [
    {"mode": m, "batch_size": n, "avg_ttft_ms": 10.0 * n, "tokens_per_s": 100.0 + n, "success_rate": 1.0}
    for m in ("sequential", "concurrent")
    for n in (1, 2)
]
CACHE = {
    "prompt_tokens": 160,
    "cold_ttft_ms": 50.0,
    "avg_warm_ttft_ms": 12.5,
    "speedup": 0.75,
    "cold_cached_tokens": 0,
    "warm_cached_tokens": [144, 144],
}
MICRO_CASE = {
    "name": "short",
    "knobs": {"prompt_len": 8},
    "modes": {"no_cache": {"tok_s": 10.0, "gen_tok": 16}, "kv_cache": {"tok_s": 25.0, "gen_tok": 16}},
    "ratios": {"speedup": 2.5},
}


def client_record() -> dict:
    from infer.bench.client_latency import result_plots, result_tables

    result = {"cache": CACHE, "batches": BATCHES}
    return new_record(
        "client",
        "infer bench client --sizes 1,2",
        {},
        tables=result_tables(result),
        plots=result_plots(result),
        **result,
    )


def micro_record() -> dict:
    from infer.bench.micro.report import BenchResult, CaseResult, Verdict, record

    case = CaseResult(**MICRO_CASE)
    bench = BenchResult("kv-cache", [case], [Verdict("short", True, "2.50x >= 2x")], {"sweep": [MICRO_CASE]})
    return record({"command": "python -m infer.bench.micro kv-cache", "scale": "small"}, [bench])


def traffic_record() -> dict:
    from infer.bench.traffic import result_tables

    latency = {"p50": 20.0, "p95": 30.0, "p99": 40.0}
    summary = {
        "experiment": "fcfs",
        "stable": {
            "num_requests": 8,
            "throughput": {"output_tokens_per_s": 90.0},
            "ttft_ms": latency,
            "itl_ms": latency,
            "dispatch_delay_ms": latency,
        },
        "all": {"num_ok": 8, "num_requests": 8},
        "goodput": {"goodput_tokens_per_s": 80.0, "per_class": {"chat": {"compliance": 0.75}}},
    }
    tables = result_tables([summary], ["chat"], ["fcfs"], [[0.75]])
    return new_record(
        "traffic",
        "infer bench traffic --config c.yaml",
        {"config": "c.yaml"},
        tables=tables,
        plots=[{"title": "tradeoff matrix", "png": "tradeoff.png"}],
        classes=["chat"],
        experiments=["fcfs"],
        compliance=[[0.75]],
    )


def race_record() -> dict:
    from infer.bench import race

    runs = [
        {
            "side": "infer",
            "round": 0,
            "error": None,
            "results": [
                {
                    "concurrency": 1,
                    "requests": [],
                    "summary": {
                        "num_errors": 0,
                        "throughput": {"output_tokens_per_s": 50.0},
                        "itl_ms": {"p50": 10.0, "p99": 20.0},
                        "ttft_ms": {"p50": 50.0},
                    },
                    "token_counts": {
                        "prompt_tokens_seen": [128],
                        "num_prompt_mismatch": 0,
                        "num_output_mismatch": 0,
                    },
                }
            ],
        }
    ]
    figures = race.race_figures(runs, [1])
    tables = [table(race.HEADERS, race.race_rows(figures, "embedded"), "== race: 1 round")]
    servers = {"infer": race.ServerSpec("infer", ["infer", "serve"], "http://x").describe(), "peer": None}
    return race.build_report("2026-01-01T00:00:00", "infer bench race", {}, servers, runs, figures, tables)


def stress_record() -> dict:
    from infer.bench.stress import results_table

    aborts = {
        "counts": {"aborted": 3, "ok": 1},
        "problems": [],
        "num_requests": 4,
        "duration_s": 2.0,
        "idle": {"settle_s": 0.5},
        "engine_aborts": 3,
    }
    return new_record(
        "stress",
        "infer bench stress --phases aborts",
        {},
        tables=[results_table({"aborts": aborts})],
        phases={"aborts": aborts},
        passed=True,
    )


def roofline_record() -> dict:
    from infer.bench import roofline

    shape = {
        "model": "toy",
        "num_params": 1000,
        "architecture": "LlamaForCausalLM",
        "dtype": "bfloat16",
        "weight_bytes": 2000,
        "kv_bytes_per_token": 64,
        "max_position_embeddings": 128,
        "flops_per_token": 2000,
    }
    roof = roofline.roofline(shape, bandwidth=4_000.0, flops=1e6, matmul_dtype="float32", memory_bytes=12_000)
    tables = [table(["Roofline", "Value"], roofline.rows(shape, roof), "== roofline")]
    return new_record("roofline", "infer bench roofline", {}, tables=tables, shape=shape, roofline=roof)


RECORDS = {
    "serving": serving_report,
    "client": client_record,
    "micro": micro_record,
    "traffic": traffic_record,
    "race": race_record,
    "stress": stress_record,
    "roofline": roofline_record,
}


@pytest.mark.parametrize("kind", list(RECORDS))
def test_every_commands_record_renders_through_the_one_renderer(kind, tmp_path):
    record = RECORDS[kind]()
    assert record["kind"] == kind and record["tables"]
    path = write_record(tmp_path / f"{kind}.json", record)["path"]
    text = write_html(find_report(tmp_path), out=io.StringIO()).read_text()
    assert f"infer bench {kind}: {kind}" in text and record["command"] in text
    for t in read_record(path)["tables"]:  # every table, every cell as the terminal prints it
        assert t["title"].removeprefix("== ") in text
        for row in t["rows"]:
            for c in row:
                assert html_escape(c if isinstance(c, str) else fmt(c)) in text


def html_escape(text: str) -> str:
    import html

    return html.escape(text)


def test_client_and_micro_pages_hold_their_figures(tmp_path):
    write_record(tmp_path / "client-m-1.json", client_record())
    text = write_html(find_report(tmp_path), out=io.StringIO()).read_text()
    assert "<td>12.5</td>" in text and "<td>102.0</td>" in text and len(images(text)) == 1
    write_record(tmp_path / "micro.json", micro_record())
    text = write_html(tmp_path / "micro.json", out=io.StringIO()).read_text()
    assert "<td>25.00</td>" in text and "<td>2.50x</td>" in text and "PASS short: 2.50x" in text


def test_race_and_stress_pages_hold_their_tables(tmp_path):
    write_record(tmp_path / "race.json", race_record())
    text = write_html(tmp_path / "race.json", out=io.StringIO()).read_text()
    assert "<th>infer tok/s</th>" in text and "<td>embedded</td>" in text and "<td>50.0</td>" in text
    write_record(tmp_path / "stress.json", stress_record())
    text = write_html(tmp_path / "stress.json", out=io.StringIO()).read_text()
    assert "stress: storms and soak" in text and "<td>aborts</td>" in text and "<td>pass</td>" in text


def test_files_written_before_records_are_read_with_their_kind(tmp_path):
    micro = {
        "meta": {"command": "python -m infer.bench.micro kv-cache", "scale": "small", "machine": {}},
        "benchmarks": {"kv-cache": {"cases": [MICRO_CASE], "verdicts": [], "sweep": []}},
    }
    (tmp_path / "micro.json").write_text(json.dumps(micro))
    record = read_record(tmp_path / "micro.json")
    assert record["kind"] == "micro" and record["command"] == micro["meta"]["command"]
    text = write_html(tmp_path / "micro.json", out=io.StringIO()).read_text()
    assert "infer bench micro" in text and "written before reports kept their tables" in text
    client = {"kind": "client", "command": "infer bench client", "config": {}, "cache": CACHE, "batches": []}
    (tmp_path / "client.json").write_text(json.dumps(client))
    assert read_record(tmp_path / "client.json")["kind"] == "client"
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not a report"):
        read_record(tmp_path / "trace.json")


def chromium() -> str | None:
    return next(
        (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None
    )


def headless(binary: str, url: str, tmp_path) -> subprocess.CompletedProcess:
    flags = ["--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr", "--v=0"]
    flags += [f"--user-data-dir={tmp_path / 'profile'}", "--no-first-run", "--dump-dom", url]
    return subprocess.run([binary, *flags], capture_output=True, text=True, timeout=60)


@pytest.mark.slow  # a headless browser
def test_a_headless_chromium_renders_the_tables_without_console_errors(serving_html, tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip(
            "no chromium on PATH (Debian: apt-get install chromium): the page is not opened in a browser"
        )
    report, html_path = serving_html
    bad = tmp_path / "bad.html"  # first, that a console error would be seen
    bad.write_text("<!DOCTYPE html><html><body><script>console.error('broken-page')</script></body></html>")
    assert "broken-page" in headless(binary, bad.as_uri(), tmp_path).stderr
    run = headless(binary, html_path.as_uri(), tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    dom = run.stdout
    assert dom.count("<table") >= 4 and "cross-workload comparison" in dom
    assert f"<td>{fmt(report['workloads'][0]['summary']['ttft_ms']['p50'])}</td>" in dom
    assert "<td>r1</td>" in dom  # the trace's request table
    console = [ln for ln in run.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
