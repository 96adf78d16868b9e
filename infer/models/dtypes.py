"""dtype names as they appear in config.json and on the command line."""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def to_torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, float32, bfloat16, float16") from None


def dtype_size(name: str | torch.dtype) -> int:
    return to_torch_dtype(name).itemsize
