"""Tables in the layout the micro-benchmarks compare with, ratio formatting, verdict lines and the record."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from infer.bench import report


def render_table(headers: list[str], rows: list[list[str]]) -> str:
    """`a | b | c` under a `-+-` rule, columns padded to the widest cell."""
    return report.render_table(headers, rows, bars=True)


def cell(value, spec: str = "") -> str:
    """One table cell: ints as is, floats with `spec` (default 2 decimals), ratios with an x."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return str(value)
    if spec == "x":
        return "inf" if math.isinf(value) else f"{value:.2f}x"
    if spec == "%":
        return f"{100 * value:.1f}%"
    return f"{value:{spec or '.2f'}}"


def mode_table(rows: dict[str, dict], columns: list[tuple[str, str, str]], label: str = "method") -> str:
    """One row per mode. columns: (header, metrics key, format spec)."""
    headers = [label] + [c[0] for c in columns]
    body = [[name] + [cell(m[key], spec) for _, key, spec in columns] for name, m in rows.items()]
    return render_table(headers, body)


@dataclass
class Verdict:
    case: str
    passed: bool
    text: str  # the numbers and the targets they were held against

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'MISS'} {self.case}: {self.text}"


@dataclass
class CaseResult:
    name: str
    knobs: dict
    modes: dict[str, dict]  # mode -> best-of metrics
    ratios: dict[str, float]


@dataclass
class BenchResult:
    name: str
    cases: list[CaseResult]
    verdicts: list[Verdict]
    extra: dict  # sweeps and other tables

    def to_json(self) -> dict:
        return {
            "cases": [asdict(c) for c in self.cases],
            "verdicts": [asdict(v) | {"line": v.line()} for v in self.verdicts],
            **self.extra,
        }


def record(meta: dict, results: list[BenchResult]) -> dict:
    """The record of a run (infer.bench.record): its tables, per mode and as ratios, and its verdicts.
    "meta" and "benchmarks" keep the run's settings and every case as measured."""
    import torch

    from infer.bench.record import new_record

    benchmarks = _finite({r.name: r.to_json() for r in results})
    config = {k: v for k, v in meta.items() if k not in ("command", "started")}
    traces = []
    if meta.get("trace_dir"):  # `bench micro --trace DIR`: one trace per engine setting
        traces = [{"title": f"{t.name}: per-request timeline", "path": str(t.resolve())}
                  for t in sorted(Path(meta["trace_dir"]).glob("*.trace.json"))]  # fmt: skip
    doc = new_record(
        "micro",
        meta.get("command"),
        config,
        started=meta.get("started"),
        tables=[t for name, bench in benchmarks.items() for t in bench_tables(name, bench)],
        notes=[f"[{name}] {v['line']}" for name, bench in benchmarks.items() for v in bench["verdicts"]],
        traces=traces,
        benchmarks=benchmarks,
    )
    doc["machine"] |= {"threads": torch.get_num_threads()}
    doc["meta"] = meta | {"machine": doc["machine"]}
    return doc


def bench_tables(name: str, bench: dict) -> list[dict]:
    """One benchmark's cases (and sweep), per mode and as ratios."""
    from infer.bench.record import table

    def value(v, spec: str = "") -> str:
        return v if isinstance(v, str) else cell(v, spec)

    tables = []
    for label, cases in (("cases", bench["cases"]), *((k, v) for k, v in bench.items() if k == "sweep")):
        metrics = list(dict.fromkeys(k for c in cases for m in c["modes"].values() for k in m))
        rows = [
            [c["name"], mode, *(value(m.get(k)) for k in metrics)]
            for c in cases
            for mode, m in c["modes"].items()
        ]
        tables.append(table(["case", "mode", *metrics], rows, f"{name}: {label}, per mode"))
        knobs = list(dict.fromkeys(k for c in cases for k in c["knobs"]))
        ratios = list(dict.fromkeys(k for c in cases for k in c["ratios"]))
        rows = [
            [
                c["name"],
                *(value(c["knobs"].get(k)) for k in knobs),
                *(value(c["ratios"].get(k), "x") for k in ratios),
            ]
            for c in cases
        ]
        tables.append(table(["case", *knobs, *ratios], rows, f"{name}: {label}, ratios"))
    return tables


def _finite(value):
    """Strict JSON: an infinite ratio (a zero baseline) is written as the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
