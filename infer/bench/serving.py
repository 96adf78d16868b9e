r"""The serving benchmark: five workloads against any OpenAI-compatible server.

    python benchmarks/bench_serving.py --server http://127.0.0.1:8000 --model embedded --workload all \
        --seed 42 --scale small [--no-save]
    infer bench serve ...                   # the same flags

Per workload: two warm-up requests (not counted), then the workload's requests with its arrival pattern;
throughput (output tok/s, from the server's `usage`), TTFT P50/P95/P99, ITL P50/P95/P99, latency P50/P99
(both from the intended send time), errors; then a cross-workload table and a JSON report in
`benchmarks/reports/` holding every request's timestamps.

    infer bench serve --server URL --workload embeddings,rerank [--input-tokens 128,512] \
        [--batch-sizes 1,32,256] [--tokenizer DIR]

A pooling model's workloads (infer.bench.pooling_workload): at each T x B, requests of B texts of exactly
T tokens (by the model's tokenizer) to POST /v1/embeddings or /v1/rerank, one at a time, 8 per point (2
at --scale small); documents per second and latency P50/P99.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import secrets
import shlex
import sys
import time
from pathlib import Path

from infer.bench.client import BenchError, StreamingClient, resolve_model, run_requests
from infer.bench.metrics import summarize
from infer.bench.record import new_record, table, write_record
from infer.bench.report import metrics_delta, progress_bar, render_table, scrape_metrics, server_info
from infer.bench.workloads import SCALES, WORKLOADS, Workload, get_workloads

DEFAULT_REPORT_DIR = Path("benchmarks/reports")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default="http://127.0.0.1:8000", help="base URL of the server")
    p.add_argument("--model", default=None, help="model name to send; default: the server's only model")
    p.add_argument(
        "--workload",
        default="all",
        help=f"'all' or a comma-separated list of: {', '.join(WORKLOADS)}; or, for a pooling model, "
        "embeddings and/or rerank",
    )
    p.add_argument("--input-tokens", default="128,512",
                   help="embeddings / rerank: each text's exact tokens, comma-separated")  # fmt: skip
    p.add_argument("--batch-sizes", default="1,32,256",
                   help="embeddings / rerank: texts per request, comma-separated")  # fmt: skip
    p.add_argument("--tokenizer", default=None,
                   help="embeddings / rerank: the model's tokenizer folder, to cut texts of exact lengths "
                   "(default: --model, when it is a folder)")  # fmt: skip
    p.add_argument("--seed", type=int, default=42, help="seeds prompts, lengths and Poisson arrivals")
    p.add_argument(
        "--scale", default="full", choices=list(SCALES), help="shrink the workloads (small: 2-core CPU)"
    )
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per workload (not counted)")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a server still starting")
    p.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, seconds")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not ask the server to ignore EOS")
    p.add_argument(
        "--server-flags", default=None, help="the flags the server was started with, for the report"
    )
    p.add_argument("--no-save", action="store_true", help="do not write the JSON report (nor the HTML one)")
    p.add_argument(
        "--no-report",
        action="store_true",
        help="no HTML report beside the JSON one (see `infer bench report`; with our server's trace "
        "when it records one)",
    )
    p.add_argument("--report-dir", type=Path, default=DEFAULT_REPORT_DIR, help="where JSON reports go")
    p.add_argument(
        "--no-cache-buster", action="store_true", help="no per-run nonce in prompts (repeats hit the cache)"
    )
    p.add_argument(
        "--roofline",
        default=None,
        metavar="DTYPE",
        choices=["float32", "bfloat16", "float16"],
        help="state throughput as a fraction of this machine's decode ceiling for the model in DTYPE "
        "(the server must run on this machine; the model from --roofline-model or the server's card); "
        "automatic for our own server on loopback, which reports its dtype",
    )
    p.add_argument("--roofline-model", default=None, help="model folder / preset for --roofline")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


async def run_workload(
    workload: Workload,
    base_url: str,
    model: str,
    seed: int,
    max_model_len: int | None = None,
    num_warmup: int = 2,
    api_key: str | None = None,
    timeout: float = 600.0,
    ignore_eos: bool = True,
    progress: bool = False,
    cache_buster: bool = True,
) -> dict:
    """Run one workload: warm-up, then every request; return its config, summary and per-request records."""
    nonce = secrets.token_hex(4) if cache_buster else ""
    specs = workload.build(seed, max_model_len, nonce)
    warmup_specs = workload.build(seed + 1, max_model_len, nonce + "w" if nonce else "")[:num_warmup]
    arrivals = workload.arrivals(seed)
    async with StreamingClient(base_url, model, api_key, timeout, ignore_eos) as client:
        warm = [await client.send(-1 - i, s, client.now()) for i, s in enumerate(warmup_specs)]
        before = await asyncio.to_thread(scrape_metrics, base_url)
        bar = progress_bar(len(specs), workload.name, progress)
        client.t0 = time.perf_counter()  # the run's clock starts after the warm-up
        records = await run_requests(client, specs, arrivals, on_done=lambda _: bar.update())
        bar.close()
        after = await asyncio.to_thread(scrape_metrics, base_url)
    return {
        "name": workload.name,
        "measures": workload.measures,
        "workload": {
            "num_requests": workload.num_requests,
            "prompt_tokens": [list(x) for x in workload.prompt_tokens],
            "max_tokens": list(workload.max_tokens),
            "arrival": arrivals.describe(),
            "shared_prefix_tokens": workload.shared_prefix_tokens,
            "cache_buster": nonce or None,
        },
        "warmup": {"num_requests": len(warm), "num_ok": sum(r.ok for r in warm)},
        "summary": summarize(records),
        "server_metrics_delta": metrics_delta(before, after),
        "requests": [r.to_dict() for r in records],
    }


# ---- tables ------------------------------------------------------------------------------------------


def _s(ms):
    return None if ms is None else ms / 1000


def detail_rows(summary: dict) -> list[tuple[str, object]]:
    t, ttft, itl, lat = summary["throughput"], summary["ttft_ms"], summary["itl_ms"], summary["latency_ms"]
    return [
        ("Requests (ok / all)", f"{summary['num_ok']} / {summary['num_requests']}"),
        ("Throughput (tok/s)", t["output_tokens_per_s"]),
        ("TTFT P50 (ms)", ttft["p50"]),
        ("TTFT P95 (ms)", ttft["p95"]),
        ("TTFT P99 (ms)", ttft["p99"]),
        ("ITL P50 (ms)", itl["p50"]),
        ("ITL P95 (ms)", itl["p95"]),
        ("ITL P99 (ms)", itl["p99"]),
        ("Latency P50 (s)", _s(lat["p50"])),
        ("Latency P99 (s)", _s(lat["p99"])),
        ("Dispatch delay P99 (ms)", summary["dispatch_delay_ms"]["p99"]),
        ("Prefix cache hits (%)", None if (h := summary["prefix_cache_hit_rate"]) is None else 100 * h),
        ("Errors", summary["num_errors"]),
    ]


def detail_spec(result: dict) -> tuple[list[str], list, str]:
    """One workload's table as (headers, rows, title): printed by detail_table, drawn by the HTML report."""
    w = result["workload"]
    title = f"== {result['name']}: {w['num_requests']} requests, {w['arrival']} ({result['measures']})"
    rows = [
        (k, f"{v:,.3f}" if "(s)" in k and v is not None else v) for k, v in detail_rows(result["summary"])
    ]
    return ["Metric", "Value"], rows, title


def detail_table(result: dict) -> str:
    return render_table(*detail_spec(result))


def comparison_spec(results: list[dict]) -> tuple[list[str], list, str]:
    headers = [
        "Workload",
        "Reqs",
        "Tok/s",
        "TTFT P50",
        "TTFT P99",
        "ITL P50",
        "ITL P99",
        "Lat P50 s",
        "Errors",
    ]
    rows = []
    for r in results:
        s = r["summary"]
        lat = _s(s["latency_ms"]["p50"])
        rows.append([
            r["name"], s["num_requests"], s["throughput"]["output_tokens_per_s"], s["ttft_ms"]["p50"],
            s["ttft_ms"]["p99"], s["itl_ms"]["p50"], s["itl_ms"]["p99"],
            "-" if lat is None else f"{lat:.3f}", s["num_errors"],
        ])  # fmt: skip
    return headers, rows, "== cross-workload comparison (times in ms unless noted)"


def comparison_table(results: list[dict]) -> str:
    return render_table(*comparison_spec(results))


# ---- the command -------------------------------------------------------------------------------------


def serving_plots(results: list[dict]) -> list[dict]:
    """The plots of a serving record, as data: latency per workload, and each workload's requests."""
    summary = {"per_class": {r["name"]: r["summary"] for r in results}}
    plots = [{"title": "TTFT and latency per workload", "plot": "latency_per_class", "args": [summary]}]
    for i, r in enumerate(results):
        if r["requests"]:
            at = ["workloads", i, "requests"]
            plots += [
                {"title": f"{r['name']}: token heatmap", "plot": "token_heatmap", "requests_at": at},
                {
                    "title": f"{r['name']}: fate by input length",
                    "plot": "fate_by_input_length",
                    "requests_at": at,
                },
            ]
    return plots


def decode_ceiling(model: str, dtype: str) -> dict:
    """The model's shape and this machine's single-stream decode ceiling (bandwidth / weight bytes)."""
    from infer.bench.roofline import measure_bandwidth, model_shape

    shape = model_shape(model, dtype)
    bandwidth = measure_bandwidth()
    return {
        **shape,
        "bandwidth_bytes_per_s": bandwidth,
        "decode_ceiling_tokens_per_s": bandwidth / shape["weight_bytes"],
    }


def _local_infer_dtype(base_url: str, server: dict) -> str | None:
    """Our server on this machine reports its resolved dtype: then the ceiling needs no --roofline."""
    from urllib.parse import urlparse

    flags = server.get("flags")
    local = urlparse(base_url).hostname in ("127.0.0.1", "localhost", "::1")
    return flags.get("dtype") if server["is_infer"] and local and isinstance(flags, dict) else None


POOLING_REQUESTS = {"full": 8, "small": 2}  # requests per (tokens, batch) point of a pooling workload


def pooling_spec(results: list[dict]) -> tuple[list[str], list, str]:
    headers = ["Workload", "Tokens", "Batch", "Reqs", "Docs/s", "Prompt tok/s", "Lat P50 ms", "Lat P99 ms",
               "Errors"]  # fmt: skip
    rows = [
        [r["name"], x["tokens"], x["batch"], x["summary"]["num_requests"], x["summary"]["docs_per_s"],
         x["summary"]["prompt_tokens_per_s"], x["summary"]["latency_ms"]["p50"],
         x["summary"]["latency_ms"]["p99"], x["summary"]["num_errors"]]
        for r in results for x in r["results"]
    ]  # fmt: skip
    return headers, rows, "== pooling workloads: B texts of exactly T tokens per request, one at a time"


def serving_record(args: argparse.Namespace, argv: list[str] | None, started, **fields) -> dict:
    """The one record of `bench serve`: its command line, its flags as config, `fields` as they are."""
    argv = sys.argv[1:] if argv is None else argv
    return new_record(
        "serving",
        shlex.join([Path(sys.argv[0]).name, *argv]),
        {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("func", "argv")},
        started=started.isoformat(),
        **fields,
    )


def run_pooling(args: argparse.Namespace, names: list[str], argv: list[str] | None, out) -> dict:
    """The embeddings / rerank workloads (infer.bench.pooling_workload) against the server, one request
    at a time, at each --input-tokens x --batch-sizes."""
    from infer.bench import pooling_workload
    from infer.bench.prompts import exact_prompts
    from infer.engine.tokenizer import load_tokenizer

    tokens = pooling_workload.parse_counts(args.input_tokens, "--input-tokens")
    batches = pooling_workload.parse_counts(args.batch_sizes, "--batch-sizes")
    model, card = resolve_model(args.server, args.model, args.api_key, args.wait)
    folder = args.tokenizer or (model if Path(model).is_dir() else None)
    if folder is None:
        raise BenchError(
            "embeddings / rerank cut texts of exact lengths with the model's tokenizer: pass --tokenizer "
            f"DIR (the server's model {model!r} is not a folder here)"
        )
    tokenizer = load_tokenizer(Path(folder))
    pool = max(64, max(batches))
    texts = {t: exact_prompts(tokenizer, pool, t, args.seed + t) for t in tokens}
    query = exact_prompts(tokenizer, 1, 16, args.seed)[0]
    started = datetime.datetime.now(datetime.UTC)
    print(f"infer bench serve: {args.server} model={model} workloads={','.join(names)}", file=out)
    results = []
    for name in names:
        run = asyncio.run(
            pooling_workload.drive(
                args.server, model, name, texts, query, pooling_workload.points(tokens, batches, [1]),
                POOLING_REQUESTS[args.scale], args.warmup, args.timeout, name, not args.no_progress,
            )
        )  # fmt: skip
        results.append({"name": name, **run})
    spec = pooling_spec(results)
    print("\n" + render_table(*spec), file=out)
    notes = [
        f"{r['name']} {x['tokens']}x{x['batch']}: usage counted {x['token_counts']['prompt_tokens_seen']} "
        f"prompt tokens, not {x['token_counts']['expected']}"
        for r in results for x in r["results"] if x["token_counts"]["num_prompt_mismatch"]
    ]  # fmt: skip
    for line in notes:
        print("note: " + line, file=out)
    report = serving_record(
        args,
        argv,
        started,
        server=server_info(args.server, card, args.server_flags, args.api_key),
        tables=[table(*spec)],
        notes=notes,
        pooling_workloads=results,
    )
    if not args.no_save:
        stamp = started.strftime("%Y%m%d-%H%M%S")
        path = (
            args.report_dir / f"serving-{model.replace('/', '_').strip('_')}-{'+'.join(names)}-{stamp}.json"
        )
        write_record(path, report, out)
        if not args.no_report:
            from infer.bench.html_report import write_html

            write_html(path, report, out=out)
    return report


def run(args: argparse.Namespace, argv: list[str] | None = None, out=None) -> dict:
    """Run the benchmark described by parsed `args`; print tables to `out` (stdout); return the report."""
    out = sys.stdout if out is None else out
    names = [n.strip() for n in args.workload.split(",") if n.strip()]
    pooling = [n for n in names if n in ("embeddings", "rerank")]
    if pooling and len(pooling) < len(names):
        raise ValueError("embeddings and rerank are a pooling model's workloads: run them without the others")
    if pooling:
        return run_pooling(args, pooling, argv, out)
    workloads = get_workloads(args.workload, args.scale)
    model, card = resolve_model(args.server, args.model, args.api_key, args.wait)
    max_model_len = card.get("max_model_len")
    started = datetime.datetime.now(datetime.UTC)
    print(
        f"infer bench serve: {args.server} model={model} workloads={','.join(w.name for w in workloads)} "
        f"scale={args.scale} seed={args.seed}",
        file=out,
    )
    results = []
    for w in workloads:
        result = asyncio.run(
            run_workload(
                w, args.server, model, args.seed, max_model_len, args.warmup, args.api_key, args.timeout,
                not args.no_ignore_eos, progress=not args.no_progress, cache_buster=not args.no_cache_buster,
            )
        )  # fmt: skip
        results.append(result)
        print("\n" + detail_table(result), file=out, flush=True)
    print("\n" + comparison_table(results), file=out)
    server = server_info(args.server, card, args.server_flags, args.api_key)
    dtype = args.roofline or _local_infer_dtype(args.server, server)
    ceiling = None
    if dtype:
        ceiling = decode_ceiling(args.roofline_model or card.get("root") or model, dtype)
        for r in results:
            tps = r["summary"]["throughput"]["output_tokens_per_s"]
            r["summary"]["fraction_of_decode_ceiling"] = tps / ceiling["decode_ceiling_tokens_per_s"]
        ceiling_note = (
            f"roofline ({ceiling['model']}, {dtype}): single-stream decode ceiling "
            f"{ceiling['decode_ceiling_tokens_per_s']:,.1f} tok/s; measured / ceiling: "
            + ", ".join(f"{r['name']} {r['summary']['fraction_of_decode_ceiling']:.2f}" for r in results)
        )
        print("\n" + ceiling_note, file=out)
    report = serving_record(
        args,
        argv,
        started,
        server=server,
        tables=[table(*comparison_spec(results)), *(table(*detail_spec(r)) for r in results)],
        notes=[ceiling_note] if ceiling else [],
        plots=serving_plots(results),
        roofline=ceiling,
        workloads=results,
    )
    if not args.no_save:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        stamp = started.strftime("%Y%m%d-%H%M%S")
        path = (
            args.report_dir
            / f"serving-{model.replace('/', '_')}-{args.workload.replace(',', '+')}-{stamp}.json"
        )
        write_record(path, report, out)
        if not args.no_report:
            from infer.bench.html_report import write_run_html

            write_run_html(path, report, started, args.server, args.api_key, out)
    return report


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        run(args, getattr(args, "argv", None))
    except BenchError as exc:
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_serving.py", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return cmd_serve(args)
    except ValueError as exc:
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return 2
