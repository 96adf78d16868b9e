#!/usr/bin/env bash
# Run a command as if this Intel CPU had no AMX tiles: the code paths of an AMD EPYC (Zen 4 / 5: AVX-512
# with BF16 and VNNI, no AMX), checked on a Sapphire Rapids. A check of those paths, not a figure for an
# AMD CPU: the cores, caches and memory stay this machine's, and vdpbf16ps here takes about twice an FMA's
# time (docs/optimizations.md), which makes the bf16 paths slower than on a Zen.
#
#   scripts/without_amx.sh COMMAND [ARGS...]
#   scripts/without_amx.sh .venv/bin/infer bench race MODEL --peer-cmd "vllm serve MODEL ..." ...
#
# Three things hide the tiles, for this process and every process it starts (a race's two servers):
# - torch.cpu._is_amx_tile_supported() answers False (a sitecustomize.py put first on PYTHONPATH): the
#   check infer's Python side routes by (kernels.cpu_has_amx: linears, budget, prefill) and vLLM's too;
# - ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16: oneDNN (torch's and vLLM's linears) on AVX-512 BF16 alone;
# - INFER_KERNELS_MARCH=cooperlake: infer's C++ kernels built without AMX (their own build directory).
# A --peer-env PYTHONPATH=... would replace the first for the peer: leave PYTHONPATH to this script.
set -euo pipefail
[ $# -gt 0 ] || { sed -n 2,8p "$0" >&2; exit 2; }
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
cat >"$site/sitecustomize.py" <<'EOF'
try:
    import torch
except ImportError:  # a Python without torch (a tool the command runs) has nothing to hide
    pass
else:
    torch.cpu._is_amx_tile_supported = lambda: False
EOF
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 INFER_KERNELS_MARCH=cooperlake "$@"
