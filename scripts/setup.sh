#!/usr/bin/env bash
# Create .venv and install infer with its test tools. torch goes first, pinned to the CPU build:
# a looser requirement on a machine without torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# tcmalloc, which `infer serve` preloads where installed (infer/server/tcmalloc.py: 7-15% more throughput);
# best effort: Debian/Ubuntu's package, as root.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } ||
    echo "libtcmalloc-minimal4 not installed: infer serve will use glibc's malloc"
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
# Build the C++ kernels (infer/kernels, ~10 s) now rather than at the first server start. A failure only
# logs a warning: infer then runs its Python path.
.venv/bin/python -c "from infer import kernels; ops = kernels.load(); print('infer kernels:', ops.isa() if ops else 'off')"
