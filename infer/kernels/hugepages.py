"""Tensors on transparent huge pages (2 MiB), for the memory every step streams: the packed weights of
the linears and the KV cache.

A decode step reads every weight once, front to back, from DRAM; with 4 KiB pages that is a TLB miss
every 4 KiB of each stream (a 1B model's page tables alone are ~5 MB), and the hardware prefetchers
stop at each 4 KiB page boundary. A 1B model's weight reads, the bound of its decode, are ~7% faster on
2 MiB pages; end to end a few percent (docs/optimizations.md, "Memory: tcmalloc and huge pages").

Linux gives huge pages to anonymous memory where /sys/kernel/mm/transparent_hugepage/enabled says
"always", or "madvise" and the range asked for them (madvise(MADV_HUGEPAGE)) before it was touched;
where it says "madvise" (this machine, Ubuntu's default) torch's allocations (malloc, tcmalloc) get
4 KiB pages. `empty` maps its own memory, asks for huge pages, and returns a tensor over it (the mapping
lives as long as the tensor's storage); `zeros` maps the same way and leaves every page untouched. Where
the kernel says "never" or has no THP the request is refused and `empty` gives torch.empty; so do
tensors under MIN_BYTES, platforms without madvise, and INFER_NO_HUGE_PAGES=1 (A/B comparisons).
"""

from __future__ import annotations

import functools
import mmap
import os

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE  # smaller tensors could not fill one huge page
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _kernel_allows() -> bool:
    """Linux with THP not set to "never", and madvise in Python (read once: a model asks per tensor)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_ENABLED) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def available() -> bool:
    """Whether `empty` maps memory for huge pages here (not whether the kernel will give them)."""
    return os.environ.get("INFER_NO_HUGE_PAGES", "") in ("", "0") and _kernel_allows()


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on huge pages where `available()` (else torch.empty)."""
    shape = torch.Size(shape)
    if shape.numel() * dtype.itemsize < MIN_BYTES or not available():
        return torch.empty(shape, dtype=dtype)
    return _mapped(shape, dtype, huge=True)


def zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor that costs nothing until it is written: a fresh anonymous mapping reads as
    zeros, and Linux gives each page (a huge one where `available()`) at its first write. A KV pool then
    holds memory as its blocks fill, and a model loads without first touching its whole pool (a 1 GiB
    pool's page faults were a large part of a load). Small tensors, and platforms without anonymous
    mappings, get torch.zeros."""
    shape = torch.Size(shape)
    if shape.numel() * dtype.itemsize < MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    return _mapped(shape, dtype, huge=available())


def _mapped(shape: torch.Size, dtype: torch.dtype, huge: bool) -> torch.Tensor:
    """A tensor over a mapping of its own (alive as long as the tensor's storage), asking for huge pages
    before anything touches it if `huge`."""
    nbytes = shape.numel() * dtype.itemsize
    # with huge pages, one of slack: the mapping's start is only 4 KiB-aligned, the tensor's 2 MiB-aligned
    size = (HUGE_PAGE if huge else 0) + -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        memory.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # holds `memory` until the storage is freed
    start = -raw.data_ptr() % HUGE_PAGE if huge else 0
    return raw[start : start + nbytes].view(dtype).view(shape)
