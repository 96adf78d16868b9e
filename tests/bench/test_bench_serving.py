"""`bench_serving` end to end against our real server on loopback, at the `tiny` scale.

Checks what a report must hold whatever the machine: every request, the counts the workload implies, token
counts from `usage`, ordered timestamps, p50 <= p95 <= p99. Timings are never asserted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json

import pytest

from infer.bench import serving
from infer.bench.cli import add_bench_parsers
from infer.bench.client import RequestSpec, StreamingClient
from infer.bench.workloads import get_workloads
from tests.server.conftest import free_port


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = serving.main(argv)
    return rc, out.getvalue(), err.getvalue()


def check_distribution(d: dict) -> None:
    assert d["count"] > 0
    assert 0 <= d["min"] <= d["p50"] <= d["p95"] <= d["p99"] <= d["max"]


@pytest.fixture(scope="module")
def report(bench_server, tmp_path_factory):
    report_dir = tmp_path_factory.mktemp("reports")
    argv = ["--server", bench_server.url, "--model", "embedded", "--workload", "all", "--seed", "42"]
    argv += ["--scale", "tiny", "--report-dir", str(report_dir), "--no-progress"]
    rc, out, err = run_main(argv)
    assert rc == 0, err
    (path,) = report_dir.glob("serving-*.json")
    return json.loads(path.read_text()), out


@pytest.mark.slow  # a benchmark's server
def test_report_records_our_servers_flags_and_its_roofline(report):
    report, out = report
    flags = report["server"]["flags"]  # from GET /server_info: no --server-flags needed for our server
    assert report["server"]["is_infer"] and flags["engine"]["kv_cache_backend"] == "paged"
    assert report["roofline"]["model"] and report["roofline"]["decode_ceiling_tokens_per_s"] > 0
    assert all(w["summary"]["fraction_of_decode_ceiling"] > 0 for w in report["workloads"])
    assert "single-stream decode ceiling" in out


@pytest.mark.slow  # a benchmark's server
def test_report_holds_every_request_with_sensible_numbers(report):
    report, out = report
    expected = {w.name: w for w in get_workloads("all", "tiny")}
    assert [w["name"] for w in report["workloads"]] == list(expected)
    for result in report["workloads"]:
        w, s, reqs = expected[result["name"]], result["summary"], result["requests"]
        assert len(reqs) == s["num_requests"] == w.num_requests
        assert sorted(r["req_id"] for r in reqs) == list(range(w.num_requests))
        assert s["num_ok"] == w.num_requests and s["num_errors"] == 0
        assert result["warmup"] == {"num_requests": 2, "num_ok": 2}
        for r in reqs:
            assert r["status"] == "ok" and r["http_status"] == 200
            assert (
                r["num_completion_tokens"] == r["max_tokens"]
            )  # ignore_eos: every token asked for, per usage
            assert r["num_prompt_tokens"] > 0
            assert 0 <= r["intended_send"] <= r["sent"] <= r["first_token"] <= r["end"]
            assert r["chunk_times"] == sorted(r["chunk_times"]) and r["chunk_times"][0] == r["first_token"]
        for key in ("ttft_ms", "latency_ms", "dispatch_delay_ms"):
            check_distribution(s[key])
        check_distribution(s["itl_ms"])
        assert s["throughput"]["output_tokens_per_s"] > 0
        assert s["throughput"]["num_output_tokens"] == sum(r["max_tokens"] for r in reqs)
        assert result["name"] in out
    assert "cross-workload comparison" in out


@pytest.mark.slow  # a benchmark's server
def test_cache_buster_and_shared_prefix_reach_the_server(report):
    by_name = {w["name"]: w["requests"] for w in report[0]["workloads"]}
    for name in ("baseline", "continuous_batching", "paged_attention", "chunked_prefill"):
        assert all(r["num_cached_tokens"] == 0 for r in by_name[name]), name
    assert any(r["num_cached_tokens"] > 0 for r in by_name["prefix_caching"])


@pytest.mark.slow  # a benchmark's server
def test_report_records_how_to_reproduce(report):
    report, _ = report
    assert report["command"].startswith("bench_serving.py") or "--workload all" in report["command"]
    assert report["config"]["seed"] == 42 and report["config"]["scale"] == "tiny"
    assert report["server"]["is_infer"] and report["server"]["max_model_len"] > 0
    assert report["server"]["flags"]["engine"]["seed"] == 0
    assert report["machine"]["num_cpus"] >= 1 and report["machine"]["versions"]["infer"]


@pytest.mark.slow  # a benchmark's server
def test_infer_bench_serve_subcommand_no_save(bench_server, tmp_path):
    parser = argparse.ArgumentParser(prog="infer")
    add_bench_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "serve", "--server", bench_server.url, "--workload", "baseline", "--scale", "tiny"]
        + [
            "--no-save",
            "--no-progress",
            "--warmup",
            "0",
            "--report-dir",
            str(tmp_path),
            "--roofline",
            "float32",
        ]
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    assert "baseline" in out.getvalue() and "model=embedded" in out.getvalue()
    assert "single-stream decode ceiling" in out.getvalue()
    assert list(tmp_path.iterdir()) == []


def test_unreachable_server_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    rc, _, err = run_main(["--server", url, "--model", "m", "--no-save", "--wait", "1"])
    assert rc == 1 and "cannot reach the server" in err


@pytest.mark.slow  # a benchmark's server
def test_wrong_model_lists_what_is_served(bench_server):
    rc, _, err = run_main(["--server", bench_server.url, "--model", "no-such-model", "--no-save"])
    assert rc == 1 and "does not serve model 'no-such-model'" in err and "'embedded'" in err


@pytest.mark.slow  # a benchmark's server
def test_client_timeout_is_recorded_as_timeout(bench_server):
    async def go():
        async with StreamingClient(bench_server.url, "embedded", timeout=0.05) as client:
            slow = await client.send(0, RequestSpec("In the beginning", 400), client.now())
        async with StreamingClient(bench_server.url, "embedded") as client:
            bad = await client.send(1, RequestSpec("In the beginning", 10**6), client.now())
        return slow, bad

    slow, bad = asyncio.run(go())
    assert slow.status == "timeout" and slow.end is not None and slow.num_completion_tokens is None
    assert bad.status == "error" and bad.http_status == 400 and bad.error  # the server's message, kept


def test_a_kept_alive_connection_the_server_closed_is_retried_on_a_new_one():
    """llama-server closes a kept-alive connection after a few requests: the next request on it fails
    before anything reaches the server, and goes again on a new connection rather than failing."""
    body = b'data: {"choices": [{"text": "x"}]}\n\ndata: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\ndata: [DONE]\n\n'  # noqa: E501
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        served = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
            )
            await reader.readexactly(length)
            if served == 1:  # the second request on a connection: closed unanswered
                writer.close()
                return
            writer.write(answer)
            await writer.drain()
            served += 1

    async def go():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server, StreamingClient(url, "m") as client:
            return [await client.send(i, RequestSpec("hi", 1), client.now()) for i in range(3)]

    records = asyncio.run(go())
    assert [r.status for r in records] == ["ok"] * 3, [r.error for r in records]
    assert [r.num_completion_tokens for r in records] == [1, 1, 1] and len(connections) == 3
