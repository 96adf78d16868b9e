"""Mixed traffic: request classes (siso/silo/liso/lilo), arrivals, per-class SLO goodput, one YAML file.

    infer bench traffic --config traffic.yaml [--out DIR] [--only NAME,...]

The file has a `defaults` block and named `experiments` whose keys override it (dicts merge, the rest
replaces). An experiment points at a running server (`server: {url, model}`) or starts ours
(`launch: [flags...]`, stopped afterwards), and may `sweep` one parameter:

    defaults:
      server: {url: http://127.0.0.1:8000}
      num_requests: 200
      arrival: {mode: poisson, rate: 8, max_concurrency: 32}   # or synchronous / concurrent / constant
      timeout_s: 60
      window: {warmup_s: 2, cooldown_s: 2}
      classes:
        siso: {share: 0.4, prompt_tokens: [32, 128], output_tokens: [16, 64], slo: {ttft_ms: 5000}}
        lilo: {share: 0.1, prompt_tokens: [512, 768], output_tokens: [128, 256], slo: {itl_p95_ms: 250}}
    experiments:
      baseline: {launch: [--no-prefix-caching]}
      prefix: {launch: [--prefix-caching], shared_prefix_tokens: 256}
      rates: {sweep: {param: arrival.rate, values: [2, 4, 8]}}

Per experiment, under OUT/NAME/: requests.jsonl (every request, whatever its fate), summary.json and PNG
plots; across experiments OUT/tradeoff.{json,md,png}: SLO compliance per class x experiment.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import secrets
import sys
import time
from pathlib import Path

from infer.bench.client import RequestSpec, StreamingClient, resolve_model, run_requests
from infer.bench.launch import LaunchedServer
from infer.bench.metrics import goodput, stable_window, summarize
from infer.bench.record import new_record, table, write_record
from infer.bench.report import progress_bar, render_tables, scrape_metrics
from infer.bench.traffic_config import arrivals_of, build_requests, load_experiments, request_classes


async def _poll(url: str, every: float, t0: float, timeline: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        sample = await asyncio.to_thread(scrape_metrics, url, 2.0)
        if sample is not None:
            timeline.append({"t": time.perf_counter() - t0, **sample})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def _run(cfg: dict, url: str, model: str, specs: list[RequestSpec]) -> tuple[list, list[dict]]:
    s = cfg["server"]
    timeline: list[dict] = []
    async with StreamingClient(url, model, s.get("api_key"), cfg["timeout_s"], cfg["ignore_eos"]) as client:
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll(url, cfg["metrics_poll_s"], client.t0, timeline, stop))
        bar = progress_bar(len(specs), "requests")
        records = await run_requests(client, specs, arrivals_of(cfg), on_done=lambda _: bar.update())
        bar.close()
        stop.set()
        await poller
    return records, timeline


def analyze(cfg: dict, records: list) -> dict:
    """summary.json's numbers: all requests, the stable window, goodput and per-class breakdowns."""
    classes = request_classes(cfg)
    window = stable_window(records, cfg["window"]["warmup_s"], cfg["window"]["cooldown_s"])
    kept = window.records
    slos = {c.name: c.slo for c in classes}
    per_class = {}
    for c in classes:
        recs = [r for r in kept if r.req_class == c.name]
        per_class[c.name] = {"slo": vars(c.slo), **summarize(recs)}
    return {
        "all": summarize(records),
        "window": window.to_dict(),
        "stable": summarize(kept),
        "goodput": goodput(kept, slos),
        "per_class": per_class,
    }


TRACE_NAME = "engine.trace.json"


def run_experiment(name: str, cfg: dict, out_dir: Path, log=print, trace: bool = False) -> dict:
    """Run one experiment (launching a server if asked, recording its engine trace with `trace`); write
    its outputs; return its summary."""
    exp_dir = out_dir / safe_name(name)
    exp_dir.mkdir(parents=True, exist_ok=True)
    launch = cfg["launch"]
    if launch is not None and trace:  # written by the server as it stops
        launch = [*launch, "--trace", str(exp_dir / TRACE_NAME)]
    elif trace:
        log(f"-- {name}: no trace: it runs against a server it did not start (that one's GET /debug/trace)")
    server = LaunchedServer.ours(launch, exp_dir / "server.log") if launch is not None else None
    if server is not None:
        server.start()
    try:
        url = server.url if server else cfg["server"]["url"]
        _, card = resolve_model(url, cfg["server"]["model"], cfg["server"].get("api_key"), wait_s=0)
        specs = build_requests(cfg, secrets.token_hex(4))
        log(f"-- {name}: {len(specs)} requests, {arrivals_of(cfg).describe()}, {url}")
        records, timeline = asyncio.run(_run(cfg, url, card["id"], specs))
    finally:
        if server is not None:
            server.stop()
    with open(exp_dir / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r.to_dict()) + "\n")
    summary = {
        "experiment": name,
        "config": cfg,
        "url": url,
        "server": card,
        **analyze(cfg, records),
        "timeline": timeline,
    }
    (exp_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    from infer.bench import plots

    plots.experiment_plots(records, summary, exp_dir)
    return summary


def safe_name(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_.=" else "_" for ch in name)


def experiment_rows(summaries: list[dict]) -> list[list]:
    rows = []
    for s in summaries:
        st, g = s["stable"], s["goodput"]
        rows.append([
            s["experiment"], st["num_requests"], f"{s['all']['num_ok']}/{s['all']['num_requests']}",
            st["throughput"]["output_tokens_per_s"], g["goodput_tokens_per_s"], st["ttft_ms"]["p50"],
            st["ttft_ms"]["p99"], st["itl_ms"]["p95"], st["dispatch_delay_ms"]["p99"],
        ])  # fmt: skip
    return rows


def tradeoff(summaries: list[dict]) -> tuple[list[str], list[str], list[list[float | None]]]:
    """SLO compliance (stable window) per class x experiment."""
    classes = sorted({c for s in summaries for c in s["goodput"]["per_class"]})
    names = [s["experiment"] for s in summaries]
    matrix = [[s["goodput"]["per_class"].get(c, {}).get("compliance") for s in summaries] for c in classes]
    return classes, names, matrix


EXPERIMENT_HEADERS = ["Experiment", "Stable", "OK/all", "Tok/s", "Good tok/s", "TTFT P50", "TTFT P99",
                      "ITL P95", "Disp P99"]  # fmt: skip


def result_tables(
    summaries: list[dict], classes: list[str], names: list[str], matrix: list[list]
) -> list[dict]:
    """The two tables (infer.bench.record.table): printed by run_config, and kept in its record."""
    cells = [
        [c] + ["-" if v is None else f"{100 * v:.0f}%" for v in row]
        for c, row in zip(classes, matrix, strict=True)
    ]
    return [
        table(EXPERIMENT_HEADERS, experiment_rows(summaries), "== experiments (ms; stable window)"),
        table(["Class", *names], cells, "== SLO compliance (class x experiment)"),
    ]


def run_config(
    config_path: Path,
    out_dir: Path,
    only: list[str] | None = None,
    out=None,
    trace: bool = False,
    command: str | None = None,
) -> dict:
    """Run the experiments of a config; print the tables; write OUT/tradeoff.json (the record), .md, .png."""
    out = sys.stdout if out is None else out
    started = datetime.datetime.now(datetime.UTC)
    experiments = load_experiments(Path(config_path).read_text())
    if only:
        missing = [n for n in only if n not in experiments]
        if missing:
            raise ValueError(f"no experiment {missing}; the config has {', '.join(experiments)}")
        experiments = {n: experiments[n] for n in only}
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [
        run_experiment(n, cfg, out_dir, lambda m: print(m, file=out, flush=True), trace)
        for n, cfg in experiments.items()
    ]
    classes, names, matrix = tradeoff(summaries)
    tables = result_tables(summaries, classes, names, matrix)
    print("\n" + render_tables(tables), file=out)
    (out_dir / "tradeoff.md").write_text(render_tables(tables[1:]) + "\n")
    from infer.bench import plots

    plots.tradeoff_plot(classes, names, matrix, out_dir / "tradeoff.png")
    pngs = [{"title": "tradeoff matrix", "png": "tradeoff.png"}]
    for s in summaries:
        for name in ("heatmap", "fate", "latency", "timeline", "goodput"):
            pngs.append(
                {"title": f"{s['experiment']}: {name}", "png": f"{safe_name(s['experiment'])}/{name}.png"}
            )
    record = new_record(
        "traffic",
        command or f"infer bench traffic --config {config_path} --out {out_dir}",
        {"config": str(config_path), "out": str(out_dir), "only": only, "trace": trace},
        started=started.isoformat(),
        tables=tables,
        plots=pngs,
        details=[
            {
                "title": f"experiment {s['experiment']}: configuration",
                "values": {"url": s.get("url"), **s.get("config", {})},
            }
            for s in summaries
        ],
        traces=[
            {
                "title": f"experiment {s['experiment']}: per-request timeline",
                "path": f"{safe_name(s['experiment'])}/{TRACE_NAME}",
            }
            for s in summaries
            if (out_dir / safe_name(s["experiment"]) / TRACE_NAME).is_file()
        ],
        classes=classes,
        experiments=names,
        compliance=matrix,
    )
    write_record(out_dir / "tradeoff.json", record)
    print(f"\noutputs: {out_dir}", file=out)
    return {"summaries": summaries, **record}
