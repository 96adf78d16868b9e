r"""Storms and soak: does the server give everything back, refuse cleanly, and stay flat over time?

    infer bench stress [MODEL] [--infer-flags="--max-num-seqs 8"]        # starts `infer serve`, then stops it
    infer bench stress --server http://127.0.0.1:8000 [--api-key K] [--pid PID]   # a server already running
        [--phases aborts,overload,soak,fairness] [--aborts 1000] [--overload-seconds 60] [--soak-seconds 1800]

Four phases, each ending with a verdict:

  aborts    N streamed requests, each left at a random point by its client: before the first byte (the
            connection dropped while the server tokenizes or admits), mid-prefill (at the response headers,
            with a long prompt), mid-decode (after 1-8 chunks), or a non-streamed request given up on. Then
            /metrics must settle to 0 requests running or waiting and 0 KV blocks held
            (`kv_cache_usage_perc` is the fraction of blocks held by requests: 0 exactly when none is),
            /health must be 200, and a plain request must still be served.
  overload  --overload-factor (10) x the admission bound (max_num_seqs + max_queued_requests, from
            /server_info or --admission-bound) closed-loop workers for a duration; a refused worker pauses
            --retry-pause (1 s, as Retry-After says) and tries again. Every answer must be a complete 200
            (usage counting exactly max_tokens) or a 429/503 with a message: 0 lost, 0 5xx. Reports the
            admitted requests' TTFT and latency. A pause much shorter than Retry-After measures another
            thing: how refusals starve the engine. On 2 cores, 40 workers against a 2 + 2 server admitted
            15.7 requests/s (latency p99 0.36 s) with a 1 s pause, 1.1/s (p99 9.5 s) with 0.05 s.
  soak      mixed traffic (streamed, non-streamed and chat completions, streams left early, requests refused
            as invalid) for a duration, sampling the server's RSS and open file descriptors from /proc/PID
            (the launched server's, or --pid). Reports their slopes (a least-squares fit over the second
            half: the first holds the warm-up), the descriptors at idle before and after, and every error.
            Leaks are judged only on runs of at least --min-judge-seconds.
  fairness  a bystander stream alone, then beside one client sending each expensive kind of request at
            its allowed maximum (prompt_logprobs, long prompts, distinct grammars, 100 compilations at
            once, logit_bias, n = 128, stop lists, tool lists): its TTFT and ITL p99 must stay within
            --fairness-bound (2x) of alone, 1.5x beside the compilations (infer/bench/stress_fairness.py).
            A model whose decode step is more than overhead, and room for n = 128:

    infer bench stress /path/to/SmolLM2-135M --phases fairness --infer-flags="--max-num-seqs 136"

A table on stdout, a JSON record (benchmarks/reports/stress-*.json, or --out) and its HTML page beside it
(unless --no-report); exit status 1 when a verdict fails. Short forms run in the tests
(tests/bench/test_bench_stress.py); the long one, on an idle machine:

    infer bench stress --phases aborts,overload,soak --aborts 1000 --overload-seconds 60 --soak-seconds 1800
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import secrets
import shlex
import sys
from pathlib import Path

from infer.bench.client import BenchError, resolve_model
from infer.bench.launch import LaunchedServer
from infer.bench.record import new_record, table, write_record
from infer.bench.report import fetch_server_info, render_tables
from infer.bench.stress_checks import LeakLimits
from infer.bench.stress_fairness import KINDS, run_fairness
from infer.bench.stress_phases import run_aborts, run_overload, run_soak

PHASES = ("aborts", "overload", "soak", "fairness")
LAUNCH_FLAGS = ["--max-num-seqs", "8", "--max-queued-requests", "16"]  # before --infer-flags (which win)
DEFAULT_REPORT_DIR = Path("benchmarks/reports")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="for the launched server; default: embedded")
    p.add_argument("--server", default=None, help="a running server's URL (else one is launched)")
    p.add_argument("--api-key", default=None, help="the running server's key")
    p.add_argument("--heavy-api-key", default=None,
                   help="fairness: the heavy client's own key on a running server with several keys "
                   "(default: --api-key); a server launched for the fairness phase alone gets one "
                   "for each client")  # fmt: skip
    p.add_argument("--pid", type=int, default=None, help="the running server's PID, for the soak's samples")
    p.add_argument("--infer-flags", default="", help="flags for the launched server (after "
                   f"{' '.join(LAUNCH_FLAGS)}, which they override)")  # fmt: skip
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated, of: " + ", ".join(PHASES))
    p.add_argument("--aborts", type=int, default=1000, help="requests left early by their client")
    p.add_argument("--abort-concurrency", type=int, default=16, help="of those, at once")
    p.add_argument("--overload-seconds", type=float, default=60.0)
    p.add_argument("--overload-factor", type=int, default=10, help="workers per admitted request")
    p.add_argument("--overload-max-tokens", type=int, default=32)
    p.add_argument("--admission-bound", type=int, default=None,
                   help="max_num_seqs + max_queued_requests, when /server_info cannot say")  # fmt: skip
    p.add_argument("--retry-pause", type=float, default=1.0,
                   help="seconds a refused worker waits (our server's Retry-After)")  # fmt: skip
    p.add_argument("--soak-seconds", type=float, default=1800.0)
    p.add_argument("--soak-concurrency", type=int, default=8)
    p.add_argument("--sample-interval", type=float, default=10.0, help="seconds between RSS/fd samples")
    p.add_argument("--max-rss-growth", type=float, default=LeakLimits.rss_mib_per_hour, help="MiB/hour")
    p.add_argument("--max-fd-growth", type=int, default=LeakLimits.fd_growth, help="descriptors at idle")
    p.add_argument("--min-judge-seconds", type=float, default=LeakLimits.min_judge_seconds)
    p.add_argument(
        "--fairness-kinds", default=",".join(KINDS), help="comma-separated, of: " + ", ".join(KINDS)
    )
    p.add_argument("--fairness-tokens", type=int, default=200, help="the bystander's max_tokens")
    p.add_argument("--fairness-concurrency", type=int, default=4, help="the heavy client's requests at once")
    p.add_argument("--fairness-lead", type=float, default=1.0, help="seconds the heavy client starts first")
    p.add_argument("--fairness-bound", type=float, default=2.0, help="bystander TTFT / ITL p99 vs alone")
    p.add_argument(
        "--fairness-repeat",
        type=int,
        default=1,
        help="bystander runs alone and beside each kind; their medians judged",
    )
    p.add_argument("--settle-timeout", type=float, default=30.0, help="seconds for /metrics to reach idle")
    p.add_argument("--timeout", type=float, default=120.0, help="client timeout per request, seconds")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a launched server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="report path (default benchmarks/reports/...)")
    p.add_argument("--no-report", action="store_true", help="no HTML report beside the JSON one")


def parse_phases(text: str) -> list[str]:
    phases = [p.strip() for p in text.split(",") if p.strip()]
    if not phases or set(phases) - set(PHASES):
        raise ValueError(f"--phases takes a comma-separated list of {', '.join(PHASES)}, got {text!r}")
    return [p for p in PHASES if p in phases]


def admission_bound(url: str, api_key: str | None) -> int | None:
    """max_num_seqs + max_queued_requests from our server's /server_info; None elsewhere."""
    info = fetch_server_info(url, api_key) or {}
    try:
        return int(info["engine"]["max_num_seqs"]) + int(info["server"]["max_queued_requests"])
    except (KeyError, TypeError, ValueError):
        return None


def _figures(phase: str, result: dict) -> str:
    if phase == "aborts":
        return f"settled in {result['idle']['settle_s']:.1f} s; engine aborts {result['engine_aborts']}"
    if phase == "overload":
        t, lat = result["ttft_ms"], result["latency_ms"]
        return (f"{result['num_workers']} workers; admitted {result['admitted_per_s'] or 0:.1f}/s; TTFT p50 "
                f"{t['p50'] or 0:.0f} p99 {t['p99'] or 0:.0f} ms; latency p50 {lat['p50'] or 0:.0f} "
                f"p99 {lat['p99'] or 0:.0f} ms")  # fmt: skip
    if phase == "fairness":
        kinds = result["kinds"].values()
        ttft, itl = (max(r["ratios"].get(k, 0) for r in kinds) for k in ("ttft_ms", "itl_p99_ms"))
        return f"worst of {len(kinds)} kinds: TTFT {ttft:.1f}x, ITL p99 {itl:.1f}x its time alone"
    leak = result["leak"]
    rss, fds = leak["rss_mib_per_hour"], leak["fds_per_hour"]
    return (f"RSS {'-' if rss is None else f'{rss:+.1f}'} MiB/h, fds {'-' if fds is None else f'{fds:+.1f}'}"
            f"/h; idle fds {leak['fds_idle_before_after'] or '-'}")  # fmt: skip


def results_table(phases: dict) -> dict:
    rows = []
    for phase, result in phases.items():
        counts = ", ".join(f"{k} {v}" for k, v in sorted(result["counts"].items(), key=lambda kv: -kv[1]))
        verdict = "pass" if not result["problems"] else "FAIL: " + "; ".join(result["problems"])
        rows.append([phase, result["num_requests"], f"{result['duration_s']:.0f}", counts,
                     _figures(phase, result), verdict])  # fmt: skip
    headers = ["Phase", "Requests", "Seconds", "Outcomes", "Figures", "Verdict"]
    return table(headers, rows, "== stress: storms and soak")


def result_notes(phases: dict) -> list[str]:
    return [f"note ({phase}): {result['note']}" for phase, result in phases.items() if result.get("note")]


def run(args: argparse.Namespace, argv: list[str] | None = None, out=None) -> dict:
    """Run the phases against args.server, or a server launched here; print the table; return the report."""
    out = sys.stdout if out is None else out
    phases = parse_phases(args.phases)
    started = datetime.datetime.now(datetime.UTC)
    path = args.out or DEFAULT_REPORT_DIR / f"stress-{started.strftime('%Y%m%d-%H%M%S')}.json"
    launched = None
    if args.server is None:
        # the fairness phase alone: the bystander and the heavy client each with a key of their own, as two
        # clients the server can tell apart (other phases measure one client's storm: no key)
        keys = [secrets.token_hex(16) for _ in range(2)] if phases == ["fairness"] else []
        flags = [
            *LAUNCH_FLAGS,
            *(["--model", args.model] if args.model else []),
            *(["--api-key", ",".join(keys)] if keys else []),
            *shlex.split(args.infer_flags),
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        launched = LaunchedServer.ours(flags, path.with_suffix(".server.log"), args.start_timeout)
        args.api_key, args.heavy_api_key = (keys[0], keys[1]) if keys else (None, None)
    try:
        if launched is not None:
            launched.start()
        url = launched.url if launched else args.server.rstrip("/")
        pid = launched.proc.pid if launched else args.pid
        _, card = resolve_model(url, None, args.api_key, wait_s=0)
        model, max_model_len = card["id"], card.get("max_model_len")
        results = {}
        for phase in phases:
            print(f"-- {phase} ...", file=out, flush=True)
            if phase == "aborts":
                results[phase] = asyncio.run(run_aborts(url, model, args, max_model_len))
            elif phase == "overload":
                bound = args.admission_bound or admission_bound(url, args.api_key)
                if bound is None:
                    raise BenchError("the overload needs the admission bound: pass --admission-bound N")
                results[phase] = asyncio.run(run_overload(url, model, args, bound, max_model_len))
            elif phase == "soak":
                results[phase] = asyncio.run(run_soak(url, model, args, pid, max_model_len))
            else:
                max_num_seqs = (
                    (fetch_server_info(url, args.api_key) or {}).get("engine", {}).get("max_num_seqs")
                )
                results[phase] = asyncio.run(run_fairness(url, model, args, max_model_len, max_num_seqs))
    finally:
        if launched is not None:
            launched.stop()
    tables, notes = [results_table(results)], result_notes(results)
    print(render_tables(tables), file=out)
    for line in notes:
        print(line, file=out)
    argv = sys.argv[1:] if argv is None else argv
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
              if k not in ("func", "argv", "api_key", "heavy_api_key")}  # fmt: skip
    server = {
        "url": url,
        "model_card": card,
        "pid": pid,
        "launched": shlex.join(launched.cmd) if launched else None,
        "log": str(launched.log_path) if launched else None,
    }
    report = new_record(
        "stress",
        shlex.join([Path(sys.argv[0]).name, *argv]),
        config,
        started=started.isoformat(),
        server=server,
        tables=tables,
        notes=notes,
        phases=results,
        passed=not any(r["problems"] for r in results.values()),
    )
    write_record(path, report, out)
    if not args.no_report:
        from infer.bench.html_report import write_html

        write_html(path, report, out=out)
    return report


def cmd_stress(args: argparse.Namespace) -> int:
    try:
        report = run(args, getattr(args, "argv", None))
    except ValueError as exc:
        print(f"bench stress: error: {exc}", file=sys.stderr)
        return 2
    except (BenchError, RuntimeError) as exc:
        print(f"bench stress: error: {exc}", file=sys.stderr)
        return 1
    return 0 if report["passed"] else 1
