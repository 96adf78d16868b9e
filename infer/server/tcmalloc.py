"""The server runs on tcmalloc where it is installed: `infer serve` re-executes itself with it preloaded.

vLLM's CPU docs recommend preloading tcmalloc (LD_PRELOAD) for the same reason: torch's CPU tensors,
oneDNN's scratch buffers and the tokenizer allocate and free in every step, and glibc's malloc is slower
at it: 7-15% more output throughput (docs/optimizations.md, "Memory: tcmalloc and huge pages", has the
race). glibc's own knobs (mallopt: no mmap or trim of freed memory) did not give it in-process, so this
is about the allocator, not page faults.

A library must be preloaded before the process starts, hence the re-exec (same PID, so a supervisor
or `ServerProcess` sees nothing); it happens before any model is loaded, costs ~0.3 s, and is skipped
when tcmalloc is absent (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`; scripts/setup.sh tries),
already preloaded, or turned off with INFER_TCMALLOC=0.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

NAMES = ("tcmalloc_minimal", "tcmalloc")


def preloaded() -> bool:
    return "tcmalloc" in os.environ.get("LD_PRELOAD", "")


def reexec_with_tcmalloc() -> None:
    """Replace this process by the same command with tcmalloc preloaded; returns only if it does not."""
    if sys.platform != "linux" or os.environ.get("INFER_TCMALLOC", "1") == "0" or preloaded():
        return
    library = next(filter(None, map(ctypes.util.find_library, NAMES)), None)
    if library is None:
        return
    preload = " ".join(filter(None, [library, os.environ.get("LD_PRELOAD", "")]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, "LD_PRELOAD": preload})


def loaded() -> bool:
    """Whether tcmalloc is mapped into this process (LD_PRELOAD names it even where it failed to load)."""
    try:
        with open("/proc/self/maps") as f:
            return any("tcmalloc" in line for line in f)
    except OSError:
        return False


def allocator() -> str:
    """For the start-up log."""
    if loaded():
        return "tcmalloc"
    return "glibc malloc (install tcmalloc for faster steps: see infer/server/tcmalloc.py)"
