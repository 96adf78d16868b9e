"""The one form every quantized weight takes inside `infer`, whatever it was read from.

A checkpoint format (AWQ, GPTQ, compressed-tensors: infer/quant/formats.py) or our own quantizer
(`quantize`, for `--quantization int8|int4` on a bf16/fp32 checkpoint) produces a `QuantizedWeight`;
infer/quant/linear.py repacks it once into the layout of the kernel that will run it.

    weight[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]
    weight[n, k] = q[n, k] * scales[n, k // group_size] + mins[n, k // group_size]     (with mins)

    q       int8 [out, in]          integer codes: 0 .. 2^bits - 1 with zeros or mins, or signed
                                    -2^(bits-1) .. 2^(bits-1) - 1 without (symmetric)
    scales  float32 [out, in / group_size]
    zeros   float32 [out, in / group_size] of integers, or None (symmetric: zero is 0)
    mins    float32 [out, in / group_size], or None: the weight at code 0, any float (llama.cpp's
            Q4_1 stores it as such; -zero * scale would not reproduce it bit for bit)
    super_scales  float32 [out, in / 256], or None: 6-bit weights only (llama.cpp's Q6_K, groups of 16),
            the d of each 256 inputs, of which every group's scale is an int8 multiple (the kernel
            holds those int8 multiples, not the float32 scales)

Per output channel is the case group_size == in (one group per row). The kernels only ever see the
offset of each group, the weight at code 0: -zeros * scales, or mins (`offsets`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 6, 8)  # 6: only as read from GGUF's Q6_K (codes -32..31, groups of 16)
SUPER_BLOCK = 256  # inputs per super-scale of 6-bit weights


@dataclass
class QuantizedWeight:
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    mins: torch.Tensor | None = None
    super_scales: torch.Tensor | None = None

    def __post_init__(self):
        out_features, in_features = self.q.shape
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"{self.bits}-bit weights are not supported (only {SUPPORTED_BITS})")
        if self.group_size <= 0 or in_features % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide the input size {in_features}")
        groups = (out_features, in_features // self.group_size)
        if self.zeros is not None and self.mins is not None:
            raise ValueError("a weight has zero points or mins, not both")
        for name in ("scales", "zeros", "mins"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != groups:
                raise ValueError(f"{name}: expected shape {groups}, got {tuple(t.shape)}")
        if (self.bits == 6) != (self.super_scales is not None):
            raise ValueError("6-bit weights, and only they, have super-block scales")
        if self.super_scales is not None:
            if self.zeros is not None or self.mins is not None or self.group_size != 16:
                raise ValueError("6-bit weights are symmetric, in groups of 16")
            supers = (out_features, in_features // SUPER_BLOCK)
            if in_features % SUPER_BLOCK or tuple(self.super_scales.shape) != supers:
                raise ValueError(
                    f"super_scales: expected shape {supers}, got {tuple(self.super_scales.shape)}"
                )
        assert self.q.dtype == torch.int8 and self.scales.dtype == torch.float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight these codes stand for, [out, in], computed in float32."""
        out_features, in_features = self.q.shape
        codes = self.q.float().view(out_features, -1, self.group_size)  # [out, groups, group_size]
        if self.zeros is not None:
            codes = codes - self.zeros[..., None]
        weight = codes * self.scales[..., None]
        if self.mins is not None:
            weight = weight + self.mins[..., None]
        return weight.view(out_features, in_features).to(dtype)

    def offsets(self) -> torch.Tensor | None:
        """The weight at code 0 of each group, [out, groups]: -zeros * scales, mins, or None (symmetric)."""
        if self.mins is not None:
            return self.mins
        return None if self.zeros is None else -self.zeros * self.scales

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight with its output rows reordered (or selected) by `index`."""
        q, scales, zeros, mins, supers = (
            None if t is None else t[index].contiguous()
            for t in (self.q, self.scales, self.zeros, self.mins, self.super_scales)
        )
        return QuantizedWeight(q, scales, zeros, self.bits, self.group_size, mins, supers)


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along the output dimension (q/k/v into one merged projection)."""
    first = parts[0]

    def scheme(p: QuantizedWeight):
        return p.bits, p.group_size, p.zeros is None, p.mins is None

    if any(scheme(p) != scheme(first) for p in parts):
        raise ValueError("merged projections must share bits, group size and zero-point scheme")
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    supers = None if first.super_scales is None else torch.cat([p.super_scales for p in parts])
    return QuantizedWeight(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scales for p in parts]),
        zeros,
        first.bits,
        first.group_size,
        mins,
        supers,
    )


def quantize(weight: torch.Tensor, bits: int, group_size: int | None = None) -> QuantizedWeight:
    """Round-to-nearest weight-only quantization of a [out, in] matrix.

    int8: symmetric, one scale per output channel (group_size None = the whole row), codes -127..127.
    int4: asymmetric per group of `group_size` inputs (AWQ's and GPTQ's default scheme), codes 0..15 with
    an integer zero point, which keeps the group's min and max representable.
    """
    out_features, in_features = weight.shape
    group_size = group_size or in_features
    if in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the input size {in_features}")
    w = weight.detach().float().view(out_features, -1, group_size)  # [out, groups, group_size]
    if bits == 8:
        scales = (w.abs().amax(-1) / 127).clamp(min=1e-10)
        q = torch.round(w / scales[..., None]).clamp(-127, 127)
        zeros = None
    elif bits == 4:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-10)
        zeros = torch.round(-lo / scales).clamp(0, 15)
        q = (torch.round(w / scales[..., None]) + zeros[..., None]).clamp(0, 15)
    else:
        raise ValueError(f"{bits}-bit quantization is not supported (only 4 and 8)")
    q = q.to(torch.int8).view(out_features, in_features)
    return QuantizedWeight(q, scales.contiguous(), zeros, bits, group_size)
