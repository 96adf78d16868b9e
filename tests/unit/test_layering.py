"""ARCHITECTURE.md's "who may import what" table, checked against every import in infer/**.py.

Each file's imports of other infer packages (module level or inside a function: a lazy import is still
a dependency) must be allowed by its package's row, or by the row of the file itself where the table
names one file. Imports within a package are free. When this fails, either the import crosses a
boundary it should not (move the code), or the design changed: then change the table here and in
ARCHITECTURE.md together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

INFER = Path(__file__).resolve().parents[2] / "infer"

# package (or "package/file.py") -> the infer modules it may import; "core" allows infer.core and every
# module under it, "core.outputs" that module alone. A file's allowance adds to its package's.
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "sampling_params": {"structured_outputs.constraint"},
    # llguidance's grammars, compiled and matched; the engine's flags configure the compiler
    "structured_outputs": {"config"},
    "kernels": set(),
    "core": {"config", "sampling_params"},
    "layers": {"kernels"},
    "quant": {"layers.linear", "layers.widened_linear", "kernels", "config"},
    "models": {"layers", "quant", "kernels", "config"},
    "runner": {
        "core.outputs",
        "layers",
        "kernels",
        "models.config",
        "config",
        "sampling_params",
        "structured_outputs",
    },
    # a rank > 0 loads its own shard of the weights
    "runner/parallel.py": {"models.loader"},
    # harnesses that run a model directly through the paged cache: perplexity, a generation loop
    "eval": {"layers", "runner.kv_cache"},
    "engine": {
        "core",
        "runner",
        "models.loader",
        "models.gguf",
        "models.pooler_config",
        "models.st_dense",
        "layers.parallel",
        "config",
        "sampling_params",
        "structured_outputs",
    },
    "server": {"engine", "core.slo", "config", "sampling_params", "structured_outputs"},
    "deploy": {
        "server",
        "engine",
        "core.block_hash",
        "core.slo",
        "models.loader",
        "config",
        "sampling_params",
        "structured_outputs",
    },
    "bench": {"engine", "models", "core", "quant.linear", "config", "sampling_params"},
    # `infer serve` runs one engine (server) or `--replicas N` of them (deploy.app)
    "cli": {
        "bench.cli",
        "deploy.args",
        "deploy.app",
        "engine.llm",
        "models.presets",
        "server",
        "sampling_params",
    },
    "__main__": {"cli"},
    "__init__": set(),
}

# packages (or files) that never import torch at all, and those that may only import it inside a function;
# a request's constraint is carried by SamplingParams, which core reads
NO_TORCH = {"config", "sampling_params", "core", "engine", "structured_outputs/constraint.py"}
TORCH_ONLY_LAZILY = {"server", "deploy", "cli"}


def _package(path: Path) -> str:
    rel = path.relative_to(INFER)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import statement in the file."""
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from infer import kernels` imports infer.kernels; `from infer.x import y` imports infer.x
            names = [f"infer.{a.name}" for a in node.names] if node.module == "infer" else [node.module]
        else:
            continue
        found += [(name, node.lineno, id(node) in top) for name in names]
    return found


def _allowed(rel: str, package: str, target: str) -> bool:
    rules = ALLOWED[package] | ALLOWED.get(rel, set())
    return any(target == rule or target.startswith(rule + ".") for rule in rules)


def _files() -> list[Path]:
    return sorted(INFER.rglob("*.py"))


def test_every_package_has_a_row():
    packages = {_package(p) for p in _files()}
    assert packages <= ALLOWED.keys(), f"no row in ALLOWED for {sorted(packages - ALLOWED.keys())}"


def test_imports_between_packages_follow_the_table():
    violations = []
    for path in _files():
        package, rel = _package(path), str(path.relative_to(INFER))
        for name, line, _ in _imports(ast.parse(path.read_text(), str(path))):
            if not name.startswith("infer."):
                continue
            target = name.removeprefix("infer.")
            if target.split(".")[0] == package or _allowed(rel, package, target):
                continue
            violations.append(f"infer/{rel}:{line} imports infer.{target}")
    assert not violations, "imports the table does not allow:\n" + "\n".join(violations)


def test_torch_only_where_the_table_allows_it():
    violations = []
    for path in _files():
        package, rel = _package(path), str(path.relative_to(INFER))
        for name, line, top_level in _imports(ast.parse(path.read_text(), str(path))):
            if name.split(".")[0] != "torch":
                continue
            if package in NO_TORCH or rel in NO_TORCH or (package in TORCH_ONLY_LAZILY and top_level):
                violations.append(f"infer/{path.relative_to(INFER)}:{line} imports {name}")
    assert not violations, "torch imported where the table forbids it:\n" + "\n".join(violations)


@pytest.mark.parametrize(
    ("source", "rel", "expected"),
    [
        ("from infer.server.app import create_app\n", "engine/llm.py", ["infer/engine/llm.py:1"]),
        ("def f():\n    from infer import server\n", "core/x.py", ["infer/core/x.py:2"]),
        ("from infer.core.outputs import X\nfrom infer import kernels\n", "runner/x.py", []),
    ],
)
def test_a_forbidden_import_is_reported(source, rel, expected):
    # the check itself: an upward import is caught, also when lazy or spelled `from infer import x`
    package = rel.split("/")[0]
    found = [
        f"infer/{rel}:{line}"
        for name, line, _ in _imports(ast.parse(source))
        if name.startswith("infer.")
        and name.removeprefix("infer.").split(".")[0] != package
        and not _allowed(rel, package, name.removeprefix("infer."))
    ]
    assert found == expected
