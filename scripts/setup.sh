#!/usr/bin/env bash
# Create .venv and install infer with its test tools. torch goes first, pinned to the CPU build:
# a looser requirement on a machine without torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
# Build the C++ kernels (infer/kernels, ~10 s) now rather than at the first server start. A failure only
# logs a warning: infer then runs its Python path.
.venv/bin/python -c "from infer import kernels; ops = kernels.load(); print('infer kernels:', ops.isa() if ops else 'off')"
