"""C++ kernels, compiled on first use for the CPU of the machine that runs them, and the Python path
as the fallback.

`paged_attention.cpp`: attention of decodes (and small chunks) straight over the paged KV cache,
both cores working (see infer/layers/attention_kernels.py for where it is used and what it gained).
`prefill_attention.cpp`: flash attention of prompts and long chunks over the same cache, one call for
all of a step's (attention_kernels.py again); AVX-512 BF16 CPUs only, SDPA elsewhere.
`layer_ops.cpp`: RMSNorm (with the residual add), rotary in place, SiLU-and-multiply, one pass each
(infer/layers/norms.py, rotary.py, activations.py; `layer_ops(x)` says whether they serve a tensor).
`quant_linear.cpp`: int8 and int4 weights times bf16 activations, for quantized models
(infer/quant/linear.py); AVX-512 BF16 CPUs only (`isa()` has "+bf16"), torch's kernels elsewhere.
`six_bit_linear.cpp`: weights of 6-bit codes in sub-blocks of 16 (GGUF's Q6_K as the file holds it) times
bf16 activations rounded to int8 (infer/quant/linear.py); AVX-512 VNNI and BF16 CPUs only (`isa()` has
"+vnni"), the weight dequantized elsewhere.
`avx2_linear.cpp`: bf16 weights and int8 weights in groups (GGUF's Q8_0) at decode batches on CPUs
without AVX-512 BF16, widened to float32 in registers (infer/layers/widened_linear.py, infer/quant/linear.py).
`small_linear.cpp`: bf16 linears at decode batches, where oneDNN's cost per call dominates, and with AMX
tiles every step of large weights (infer/layers/linear.py); AVX-512 BF16 CPUs only, oneDNN elsewhere.
`hugepages.py` (Python): the memory those kernels stream (their weight copies, the KV cache) on 2 MiB
pages.

The build goes through `torch.utils.cpp_extension` (g++ and ninja, -O3 -march=native -fopenmp) into
`.build/kernels/<key>/` under the repository (~/.cache/infer/kernels when installed elsewhere), where
the key hashes the source, the flags, torch's and Python's versions and the CPU's ISA flags: a changed
source or another CPU builds anew, an unchanged one loads the cached library in milliseconds.
scripts/setup.sh builds it once, so that a server's first start doesn't pay the ~15 s.

`load()` returns None, after one logged warning, when the build fails or cannot run (no compiler, no
ninja): callers keep their Python path. INFER_NO_KERNELS=1 forces that fallback (A/B comparisons,
tests of both paths); INFER_KERNELS_MARCH=x86-64-v3 (say) builds for another ISA than the host's, and
any more words in it are more flags ("sapphirerapids -mno-amx-tile": that CPU without AMX's tiles).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger("infer.kernels")

NAME = "infer_kernels"
SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "paged_attention.cpp",
        "prefill_attention.cpp",
        "float_prefill_attention.cpp",
        "quant_linear.cpp",
        "small_linear.cpp",
        "six_bit_linear.cpp",
        "avx2_linear.cpp",
        "layer_ops.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(n)
    for n in ("vec.h", "paged_call.h", "amx.h", "fp8.h", "float_prefill_attention.h")
]
_REPO = Path(__file__).resolve().parents[2]

_state: dict = {}  # "ops": the loaded namespace or None, once load() has run
_lock = threading.Lock()


def build_root() -> Path:
    if (_REPO / "pyproject.toml").exists() and os.access(_REPO, os.W_OK):
        return _REPO / ".build" / "kernels"
    return Path.home() / ".cache" / "infer" / "kernels"


def _flags() -> list[str]:
    march, *more = os.environ.get("INFER_KERNELS_MARCH", "native").split() or ["native"]
    return ["-O3", f"-march={march}", *more, "-fopenmp", "-DNDEBUG"]


def _cpu_flags() -> str:
    """The host's ISA flags (what -march=native turns on), so that a build is never loaded on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build_dir() -> Path:
    key = hashlib.sha256()
    sources = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    for part in (*sources, " ".join(_flags()), torch.__version__, sys.version, _cpu_flags()):
        key.update(part if isinstance(part, bytes) else part.encode())
    return build_root() / key.hexdigest()[:16]


def load():
    """torch.ops.infer_kernels (paged_attention, prefill_attention, quant_linear, isa, the layer ops), or
    None: disabled or not built."""
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                _state["ops"] = _load()
    return _state["ops"]


def layer_ops(x: torch.Tensor):
    """The ops of layer_ops.cpp when they serve x (a CPU tensor of float32/bfloat16/float16, rows of a
    multiple of 16, no autograd), else None: the layers then run their torch reference."""
    if (
        x.dtype not in LAYER_OPS_DTYPES
        or x.device.type != "cpu"
        or x.shape[-1] % 16
        or torch.is_grad_enabled()
    ):
        return None
    return load()


LAYER_OPS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bf16_ops():
    """torch.ops.infer_kernels when this build has AVX-512 BF16 (`isa()` has "+bf16"): what
    quant_linear and small_linear need; else None (callers keep torch's or oneDNN's path)."""
    ops = load()
    return ops if ops is not None and "+bf16" in ops.isa() else None


def avx2_ops():
    """torch.ops.infer_kernels when this build has AVX2 and FMA but not AVX-512 BF16: what avx2_linear
    serves (bf16 and int8-in-groups weights at few rows, where torch has no fast path); else None."""
    ops = load()
    return ops if ops is not None and ops.isa() != "scalar" and "+bf16" not in ops.isa() else None


def cpu_has_amx() -> bool:
    """Intel's AMX tiles (Sapphire Rapids and later), which oneDNN uses for bf16 matmuls."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def _load():
    if os.environ.get("INFER_NO_KERNELS", "") not in ("", "0"):
        return None
    try:
        directory = build_dir()
        library = directory / f"{NAME}.so"
        failed = directory / "FAILED"
        if failed.exists():
            logger.warning("C++ kernels not built before (%s): using the Python path", failed)
            return None
        if not (directory / "READY").exists():
            _build_once(directory)
        torch.ops.load_library(str(library))
        return torch.ops.infer_kernels
    except Exception as exc:  # any failure leaves the Python path in place
        logger.warning("C++ kernels unavailable, using the Python path: %s", str(exc).strip()[-2000:])
        return None


def _build_once(directory: Path) -> None:
    """Build under an flock, which the OS releases when its holder dies: torch's own lock file stays
    behind when a build is killed (a server stopped during its first start), and torch would then wait
    on it forever. Holding the flock, no one else is building, so that file is stale and goes."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's build: wait for it, then use what it built
        if (directory / "READY").exists() or (directory / "FAILED").exists():
            return
        (directory / "lock").unlink(missing_ok=True)
        _build(directory)


def _build(directory: Path) -> None:
    """Compile and link into directory, then mark it READY; a failed build is marked FAILED with its
    log, so that later processes don't retry it."""
    from torch.utils import cpp_extension  # imports setuptools: only when building

    (directory.parent / ".gitignore").write_text("*\n")  # a cache, never committed
    if shutil.which("ninja") is None:  # the pip package's binary, when the venv's bin is not on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    logger.warning("building C++ kernels in %s (once per source and CPU, ~15 s)", directory)
    try:
        cpp_extension.load(
            name=NAME,
            sources=[str(p) for p in SOURCES],
            extra_cflags=_flags(),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(p.parent) for p in HEADERS],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:
        (directory / "FAILED").write_text(f"{exc}\n(delete this file to retry the build)\n")
        raise
    (directory / "READY").write_text("")
