"""In-process micro-benchmarks: each engine mechanism (KV cache, continuous batching, chunked prefill,
priority scheduling, prefix caching) against its baseline, on the cases of a reference engine.

The reference is a minimal NanoGPT server (one request at a time, its KV cache grown by torch.cat) whose
cases, knobs and table layout these benchmarks reproduce; its figure for each case is printed beside
ours as `reference`. Results: docs/engine.md.

    python -m infer.bench.micro {kv-cache,continuous-batching,chunked-prefill,scheduling,prefix-caching,
                                 speculative-decoding,all}
        [--model toy|embedded|FOLDER|PRESET] [--load-format dummy] [--dtype auto] [--json FILE]
        [--scale small] [--repeats N] [--speculative-config JSON] [--oracle [KS]] [--streams 1,8,32]

Each benchmark prints the reference's table per case (baseline and optimized rows, its columns), the
ratio columns, a summary table, and one PASS/MISS verdict line per case against the expectation its
module's docstring states.
Baseline and optimized runs are interleaved and each timing is the best of --repeats runs; counts
(tokens, cached tokens, preemptions, evictions) must agree between repeats. `add_micro_parser` plugs the
same command into a CLI as `... micro`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

# the benchmark modules (and torch) are imported when a benchmark runs: `infer --help` stays fast
BENCHMARKS = (
    "kv-cache",
    "continuous-batching",
    "chunked-prefill",
    "scheduling",
    "prefix-caching",
    "speculative-decoding",
)
TOY = "toy"  # --model for the reference's NanoGPT


def benchmark_modules() -> dict:
    from infer.bench.micro import (
        chunked_prefill,
        continuous_batching,
        kv_cache,
        prefix_caching,
        scheduling,
        speculative_decoding,
    )

    found = (kv_cache, continuous_batching, chunked_prefill, scheduling, prefix_caching, speculative_decoding)
    modules = {m.NAME: m for m in found}
    assert tuple(modules) == BENCHMARKS
    return modules


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("benchmark", choices=[*BENCHMARKS, "all"])
    p.add_argument(
        "--model",
        default=TOY,
        help="'toy' (default: the reference's 0.057M NanoGPT, trained once for a few seconds and cached), "
        "'embedded', a model folder, or a preset with --load-format dummy",
    )
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 for the toy (faster at its size), the engine's choice otherwise",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: 1 for the toy, torch's own otherwise)",
    )
    p.add_argument("--json", metavar="FILE", help="also write every table and verdict as JSON")
    p.add_argument(
        "--no-report",
        action="store_true",
        help="no HTML report (written beside --json FILE, else as benchmarks/reports/micro-TIME.html)",
    )
    p.add_argument("--scale", default="full", choices=["full", "small"], help="small: the test-suite cases")
    p.add_argument("--repeats", type=int, default=None, help="runs per mode at least (default 5; small: 1)")
    p.add_argument(
        "--min-seconds",
        type=float,
        default=None,
        help="and more runs (30 at most) until each mode ran this long; best kept (default 2; small: 0)",
    )
    p.add_argument("--retrain", action="store_true", help="train the toy again")
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=None,
        help="speculative-decoding: the proposals to measure, vLLM's fields, e.g. "
        '\'{"method": "draft_model", "model": "/tmp/embedded-draft", "num_speculative_tokens": 3}\' '
        "(default: n-gram, K = 3, prompt lookup 2-4)",
    )
    p.add_argument(
        "--oracle",
        nargs="?",
        const="1,2,3,4",
        default=None,
        metavar="KS",
        help="speculative-decoding: propose the target's own greedy continuation, right with probability "
        "0, 0.5, 0.8 and 1.0 at each position, K = 1..4 (or the comma-separated KS), beside plain decoding "
        "(a verification's cost and the speed-up at each acceptance, on any model: random weights too)",
    )
    p.add_argument(
        "--streams",
        default=None,
        help="speculative-decoding: the concurrent streams, comma-separated (default 1,8,32; small: 1,8)",
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        type=Path,
        default=None,
        help="record the engine trace (Perfetto's JSON) of each engine setting's last run into "
        "DIR/BENCHMARK-KNOBS.trace.json; the HTML report draws their per-request timelines",
    )


def add_micro_parser(subparsers) -> argparse.ArgumentParser:
    """Register `micro` on an argparse subparsers object (e.g. `infer bench micro ...`)."""
    p = subparsers.add_parser(
        "micro",
        help="in-process micro-benchmarks: each engine mechanism against its baseline",
        description=__doc__.split("\n")[0],
    )
    add_arguments(p)
    p.set_defaults(func=cmd_micro)
    return p


def run_benchmarks(ctx, names: list[str]) -> list:
    modules = benchmark_modules()
    ctx.warm_up()
    results = []
    for name in names:
        ctx.benchmark = name
        results.append(modules[name].run(ctx))
    return results


def cmd_micro(args) -> int:
    from infer.bench.micro.harness import Context, prepare_model
    from infer.bench.micro.report import record
    from infer.bench.record import write_record

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    oracle, streams = counts("--oracle", args.oracle), counts("--streams", args.streams)
    model, dtype, threads = prepare_model(args.model, args.dtype, args.threads, args.retrain)
    repeats = args.repeats or (1 if args.scale == "small" else 5)
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    min_seconds = (
        args.min_seconds if args.min_seconds is not None else (0.0 if args.scale == "small" else 2.0)
    )
    ctx = Context(model, dtype, args.load_format, repeats, min_seconds, args.scale, trace_dir=args.trace)
    ctx.speculative_config = speculative_config(args.speculative_config)
    ctx.oracle, ctx.streams = oracle, streams
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
    names = list(BENCHMARKS) if args.benchmark == "all" else [args.benchmark]
    now = datetime.datetime.now(datetime.UTC)
    started = now.strftime("%Y-%m-%d %H:%M:%S UTC")
    ctx.print(
        f"infer micro-benchmarks: model={args.model} ({model}), dtype={dtype}, threads={threads}, "
        f"load_format={args.load_format}, repeats={repeats}+ (until {min_seconds:g} s per mode; best of, "
        f"interleaved), scale={args.scale}, "
        f"started {started}"
    )
    results = run_benchmarks(ctx, names)
    ctx.print("\n##### Verdicts #####")
    for result in results:
        for verdict in result.verdicts:
            ctx.print(f"[{result.name}] {verdict.line()}")
    if args.json or not args.no_report:
        meta = {
            "command": " ".join(sys.argv),
            "started": started,
            "model": args.model,
            "model_path": model,
            "dtype": dtype,
            "threads": threads,
            "load_format": args.load_format,
            "repeats": repeats,
            "min_seconds": min_seconds,
            "scale": args.scale,
            "trace_dir": str(args.trace) if args.trace is not None else None,
            "speculative_config": ctx.speculative_config,
            "oracle": list(ctx.oracle),
        }
        doc = record(meta, results)
    if args.json:
        write_record(Path(args.json), doc)
    if not args.no_report:
        from infer.bench.html_report import write_html

        path = (
            Path(args.json) if args.json else Path("benchmarks/reports") / f"micro-{now:%Y%m%d-%H%M%S}.json"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        write_html(path, doc)
    return 0


def speculative_config(text: str | None) -> dict | None:
    """--speculative-config's JSON object, checked as the engine will check it (ValueError if bad)."""
    if text is None:
        return None
    from infer.config import SpeculativeConfig

    SpeculativeConfig.from_value(text)
    return json.loads(text)


def counts(flag: str, text: str | None) -> tuple[int, ...]:
    """A flag's comma-separated counts (ValueError unless each is >= 1); () when not given."""
    if text is None:
        return ()
    try:
        found = tuple(int(n) for n in text.split(","))
    except ValueError:
        found = ()
    if not found or min(found) < 1:
        raise ValueError(f"{flag} takes comma-separated counts >= 1, got {text!r}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer.bench.micro", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_micro(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
