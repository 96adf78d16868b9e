"""The record every `infer bench` command writes: one JSON shape, which `infer bench report` renders
without knowing which command wrote it.

    {"kind": "serving" | "client" | "traffic" | "micro" | "race" | "stress" | "roofline",
     "record_version": 2, "command": "infer bench ...", "started": ISO 8601 UTC,
     "config": {...}, "server": {...} or None, "machine": {...} (machine_info),
     "tables": [{"title", "headers", "rows"}],           what the command printed, cell for cell
     "notes": ["..."],                                   lines printed under the tables
     "plots": [{"title", "plot": NAME, "args": [...], "requests_at": [KEY, ...]}   a function of
              infer.bench.plots drawn at render time (requests_at: its first argument is the
              RequestRecords at that key path of the record), or {"title", "png": PATH} (drawn by the
              run, PATH relative to the record's folder),
     "details": [{"title", "values": {...}}],            more key-value blocks (a traffic experiment's)
     "traces": [{"title", "path"}],                      engine traces beside the record, for timelines
     ...the command's own data (workloads, phases, runs, benchmarks, ...)}

`write_record` is the one function that writes a record; `read_record` reads one, and upgrades the files
written before records said their kind (`upgrade`).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

RECORD_VERSION = 2
KINDS = ("serving", "client", "traffic", "micro", "race", "stress", "roofline")


def machine_info() -> dict:
    """Host, CPU, Python and package versions, so a result can be reproduced."""
    versions = {}
    for pkg in ("infer", "httpx", "numpy", "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "num_cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "versions": versions,
    }


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> dict:
    """A table as data: render_table prints it, the HTML report draws it."""
    return {"title": title, "headers": list(headers), "rows": [list(r) for r in rows]}


def new_record(
    kind: str,
    command: str,
    config: dict,
    *,
    started: str | None = None,
    server: dict | None = None,
    tables: Sequence[dict] = (),
    notes: Sequence[str] = (),
    plots: Sequence[dict] = (),
    details: Sequence[dict] = (),
    traces: Sequence[dict] = (),
    **data,
) -> dict:
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}; kinds are {', '.join(KINDS)}")
    return {
        "kind": kind,
        "record_version": RECORD_VERSION,
        "command": command,
        "started": started,
        "config": config,
        "server": server,
        "machine": machine_info(),
        "tables": list(tables),
        "notes": list(notes),
        "plots": list(plots),
        "details": list(details),
        "traces": list(traces),
        **data,
    }


def write_record(path: Path, record: dict, out=None) -> dict:
    """Write a record as JSON (its folder made as needed) and say where on `out`; the record gains its
    "path"."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    record["path"] = str(path)
    if out is not None:
        print(f"\nreport: {path}", file=out)
    return record


def read_record(path: Path) -> dict:
    """The record at `path`, upgraded if written before records said their kind. ValueError if it is
    not a record."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the report {path}: {exc}") from exc
    record = upgrade(doc) if isinstance(doc, dict) else None
    if record is None:
        raise ValueError(f"{path} is not a report of infer bench")
    return record


def upgrade(doc: dict) -> dict | None:
    """A record from an older file: `bench micro --json` wrote {"meta", "benchmarks"}, `bench traffic` a
    tradeoff.json without a kind, `bench roofline --json` {"shape", "roofline"}; those and the others'
    files of then kept no tables. The record keeps their data (the page shows it as JSON under a note);
    None if `doc` is none of these (a trace, other JSON)."""
    if doc.get("record_version") == RECORD_VERSION:
        return doc
    if "kind" in doc:
        kind = doc["kind"]
    elif "benchmarks" in doc and "meta" in doc:
        kind = "micro"
    elif "compliance" in doc and "experiments" in doc:
        kind = "traffic"
    elif "shape" in doc and "roofline" in doc:
        kind = "roofline"
    else:
        return None
    if kind not in KINDS:
        return None
    meta = doc.get("meta", {}) if kind == "micro" else doc
    config = meta if kind == "micro" else doc.get("config")
    return {
        **doc,
        "kind": kind,
        "record_version": RECORD_VERSION,
        "command": meta.get("command"),
        "started": meta.get("started"),
        "config": config if isinstance(config, dict) else {"config": config},
        "server": doc.get("server") or doc.get("servers"),
        "machine": meta.get("machine"),
        "tables": [],
        "notes": ["written before reports kept their tables: the data follows as JSON"],
        "plots": [],
        "details": [],
        "traces": [],
        "data": {k: v for k, v in doc.items() if k not in ("machine", "config", "command", "started")},
    }
