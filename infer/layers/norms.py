"""Normalisation layers shared by the model files (architecture quirks stay in the model files).

RMSNorm runs as one C++ pass over its rows where infer/kernels serves the tensor (layer_ops.cpp), and as
the torch reference below elsewhere; both give Hugging Face's result (bit-equal in bfloat16, float32 up
to the order of the sum). `add` is vLLM's fused_add_rms_norm: the residual sum and the norm of it in
one pass, which is why the decoder layers carry the residual beside the hidden states. What the kernel
buys, alone and with rotary and SiLU-and-multiply in whole steps (`python benchmarks/bench_layer_ops.py`):
docs/optimizations.md, "C++ layer ops". INFER_NO_KERNELS=1 keeps the torch path.
"""

from __future__ import annotations

import torch
from torch import nn

from infer import kernels


class RMSNorm(nn.Module):
    """HF Llama's RMSNorm: normalise in float32, scale by `weight` in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = kernels.layer_ops(x)
        if ops is not None and self.weight.dtype == x.dtype and x.stride(-1) == 1:
            return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum rounded to the dtype first as `h + x` would be.
        Overwrites x and residual where the kernel serves them."""
        ops = kernels.layer_ops(x)
        same = self.weight.dtype == x.dtype == residual.dtype and x.dim() == 2
        if ops is not None and same and x.is_contiguous() and residual.is_contiguous():
            ops.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual
