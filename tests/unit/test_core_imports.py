"""The layering rule that keeps the core testable without a model: infer.core never imports torch."""

from __future__ import annotations

import subprocess
import sys


def test_core_never_imports_torch():
    # a fresh interpreter: in this one, other tests have imported torch already
    code = (
        "import pkgutil, importlib, sys, infer.core\n"
        "for m in pkgutil.iter_modules(infer.core.__path__):\n"
        "    importlib.import_module('infer.core.' + m.name)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
