"""Normalisation layers shared by the model files (architecture quirks stay in the model files)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """HF Llama's RMSNorm: normalise in float32, scale by `weight` in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
