"""`infer bench report PATH [--trace FILE]`: one self-contained HTML file per benchmark run.

    infer bench report benchmarks/reports/serving-embedded-all-20261124-101500.json
    infer bench report benchmarks/reports            # the folder's newest report JSON
    infer bench report OUT/tradeoff.json             # a `bench traffic` run (its folder works too)
    infer bench report REPORT.json --trace engine.json   # + the request timeline of `infer serve --trace`

PATH is a record (infer.bench.record) that any bench command wrote: `bench serve`, `client`, `traffic`
(its tradeoff.json), `micro --json`, `race`, `stress`, `roofline --json`; or a folder (its newest record).
The page is drawn from the record alone, the same way for every command: its command, the tables it
printed and their notes, its plots (matplotlib PNGs, base64 in the page), configuration, server, machine
and versions, and the per-request timelines of the engine traces it names or of --trace FILE (a Gantt of
every request's queued / prefill chunks / decode / preempted slices, with the engine's counters). The HTML
goes beside the record, same stem. Nothing is loaded at view time: no script, no external stylesheet, no
font, so it opens offline and from an attachment. `bench serve`, `client`, `traffic`, `micro`, `race` and
`stress` write it at their end unless `--no-report`; `bench serve` and `bench client` also fetch the run's
trace from our server's `GET /debug/trace` when the server records one (`infer serve --trace FILE`),
saved beside as STEM.trace.json.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from infer.bench.record import read_record
from infer.bench.report import fmt
from infer.bench.request_timeline import (
    TIMELINE_HEADERS,
    counter_series,
    load_trace,
    request_timelines,
    timeline_rows,
)

MAX_TIMELINE_REQUESTS = 300  # more rows make an unreadable Gantt: the first ones are kept (and it says so)

CSS = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; margin-top: 1.6em; }
h3 { font-size: 1em; margin-bottom: 0.3em; }
table { border-collapse: collapse; margin: 0.4em 0 1em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
table.kv td { text-align: left; vertical-align: top; }
code, pre { font-family: monospace; font-size: 0.85em; background: #f6f6f6; }
pre { padding: 0.6em; overflow-x: auto; white-space: pre-wrap; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
.note { color: #666; font-size: 0.85em; }
"""


class Page:
    """The HTML body, built section by section; every text is escaped."""

    def __init__(self, title: str):
        self.title = title
        self.parts: list[str] = []
        self.num_images = 0

    def heading(self, text: str, level: int = 2) -> None:
        self.parts.append(f"<h{level}>{html.escape(text)}</h{level}>")

    def note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def pre(self, text: str) -> None:
        self.parts.append(f"<pre>{html.escape(text)}</pre>")

    def table(self, headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> None:
        """A table as render_table prints it: the same cells (fmt), the same title."""
        if title:
            self.heading(title.removeprefix("== "), 3)
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
        body = "".join(
            "<tr>"
            + "".join(f"<td>{html.escape(c if isinstance(c, str) else fmt(c))}</td>" for c in row)
            + "</tr>"
            for row in rows
        )
        self.parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")

    def key_values(self, values: dict) -> None:
        rows = "".join(
            f"<tr><td>{html.escape(str(k))}</td><td>{_value_html(v)}</td></tr>" for k, v in values.items()
        )
        self.parts.append(f'<table class="kv"><tbody>{rows}</tbody></table>')

    def image(self, png: bytes, alt: str) -> None:
        data = base64.b64encode(png).decode("ascii")
        self.parts.append(f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">')
        self.num_images += 1

    def plot(self, alt: str, draw: Callable[[Path], object]) -> object:
        """Run draw(path) (a function of infer.bench.plots) into a temporary PNG and embed it."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "plot.png"
            result = draw(path)
            self.image(path.read_bytes(), alt)
        return result

    def render(self) -> str:
        title = html.escape(self.title)
        return (
            f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{CSS}</style></head>\n<body>\n<h1>{title}</h1>\n"
            + "\n".join(self.parts)
            + "\n</body></html>\n"
        )


def _value_html(v) -> str:
    if isinstance(v, dict | list):
        return f"<code>{html.escape(json.dumps(v, default=str))}</code>"
    return html.escape(fmt(v) if isinstance(v, float) else str(v))


def _plots():
    """infer.bench.plots, or None without matplotlib (the `bench` extra): the page then says so."""
    try:
        from infer.bench import plots
    except ImportError:
        return None
    return plots


# ---- finding and reading a report --------------------------------------------------------------------


def find_report(path: Path) -> Path:
    """PATH itself, or a folder's report: tradeoff.json for a `bench traffic` folder, else its newest JSON
    that is a record (traces, `{"traceEvents": ...}`, and other JSON left out)."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"no report at {path}: give a report JSON or a folder of them")
    if (path / "tradeoff.json").is_file():
        return path / "tradeoff.json"
    for candidate in sorted(path.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            read_record(candidate)
        except ValueError:
            continue
        return candidate
    raise ValueError(f"no report JSON in {path} (of bench serve, client, micro, traffic, race or stress)")


# ---- the page: any record, the same way --------------------------------------------------------------


def _plot(page: Page, plots, record: dict, spec: dict, folder: Path) -> None:
    if "png" in spec:  # drawn by the run: embedded as it is
        png = folder / spec["png"]
        if png.is_file():
            page.image(png.read_bytes(), spec["title"])
        else:
            page.note(f"missing plot: {png}")
        return
    args = list(spec.get("args", []))
    if spec.get("requests_at"):
        from infer.bench.metrics import RequestRecord

        found = record
        for key in spec["requests_at"]:
            found = found[key]
        args.insert(0, [RequestRecord(**d) for d in found])
    page.plot(spec["title"], lambda p: getattr(plots, spec["plot"])(*args, p))


def build_html(
    record: dict, path: Path, trace_events: list[dict] | None = None, command: str | None = None
) -> str:
    folder = path.parent
    page = Page(f"infer bench {record['kind']}: {path.stem}")
    page.key_values({
        "command": command or record.get("command") or "(not recorded)",
        "started": record.get("started") or "(not recorded)",
        "report": str(path) if path.is_file() else "(no JSON written: the run gave no --json FILE)",
        "written": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    })  # fmt: skip
    if record["tables"]:
        page.heading("Tables")
    for t in record["tables"]:
        page.table(t["headers"], t["rows"], t.get("title"))
    for line in record["notes"]:
        page.note(line)
    if "data" in record:  # an older file: its data as it was written
        page.pre(json.dumps(record["data"], indent=1, default=str)[:200_000])
    if record["plots"]:
        plots = _plots()
        page.heading("Plots")
        drawn = [spec for spec in record["plots"] if "png" in spec or plots is not None]
        if len(drawn) < len(record["plots"]):
            page.note("some plots are missing: matplotlib is not installed (pip install 'infer[bench]')")
        for spec in drawn:
            _plot(page, plots, record, spec, folder)
    for block in record["details"]:
        page.heading(block["title"], 3)
        page.key_values(block["values"])
    for trace in record["traces"]:
        trace_path = folder / trace["path"]
        if trace_path.is_file():
            timeline_section(page, load_trace(trace_path), trace["title"])
    if trace_events is not None:
        timeline_section(page, trace_events)
    page.heading("Configuration")
    page.key_values(record["config"] or {})
    if isinstance(record.get("server"), dict):
        page.heading("Server")
        page.key_values(record["server"])
    machine = record.get("machine")
    if isinstance(machine, dict):
        page.heading("Machine and versions")
        versions = machine.get("versions")
        page.key_values({k: v for k, v in machine.items() if k != "versions"})
        if isinstance(versions, dict):
            page.key_values(versions)
    return page.render()


TIMELINE_TITLE = "Per-request timeline (engine trace)"


def timeline_section(page: Page, events: list[dict], title: str = TIMELINE_TITLE) -> int:
    """The per-request Gantt, the counters and the per-request table; returns the Gantt's bar count."""
    page.heading(title)
    timelines = request_timelines(events)
    if not timelines:
        page.note("the trace holds no request slices")
        return 0
    shown = timelines[:MAX_TIMELINE_REQUESTS]
    if len(shown) < len(timelines):
        page.note(f"the first {len(shown)} of {len(timelines)} requests (by arrival)")
    plots = _plots()
    num_bars = 0
    if plots is None:
        page.note("no Gantt: matplotlib is not installed (pip install 'infer[bench]')")
    else:
        num_bars = page.plot(
            "request fate: queued / prefill / decode per request", lambda p: plots.request_gantt(shown, p)
        )
        series = counter_series(events)
        if series:
            page.plot("engine counters", lambda p: plots.trace_counters(series, p))
    page.table(TIMELINE_HEADERS, timeline_rows(shown), "requests in the trace (ms since the trace began)")
    return num_bars


def fetch_trace(base_url: str, seconds: float, api_key: str | None = None) -> list[dict] | None:
    """The last `seconds` of our server's engine trace (GET /debug/trace), or None when it records none."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(
            base_url.rstrip("/") + "/debug/trace",
            params={"seconds": max(1.0, seconds)},
            headers=headers,
            timeout=30,
        )
        return resp.json()["traceEvents"] if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def write_html(
    path: Path,
    report: dict | None = None,
    trace: Path | list[dict] | None = None,
    command: str | None = None,
    out=None,
) -> Path:
    """Write the HTML report of the report JSON at `path` (read unless `report` is given) beside it, with
    the timeline of `trace` (a trace file or its events) when given; say where on `out`."""
    path = Path(path)
    report = read_record(path) if report is None else report
    events = load_trace(trace) if isinstance(trace, str | Path) else trace
    html_path = path.with_suffix(".html")
    html_path.write_text(build_html(report, path, events, command))
    print(f"html report: {html_path}", file=sys.stdout if out is None else out)
    return html_path


def write_run_html(
    report_path: Path, report: dict, started: datetime.datetime, base_url: str, api_key: str | None, out
) -> Path:
    """The HTML report at the end of a run of `bench serve` / `bench client`: against our server, with its
    trace of the run (when it records one: `GET /debug/trace` for the seconds since `started`), also saved
    as STEM.trace.json."""
    events = None
    if report["server"]["is_infer"]:
        seconds = (datetime.datetime.now(datetime.UTC) - started).total_seconds()
        events = fetch_trace(base_url, seconds, api_key)
    if events is not None:
        trace_path = report_path.with_name(report_path.stem + ".trace.json")
        trace_path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        print(f"engine trace: {trace_path}", file=out)
    return write_html(report_path, report, events, out=out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=Path, help="a report JSON, or a folder (its newest report JSON)")
    p.add_argument("--trace", type=Path, default=None, help="the engine trace of `infer serve --trace FILE`")


def cmd_report(args: argparse.Namespace) -> int:
    try:
        write_html(find_report(args.path), trace=args.trace)
    except (ValueError, KeyError) as exc:
        print(f"bench report: error: {exc}", file=sys.stderr)
        return 1
    return 0
