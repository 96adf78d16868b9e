#!/usr/bin/env bash
# Create .venv and install infer with its test tools. torch goes first, pinned to the CPU build:
# a looser requirement on a machine without torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
