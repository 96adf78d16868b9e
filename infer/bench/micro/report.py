"""Tables in the reference's layout, ratio formatting, verdict lines and the JSON report."""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path


def render_table(headers: list[str], rows: list[list[str]]) -> str:
    """The reference's plain-text table: `a | b | c`, a `-+-` rule, columns padded to the widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip()

    return "\n".join([line(headers), "-+-".join("-" * w for w in widths), *(line(r) for r in rows)])


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


def machine() -> dict:
    import os

    import torch

    return {
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def json_doc(meta: dict, results: list[BenchResult]) -> dict:
    """The JSON report's content (the HTML report is drawn from it too)."""
    doc = {"meta": meta | {"machine": machine()}, "benchmarks": {r.name: r.to_json() for r in results}}
    return _finite(doc)


def write_json(path: str, meta: dict, results: list[BenchResult]) -> None:
    Path(path).write_text(json.dumps(json_doc(meta, results), indent=2) + "\n")


def _finite(value):
    """Strict JSON: an infinite ratio (a zero baseline) is written as the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
