"""Seed 003's client tests end to end against our server, shrunk: counts and cache hits from `usage`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

from infer.bench.cli import add_bench_parsers


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
        assert b["success_rate"] == 1.0 and len(b["requests"]) == b["batch_size"]
        assert b["num_output_tokens"] == 4 * b["batch_size"]  # from usage
        assert all(r["num_cached_tokens"] == 0 for r in b["requests"])  # unique ids: no accidental hits
        assert b["tokens_per_s"] > 0 and b["avg_ttft_ms"] > 0
    assert "cold vs warm" in out.getvalue() and "sequential vs concurrent" in out.getvalue()
