"""`infer bench client` end to end against our server, shrunk: counts and cache hits from `usage`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time

import pytest

from infer.bench.cli import add_bench_parsers


@pytest.mark.slow  # a benchmark's server
def test_cold_warm_cache_and_batches(bench_server, tmp_path):
    parser = argparse.ArgumentParser(prog="infer")
    add_bench_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "client", "--server", bench_server.url, "--prefix-tokens", "160", "--num-warm", "2"]
        + ["--sizes", "1,2,3", "--max-sequential", "2", "--max-tokens", "4", "--report-dir", str(tmp_path)]
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    (path,) = tmp_path.glob("client-*.json")
    report = json.loads(path.read_text())

    cache = report["cache"]
    assert cache["cold"]["status"] == "ok" and len(cache["warm"]) == 3
    assert cache["cold_cached_tokens"] == 0  # the cache buster: nothing cached can serve it
    assert len(cache["warm_cached_tokens"]) == 2 and all(n > 0 for n in cache["warm_cached_tokens"])
    assert cache["cold_ttft_ms"] > 0 and cache["avg_warm_ttft_ms"] > 0

    batches = [(b["mode"], b["batch_size"]) for b in report["batches"]]
    assert batches == [
        ("sequential", 1),
        ("sequential", 2),
        ("concurrent", 1),
        ("concurrent", 2),
        ("concurrent", 3),
    ]
    for b in report["batches"]:
        errors = [(r.get("status"), r.get("error")) for r in b["requests"] if r.get("status") != "ok"]
        assert b["success_rate"] == 1.0 and len(b["requests"]) == b["batch_size"], errors
        assert b["num_output_tokens"] == 4 * b["batch_size"]  # from usage
        assert all(r["num_cached_tokens"] == 0 for r in b["requests"])  # unique ids: no accidental hits
        assert b["tokens_per_s"] > 0 and b["avg_ttft_ms"] > 0
    assert "cold vs warm" in out.getvalue() and "sequential vs concurrent" in out.getvalue()


class _LoadingServer:
    """A real HTTP server whose /health answers 503 (loading) `loading` times, then 200."""

    def __init__(self, loading: int):
        import http.server
        import threading

        state = {"left": loading, "calls": 0}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                state["calls"] += 1
                code = 503 if state["left"] > 0 else 200
                state["left"] -= 1
                self.send_response(code)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.state = state
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def test_the_benchmark_waits_for_a_server_still_loading_its_model():
    from infer.bench.client import wait_until_ready

    server = _LoadingServer(loading=2)
    lines = []
    try:
        wait_until_ready(server.url, timeout=30, log=lines.append)
    finally:
        server.close()
    assert server.state["calls"] == 3  # two 503s, then the 200
    assert len(lines) == 1 and "still loading" in lines[0]


def test_waiting_for_a_server_that_never_loads_gives_up_at_the_timeout():
    from infer.bench.client import BenchError, check_server, wait_until_ready

    server = _LoadingServer(loading=10**6)
    try:
        start = time.monotonic()
        wait_until_ready(server.url, timeout=0.5, log=lambda line: None)
        assert time.monotonic() - start < 5
        with pytest.raises(BenchError, match="answered 503"):
            check_server(server.url, "m")
    finally:
        server.close()
    assert server.state["calls"] >= 1


def test_a_server_not_yet_listening_is_waited_for_then_reported(tmp_path):
    from infer.bench.client import BenchError, check_server, wait_until_ready

    lines = []
    wait_until_ready("http://127.0.0.1:9", timeout=0.5, log=lines.append)
    assert len(lines) == 1 and "not accepting connections" in lines[0]
    with pytest.raises(BenchError, match="cannot reach the server"):
        check_server("http://127.0.0.1:9", "m")
