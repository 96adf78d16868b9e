"""`infer bench ...`: the benchmark subcommands, registered by `infer.cli` through `add_bench_parsers`."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import shlex
import sys
from pathlib import Path

# The bench client's libraries: the `bench` extra, not needed to serve.
REQUIREMENTS = ("aiohttp", "httpx", "matplotlib", "tqdm")


def missing_requirement() -> str | None:
    """The first of the bench extra's libraries that is not installed, or None."""
    return next((name for name in REQUIREMENTS if importlib.util.find_spec(name) is None), None)


def add_bench_parsers(subparsers) -> argparse.ArgumentParser:
    """Add `bench` (serve, traffic, client, roofline, race, stress, micro, report) to the top-level
    subparsers of `infer`."""
    bench = subparsers.add_parser("bench", help="benchmarks: serving workloads, micro-benchmarks")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    from infer.bench import serving
    from infer.bench import traffic as traffic_module

    serve = sub.add_parser(
        "serve",
        help="five serving workloads (baseline, continuous_batching, paged_attention, chunked_prefill, "
        "prefix_caching) against a server",
        description=serving.__doc__,
    )
    serving.add_arguments(serve)
    serve.set_defaults(func=serving.cmd_serve)
    traffic = sub.add_parser(
        "traffic",
        help="mixed traffic of request classes (siso/silo/liso/lilo) under Poisson arrivals: per-class SLO "
        "goodput, plots, a tradeoff matrix of server flags",
        description=traffic_module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    traffic.add_argument("--config", required=True, type=Path, help="YAML file: defaults + experiments")
    traffic.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/reports/traffic-TIME)"
    )
    traffic.add_argument("--only", default=None, help="comma-separated experiment names to run")
    traffic.add_argument("--no-report", action="store_true", help="no HTML report (OUT/tradeoff.html)")
    traffic.add_argument(
        "--trace",
        action="store_true",
        help="record the engine trace of each experiment that launches our server "
        "(OUT/NAME/engine.trace.json, for Perfetto); the HTML report draws its per-request timeline",
    )
    traffic.set_defaults(func=cmd_traffic)
    from infer.bench import client_latency, html_report, race, roofline, stress

    for name, module, func, help_text in [
        (
            "client",
            client_latency,
            client_latency.cmd_client,
            "cold and warm prefix TTFT, sequential and concurrent batches",
        ),
        (
            "roofline",
            roofline,
            roofline.cmd_roofline,
            "a model's bandwidth and compute ceilings on this machine",
        ),
        ("race", race, race.cmd_race, "infer serve against a peer server (vLLM), started in turn, same load"),
        (
            "stress",
            stress,
            stress.cmd_stress,
            "aborts, overload and a soak against our server; nothing may leak",
        ),
        ("report", html_report, html_report.cmd_report, "a run's report JSON as one offline HTML page"),
    ]:
        parser = sub.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(parser)
        parser.set_defaults(func=func)
    from infer.bench.micro import add_micro_parser

    add_micro_parser(sub)
    return bench


def cmd_traffic(args: argparse.Namespace) -> int:
    from infer.bench.client import BenchError
    from infer.bench.traffic import run_config

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("benchmarks/reports") / f"traffic-{stamp}"
    only = [n.strip() for n in args.only.split(",")] if args.only else None
    command = shlex.join(
        ["infer", *getattr(args, "argv", ["bench", "traffic", "--config", str(args.config)])]
    )
    try:
        run_config(args.config, out, only, trace=args.trace, command=command)
    except (BenchError, RuntimeError) as exc:
        print(f"bench traffic: error: {exc}", file=sys.stderr)
        return 1
    if not args.no_report:
        from infer.bench.html_report import write_html

        write_html(out / "tradeoff.json")
    return 0
