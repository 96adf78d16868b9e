"""bf16 linear layers on a CPU without bf16 arithmetic (AVX2 alone: no AVX-512 BF16, no AMX).

There torch's bf16 matmul costs about one matrix-vector product per row: a step of many rows (a prompt,
a wide batch) is several times slower than the same matmul in float32. A step of more than WIDEN_ROWS
rows therefore multiplies in float32, on the weight widened one slice of output channels at a time (about
WIDEN_SLICE_ELEMENTS weights, which stay in cache: widening the whole weight would allocate and fault in
a float32 copy every call), and rounds the output to bf16. Where infer's kernels are built, steps of
up to KERNEL_ROWS rows read the bf16 weight once, widening it in registers (infer/kernels/avx2_linear.cpp):
a decode is bound by the weight's bytes, half a float32 copy's; without them, steps of up to
WIDEN_ROWS keep torch's bf16 path. The model keeps bf16
weights (memory, and the bytes a decode reads). Figures: docs/optimizations.md, "bf16 on a CPU
without bf16 arithmetic".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infer import kernels

WIDEN_ROWS = 8
KERNEL_ROWS = 64
WIDEN_SLICE_ELEMENTS = 2**19


def widens(dtype: torch.dtype) -> bool:
    """bf16 where neither oneDNN nor the CPU does bf16 arithmetic (where linear.can_prepack is False)."""
    return dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def slice_rows(in_features: int) -> int:
    """Output channels a slice of WIDEN_SLICE_ELEMENTS weights holds: a multiple of 16, at least 16."""
    return max(16, WIDEN_SLICE_ELEMENTS // in_features // 16 * 16)


def widened_matmul(
    x: torch.Tensor,
    out_features: int,
    widened: Callable[[slice], torch.Tensor],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, in] @ W^T in float32, rounded once to x's dtype: `widened(rows)` gives the float32 weight
    of output channels `rows` (a bf16 slice widened, or quantized codes times their scales)."""
    wide = x.float()
    out = torch.empty(x.shape[0], out_features)
    step = slice_rows(x.shape[1])
    for start in range(0, out_features, step):
        rows = slice(start, start + step)
        torch.mm(wide, widened(rows).t(), out=out[:, rows])
    if bias is not None:
        out += bias
    return out.to(x.dtype)


class WidenedLinear(nn.Module):
    """An nn.Linear's own weight and bias (the same parameters: a tied head stays tied), multiplied in
    float32 above WIDEN_ROWS rows (module docstring)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        serves = self.in_features % 16 == 0 and linear.weight.is_contiguous()
        self._ops = kernels.avx2_ops() if serves else None
        if hasattr(linear, "output_sizes"):  # a merged projection: the model splits its output by them
            self.output_sizes = list(linear.output_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if self._ops is not None and rows <= KERNEL_ROWS:
            out = self._ops.avx2_linear(flat, self.weight, None, None, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if rows <= WIDEN_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = widened_matmul(flat, self.out_features, lambda rows: self.weight[rows].float(), self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        rows = WIDEN_ROWS if self._ops is None else KERNEL_ROWS
        return f"{shape}, float32 GEMM above {rows} rows"


def widen_linears(model: nn.Module) -> int:
    """Replace every bf16 nn.Linear of `model` by a WidenedLinear; returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
                setattr(module, name, WidenedLinear(child))
                count += 1
    return count
