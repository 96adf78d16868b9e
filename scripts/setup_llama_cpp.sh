#!/usr/bin/env bash
# llama.cpp's own tools, built from source, as the reference for infer's GGUF support
# (docs/quantization.md, docs/reproduce.md): llama-quantize makes the quantized files, llama-perplexity
# scores them beside `infer bench perplexity`, llama-server is the peer of `infer bench race`.
#
#   scripts/setup_llama_cpp.sh [JOBS]      # default 2; prints the folder holding the binaries
#
# The sources are the llama.cpp that llama-cpp-python's sdist on PyPI vendors, the same version whose
# converter scripts/fetch_llama_cpp.py fetches. Only the three tools are built: CPU only, Release, tuned
# for this CPU (GGML_NATIVE), no libcurl (files are given by path), statically linked so the binaries
# run from anywhere. They land outside the repo, in ~/.cache/infer/llama.cpp-build/<version>/bin
# ($INFER_LLAMA_CPP_BUILD moves it). Run again, it finds them and builds nothing. About 20 minutes on
# 2 cores; cmake and ninja come from pip when the system has none.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36 # llama-cpp-python's, as in scripts/fetch_llama_cpp.py
JOBS=${1:-2}
ROOT=${INFER_LLAMA_CPP_BUILD:-$HOME/.cache/infer/llama.cpp-build}/$VERSION
TOOLS=(llama-server llama-quantize llama-perplexity)

built() { for t in "${TOOLS[@]}"; do [ -x "$ROOT/bin/$t" ] || return 1; done; }
if built; then
  echo "$ROOT/bin"
  exit 0
fi

PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  "$PY" -m pip install -q cmake ninja
  PATH=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH
fi

mkdir -p "$ROOT"
SRC=$ROOT/src
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  tmp=$(mktemp -d "$ROOT/download.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
  tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp" "llama_cpp_python-$VERSION/vendor/llama.cpp"
  rm -f "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/.git" # a submodule's pointer, to a repo not here
  rm -rf "$SRC"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC" # whole or not at all
fi

cmake -S "$SRC" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$ROOT/build" --target "${TOOLS[@]}" -j "$JOBS"
mkdir -p "$ROOT/bin"
for t in "${TOOLS[@]}"; do cp "$ROOT/build/bin/$t" "$ROOT/bin/$t.tmp" && mv "$ROOT/bin/$t.tmp" "$ROOT/bin/$t"; done
built
echo "$ROOT/bin"
