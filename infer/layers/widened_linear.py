"""bf16 linear layers on a CPU without bf16 arithmetic (AVX2 alone: no AVX-512 BF16, no AMX).

There torch's bf16 matmul costs about one matrix-vector product per row: a step of many rows (a prompt,
a wide batch) is several times slower than the same matmul in float32. Where infer's kernels are built,
every step goes to avx2_linear (infer/kernels/avx2_linear.cpp), which widens the bf16 weight to float32 in
registers as it multiplies: a decode reads the weight's bytes, half a float32 copy's, and a prompt
multiplies faster than torch's float32 GEMM would over a widened copy. Its weight is a copy in
pack_pairs' layout, padded to 16 output channels, in place of the nn.Linear's (a tied head gets its own:
the embedding keeps its weight for lookups). A row's outputs do not depend on the rows beside it.

Without the kernels, a step of more than WIDEN_ROWS rows multiplies in float32, on the weight widened one
slice of output channels at a time (about WIDEN_SLICE_ELEMENTS weights, which stay in cache: widening the
whole weight would allocate and fault in a float32 copy every call), rounding the output to bf16 once;
smaller steps keep torch's bf16 path. Figures: docs/optimizations.md, "bf16 on a CPU without bf16
arithmetic".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infer import kernels
from infer.layers.linear import pack_pairs

WIDEN_ROWS = 8
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
    """A bf16 nn.Linear on a CPU without bf16 arithmetic (module docstring). With the kernels its weight
    is `kernel_weight` (a non-persistent buffer) and no parameter; without, the nn.Linear's own weight and
    bias (the same parameters: a tied head stays tied)."""

    def __init__(self, linear: nn.Linear, tied: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if hasattr(linear, "output_sizes"):  # a merged projection: the model splits its output by them
            self.output_sizes = list(linear.output_sizes)
        self._ops = kernels.avx2_ops() if self.in_features % 2 == 0 else None
        self.bias = linear.bias
        if self._ops is None:
            self.weight = linear.weight
            self.num_packed_params = 0
            return
        # weights no parameter of the model still counts (a tied head's are the embedding's)
        self.num_packed_params = 0 if tied else self.in_features * self.out_features
        pad = -self.out_features % 16  # the kernel's copy (and bias) padded to whole blocks of 16 channels
        bias = None if linear.bias is None or not pad else F.pad(linear.bias.detach(), (0, pad))
        weight = pack_pairs(F.pad(linear.weight.detach().to(torch.bfloat16), (0, 0, 0, pad)))
        self.register_buffer("kernel_weight", weight, persistent=False)
        self.register_buffer("kernel_bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self._ops is not None:
            bias = self.bias if self.kernel_bias is None else self.kernel_bias
            out = self._ops.avx2_linear(flat, self.kernel_weight, None, None, bias)
            if out.shape[1] != self.out_features:
                out = out[:, : self.out_features].contiguous()
            return out.view(*x.shape[:-1], self.out_features)
        if flat.shape[0] <= WIDEN_ROWS and x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, self.bias)  # float32 x (a float32 model's) takes the widened path
        out = widened_matmul(flat, self.out_features, lambda rows: self.weight[rows].float(), self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        path = "avx2_linear" if self._ops is not None else f"float32 GEMM above {WIDEN_ROWS} rows"
        return f"{shape}, {path}"


def widen_linears(model: nn.Module, tied_head: bool = False) -> int:
    """Replace every bf16 nn.Linear of `model` by a WidenedLinear; returns how many. `tied_head`: a
    float32 head tied to the embedding too (a bf16 checkpoint whose activations, embedding included,
    run in float32: its head's copy is the same bf16 values)."""
    others = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(False)}
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            tied = id(child.weight) in others
            if child.weight.dtype == torch.bfloat16 or (tied_head and tied):
                setattr(module, name, WidenedLinear(child, tied=tied))
                count += 1
    return count
