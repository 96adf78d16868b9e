"""The README's Layout section names every module, script and benchmark that exists (the files of
server/tool_parsers/ and bench/micro/, one per format or benchmark, are named by their folder)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {".py", ".cpp", ".h", ".sh"}
NAMED_AS_FOLDERS = {"tool_parsers", "micro"}


def layout_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Layout\n")
    start = text.index("```\n", start) + 4
    return text[start : text.index("```", start)]


def test_the_layout_names_every_file():
    block = layout_block()
    unnamed = []
    for folder in ("infer", "scripts", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in SOURCES or path.name == "__init__.py" or "reports" in path.parts:
                continue
            if path.name not in block and path.parent.name not in NAMED_AS_FOLDERS:
                unnamed.append(str(path.relative_to(ROOT)))
    assert not unnamed, f"README's Layout does not name: {', '.join(unnamed)}"
