"""`infer bench race`: the logic as pure functions (figures, ratio, order, notes, report shape), the
launcher's clean stop, the exact-length prompts, and one race end to end against our own server.

No test needs vLLM, and none asserts a timing."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import textwrap
import time

import httpx
import pytest

from infer.bench import race
from infer.bench.cli import add_bench_parsers
from infer.bench.launch import LaunchedServer, free_port
from infer.bench.metrics import RequestRecord
from infer.bench.prompts import exact_prompts
from infer.engine.tokenizer import Tokenizer
from infer.models.loader import EMBEDDED_MODEL


def summary(tok_s: float, itl_p50: float = 10.0, itl_p99: float = 20.0, ttft_p50: float = 50.0) -> dict:
    return {
        "num_errors": 0,
        "throughput": {"output_tokens_per_s": tok_s},
        "itl_ms": {"p50": itl_p50, "p99": itl_p99},
        "ttft_ms": {"p50": ttft_p50},
    }


def fake_run(side: str, rnd: int, by_conc: dict[int, dict], error: str | None = None) -> dict:
    results = [
        {"concurrency": c, "summary": s, "requests": [],
         "token_counts": {"prompt_tokens_seen": [128], "num_prompt_mismatch": 0, "num_output_mismatch": 0}}
        for c, s in by_conc.items()
    ]  # fmt: skip
    return {"side": side, "round": rnd, "error": error, "results": results}


# ---- pure logic ----------------------------------------------------------------------------------------


def test_rounds_alternate_which_side_goes_first():
    assert race.run_order(3, ["infer", "peer"]) == [
        (0, "infer"), (0, "peer"), (1, "peer"), (1, "infer"), (2, "infer"), (2, "peer"),
    ]  # fmt: skip
    assert race.run_order(2, ["infer"]) == [(0, "infer"), (1, "infer")]


def test_figures_keep_every_round_and_the_ratio_is_of_medians():
    runs = [
        fake_run("infer", 0, {1: summary(50.0, 12.0, 30.0, 40.0), 8: summary(300.0)}),
        fake_run("peer", 0, {1: summary(100.0, 9.0, 11.0, 20.0), 8: summary(600.0)}),
        fake_run("peer", 1, {1: summary(110.0, 7.0, 13.0, 30.0), 8: summary(500.0)}),
        fake_run("infer", 1, {1: summary(70.0, 14.0, 50.0, 60.0), 8: summary(400.0)}),
    ]
    one, eight = race.race_figures(runs, [1, 8])
    assert one["infer"]["tok_s"] == [50.0, 70.0] and one["peer"]["tok_s"] == [100.0, 110.0]
    assert one["ratio"] == pytest.approx(60.0 / 105.0)
    assert eight["ratio"] == pytest.approx(350.0 / 550.0)
    assert one["infer"]["itl_p50_ms"] == 13.0 and one["infer"]["itl_p99_ms"] == 40.0
    assert one["peer"]["ttft_p50_ms"] == 25.0
    rows = race.race_rows([one, eight], "llama-50m")
    assert rows[0][:5] == ["llama-50m", 1, "50.0 / 70.0", "100.0 / 110.0", "0.57"]
    assert rows[1][4] == "0.64"


def test_a_missing_or_failed_peer_leaves_its_columns_empty():
    runs = [
        fake_run("infer", 0, {1: summary(50.0)}),
        fake_run("peer", 0, {}, error="the server exited with 1; see peer.log"),
    ]
    (fig,) = race.race_figures(runs, [1])
    assert fig["peer"]["tok_s"] == [] and fig["peer"]["itl_p50_ms"] is None and fig["ratio"] is None
    (row,) = race.race_rows([fig], "m")
    assert row[3] == "-" and row[4] == "-" and row[8:] == [None, None, None]
    assert race.notes(runs) == ["round 1 peer: the server exited with 1; see peer.log"]


def test_token_counts_come_from_usage_and_mismatches_are_noted():
    recs = [
        RequestRecord(0, 0.0, num_prompt_tokens=128, num_completion_tokens=64),
        RequestRecord(1, 0.0, num_prompt_tokens=129, num_completion_tokens=64),
        RequestRecord(2, 0.0, num_prompt_tokens=128, num_completion_tokens=63),
        RequestRecord(3, 0.0, status="error", error="boom"),
    ]
    counts = race.token_counts(recs, 128, 64)
    assert counts == {"prompt_tokens_seen": [128, 129], "num_prompt_mismatch": 1, "num_output_mismatch": 1}
    run = fake_run("peer", 1, {8: {**summary(1.0), "num_errors": 1}})
    run["results"][0]["token_counts"] = counts
    run["results"][0]["requests"] = [r.to_dict() for r in recs]
    lines = race.notes([run])
    assert lines[0] == "round 2 peer c=8: 1 requests failed (boom)"
    assert "prompt tokens seen [128, 129], 1 outputs off" in lines[1]


def test_flags_concurrencies_and_peer_specs(monkeypatch):
    assert race.flag_value(["serve", "--port", "8010", "--dtype=bfloat16"], "--port") == "8010"
    assert race.flag_value(["--dtype=bfloat16"], "--dtype") == "bfloat16"
    assert race.flag_value(["--port"], "--port") is None
    assert race.parse_concurrencies("1, 8,32") == [1, 8, 32]
    for bad in ("", "0,1", "a"):
        with pytest.raises(ValueError, match="--concurrencies"):
            race.parse_concurrencies(bad)

    parser = argparse.ArgumentParser()
    race.add_arguments(parser)
    monkeypatch.setattr(race, "find_vllm", lambda: None)
    out = io.StringIO()
    (ours,) = race.server_specs(
        parser.parse_args(["m", "--infer-flags=--dtype float32"]), EMBEDDED_MODEL, out
    )
    assert ours.cmd[1:5] == ["-m", "infer", "serve", "m"] and ours.cmd[5:7] == ["--dtype", "float32"]
    assert ours.url.endswith(ours.cmd[-1]) and out.getvalue().startswith("no peer:")

    argv = ["--peer-cmd", "V/bin/vllm serve DIR --port 8010", "--peer-env", "A=1", "--peer-env", "B=x=y"]
    _, peer = race.server_specs(parser.parse_args(argv), EMBEDDED_MODEL, io.StringIO())
    assert peer.cmd == ["V/bin/vllm", "serve", "DIR", "--port", "8010"]
    assert peer.url == "http://127.0.0.1:8010" and peer.env == {"A": "1", "B": "x=y"}

    monkeypatch.setattr(race, "find_vllm", lambda: "/opt/bin/vllm")
    _, peer = race.server_specs(parser.parse_args([]), EMBEDDED_MODEL, io.StringIO())
    assert peer.cmd[:3] == ["/opt/bin/vllm", "serve", str(EMBEDDED_MODEL)] and peer.url.endswith(peer.cmd[-1])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        race.server_specs(parser.parse_args(["--peer-env", "nope"]), EMBEDDED_MODEL, io.StringIO())


def test_report_shape_is_json():
    runs = [fake_run("infer", 0, {1: summary(50.0)})]
    figures = race.race_figures(runs, [1])
    servers = {"infer": race.ServerSpec("infer", ["infer", "serve"], "http://x").describe(), "peer": None}
    report = race.build_report(
        "2026-01-01T00:00:00", "infer bench race", {"rounds": 1}, servers, runs, figures
    )
    again = json.loads(json.dumps(report))
    record_keys = {"kind", "record_version", "started", "command", "config", "server", "machine", "tables"}
    assert record_keys | {"notes", "plots", "details", "traces", "servers", "figures", "runs"} == set(again)
    assert again["kind"] == "race" and again["servers"]["infer"]["cmd"] == "infer serve"
    assert again["machine"]["num_cpus"] >= 1 and again["figures"][0]["infer"]["tok_s"] == [50.0]


def test_the_subcommand_is_registered():
    parser = argparse.ArgumentParser(prog="infer")
    add_bench_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "race", "--rounds", "1", "--concurrencies", "2"])
    assert args.func is race.cmd_race and args.rounds == 1 and args.prompt_tokens == 128


# ---- prompts and the launcher --------------------------------------------------------------------------


@pytest.mark.skipif(not (EMBEDDED_MODEL / "tokenizer.json").is_file(), reason="no embedded tokenizer")
def test_prompts_have_exactly_the_asked_token_count():
    tok = Tokenizer.from_pretrained(EMBEDDED_MODEL)
    prompts = exact_prompts(tok, 40, 128, seed=3)
    ids = [tok.encode(p) for p in prompts]
    assert all(len(x) == 128 and x[0] == tok.bos_token_id for x in ids)
    assert len({tuple(x[:16]) for x in ids}) == 40  # no two share a first KV block
    assert exact_prompts(tok, 40, 128, seed=3) == prompts != exact_prompts(tok, 40, 128, seed=4)
    with pytest.raises(ValueError, match="distinct prompts"):
        exact_prompts(tok, 3, 1, seed=0)  # BOS alone: one prompt only


# A /health server that leaves a child in its group and ignores SIGTERM: stop() must still end both.
STUBBORN = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
    open(sys.argv[2], "w").write(str(child.pid))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def gone(pid: int, wait: float = 10.0) -> bool:
    """True once `pid` has ended (a zombie counts: it only waits for its parent to reap it); a SIGKILL
    takes effect when the process is next scheduled, so this waits up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_launcher_stops_the_whole_group_even_when_sigterm_is_ignored(tmp_path):
    port, pid_file = free_port(), tmp_path / "child.pid"
    cmd = [sys.executable, "-c", STUBBORN, str(port), str(pid_file)]
    server = LaunchedServer(cmd, f"http://127.0.0.1:{port}", tmp_path / "log", timeout=30, stop_timeout=1)
    with server:
        leader, child = server.proc.pid, int(pid_file.read_text())
        assert httpx.get(server.url + "/health").status_code == 200
        with pytest.raises(RuntimeError, match="already answers"):  # never measure someone else's server
            LaunchedServer(cmd, server.url, tmp_path / "log2").start()
    assert gone(leader) and gone(child)


def test_launcher_reports_a_command_that_fails(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match="exited with 3"):
        LaunchedServer([sys.executable, "-c", "raise SystemExit(3)"], url, tmp_path / "a.log").start()
    with pytest.raises(RuntimeError, match="cannot run"):
        LaunchedServer([str(tmp_path / "no-such-server")], url, tmp_path / "b.log").start()


# ---- end to end ----------------------------------------------------------------------------------------


@pytest.mark.slow  # launches our server
def test_race_end_to_end_against_our_server(model_args, tmp_path, monkeypatch):
    monkeypatch.setattr(race, "find_vllm", lambda: None)  # never start a vLLM that happens to be installed
    path = tmp_path / "race.json"
    argv = [f"--infer-flags={' '.join([*model_args, '--max-batch-size', '4'])}", "--num-requests", "4",
            "--output-tokens", "8", "--prompt-tokens", "32", "--concurrencies", "1,2", "--rounds", "1",
            "--out", str(path), "--no-progress"]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = race.main(argv)
    assert rc == 0, err.getvalue()
    text = out.getvalue()
    assert text.startswith("no peer:") and "infer tok/s" in text and "note:" not in text

    report = json.loads(path.read_text())
    assert report["kind"] == "race" and report["servers"]["peer"] is None
    assert "--max-batch-size 4" in report["servers"]["infer"]["cmd"]
    assert report["config"]["concurrencies"] == [1, 2] and report["command"].endswith("--no-progress")
    (run,) = report["runs"]
    assert (
        run["side"] == "infer" and run["error"] is None and run["warmup"] == {"num_requests": 2, "num_ok": 2}
    )
    assert [x["concurrency"] for x in run["results"]] == [1, 2]
    for x in run["results"]:
        assert x["connections_opened"] == x["concurrency"]  # before the measured requests
        assert x["summary"]["num_ok"] == 4
        assert x["token_counts"]["num_prompt_mismatch"] == x["token_counts"]["num_output_mismatch"] == 0
        for r in x["requests"]:  # the server's own counts: exactly what was asked, and no prefix-cache hit
            assert r["num_prompt_tokens"] == 32 and r["num_completion_tokens"] == 8
            assert r["num_cached_tokens"] in (0, None)
    assert [f["infer"]["tok_s"][0] > 0 for f in report["figures"]] == [True, True]
    assert all(f["peer"]["tok_s"] == [] and f["ratio"] is None for f in report["figures"])

    assert gone(run["pid"])  # the server and everything it started are stopped
    with pytest.raises(httpx.TransportError):
        httpx.get(run["url"] + "/health", timeout=2)
