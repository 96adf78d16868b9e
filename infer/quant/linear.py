"""Quantized linear layers: a swap of nn.Linear, done once at load (as gpt-fast does it).

Each QuantizedLinear repacks its `QuantizedWeight` for the fastest path this machine has, chosen once:

    "infer"   the C++ kernel (infer/kernels/quant_linear.cpp), bf16 models on an AVX-512 BF16 CPU, every
              step: x rounded to int8 per row (vpdpbusd, with VNNI; with AMX on the tiles), but for
              decodes of up to 4 rows of int4 codes (with AMX: one row), converted to bf16 in registers
              (vdpbf16ps), cheaper there than the codes' rearrangement for vpdpbusd (DECODE_ROWS).
              6-bit weights (GGUF's Q6_K, groups of 16) run through their own kernel
              (infer/kernels/six_bit_linear.cpp: int8 activations, vpdpbusd), CPUs with AVX-512 VNNI too.
    "torch"   torch's weight-only kernels (`_weight_int8pack_mm` for int8 per channel without zero points,
              `_weight_int4pack_mm_for_cpu` for int4 in groups of 32..256): other CPUs, float32 models.
    "avx2"    int8 codes in groups of a multiple of 16 inputs (GGUF's Q8_0 and Q5_0, and Q6_K as its int8
              codes) and int4 codes in groups of a multiple of 32 (Q4_0, Q4_1, Q4_K; ours), interleaved by
              8 output channels (infer/quant/interleaved.py), on a CPU with AVX2 but no AVX-512 BF16
              (infer/kernels/avx2_linear.cpp): steps of any size multiply the codes as int8 against
              activations rounded to int8 per block of 32 (vpmaddubsw, as llama.cpp's Q8_0 and Q4_0, for
              prompts too). INFER_INT8_ACTIVATIONS=0: steps of up to KERNEL_ROWS rows widen the codes to
              float32 in registers, wider ones multiply in float32 on the weight widened a slice at a
              time (widened_linear).
    "dequant" anything else (e.g. int8 in groups, on a CPU without AVX-512 BF16): the weight dequantized
              once into the model's dtype. Correct, but saves neither memory nor time: logged at load.

The measurements behind the choice are in docs/quantization.md.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from infer import kernels
from infer.config import QUANTIZATION_METHODS
from infer.layers.linear import MergedLinear, pack_pairs
from infer.layers.widened_linear import WIDEN_ROWS, widened_matmul, widens
from infer.quant.interleaved import (
    CHANNELS,
    deinterleave_codes,
    deinterleave_groups,
    interleave_codes,
    interleave_groups,
)
from infer.quant.split_linear import SplitQuantizedLinear
from infer.quant.weights import SUPER_BLOCK, QuantizedWeight, concat, quantize

logger = logging.getLogger("infer.quant")

GROUP_SIZE = 128  # int4's group: AWQ's and GPTQ's default, what torch's int4 kernel was tuned for
HEAD_BITS = 8  # the LM head, int8 per channel either way: int4 costs perplexity (docs/quantization.md)
# Steps of more than decode_rows(...) rows run with int8 activations (W8A8: rows rounded to 8 bits, each
# with its own scale; 2.6x the multiply-add rate of bf16 with VNNI); decodes of up to DECODE_ROWS rows
# keep bf16 activations, but for int8 codes with VNNI: converting those to bf16 in registers took longer
# than reading them (docs/quantization.md), where int4's conversion costs less than their rearrangement
# for vpdpbusd.
# With AMX tiles (the kernel's "+amx" builds) W8A8 runs on them, int8 weights at every row count and
# int4 from 2 rows: there the bf16-activation decodes (vdpbf16ps, slow on those cores) were compute-bound
# from 1-2 rows, and the tiles read int8 codes at the DRAM's speed (docs/quantization.md).
# INFER_INT8_ACTIVATIONS=0 keeps x as it is everywhere, bf16 or float32 (A/B comparisons, tests).
DECODE_ROWS = 4
INT8_ACTIVATIONS = os.environ.get("INFER_INT8_ACTIVATIONS", "1") != "0"
# Where the CPU has no bf16 arithmetic, torch's int8 kernel beats widening (infer.layers.widened_linear)
# up to about this many rows of a bf16 model, and loses by up to 2x at 512; torch's int4 kernel is not
# widened (its packed codes have no cheap slice).
TORCH_WIDEN_ROWS = 64
KERNEL_ROWS = 64  # INFER_INT8_ACTIVATIONS=0: steps of up to this many rows widen the codes in registers


class QuantizedLinear(nn.Module):
    """y = x @ W^T + b with W held as int8 or int4 codes (see module docstring for the paths)."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        output_sizes=None,
        backend: str | None = None,
    ):
        """`backend` None picks the fastest path (module docstring); naming one forces it (tests, A/B)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        if output_sizes is not None:
            self.output_sizes = list(output_sizes)  # the model splits a merged projection's output by them
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        supported = _backends(weight, dtype)
        if backend is not None and backend not in supported:
            raise ValueError(f"backend {backend!r} cannot run this weight here; these can: {supported}")
        self.backend = backend or supported[0]
        # bf16 where the CPU has no bf16 arithmetic: wide steps in float32 (infer.layers.widened_linear)
        self._widens = self.backend == "avx2" or (
            widens(dtype) and (self.backend == "dequant" or (self.backend, self.bits) == ("torch", 8))
        )
        pack = {
            "infer": self._pack_kernel,
            "avx2": self._pack_avx2,
            "torch": self._pack_torch,
            "dequant": self._pack_dequant,
        }
        pack[self.backend](weight, dtype)
        self.num_packed_params = self.in_features * self.out_features

    # ---- packing, once ----

    def _pack_kernel(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self._ops = kernels.bf16_ops()
        if w.bits == 6:
            codes, sub_scales, super_scales = pack_six_bit(w)
            self.register_buffer("qweight", codes, persistent=False)
            self.register_buffer("scales", sub_scales, persistent=False)
            self.register_buffer("super_scales", super_scales, persistent=False)
            return
        self._decode_rows = decode_rows(self._ops, w.bits, w.group_size)
        # symmetric int4 codes shift to 0..15 and store no offset: the kernel takes code 8 as zero
        offsets = w.offsets()
        q = w.q + 8 if w.bits == 4 and offsets is None else w.q
        self.register_buffer("qweight", pack_kernel(q, w.bits), persistent=False)
        # [groups, out], float16 (a range the kernel path checks for: _backends)
        self.register_buffer("scales", w.scales.t().to(torch.float16).contiguous(), persistent=False)
        offsets = None if offsets is None else offsets.t().to(torch.float16).contiguous()  # weight at code 0
        self.register_buffer("offsets", offsets, persistent=False)
        # int8 weights with int8 activations take back 128 x each group's sum of codes (kernel comment);
        # a sum of int8 codes fits int16 up to groups of 256
        groups = q.view(self.out_features, -1, w.group_size)
        qsums = None
        if w.bits == 8:
            qsums = groups.sum(-1, dtype=torch.int32).t().contiguous()
            qsums = qsums.to(torch.int16) if w.group_size <= 256 else qsums
        self.register_buffer("qsums", qsums, persistent=False)

    def _pack_torch(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        if w.bits == 8:
            self.register_buffer("qweight", w.q.contiguous(), persistent=False)
            self.register_buffer("scales", w.scales.view(-1).to(dtype), persistent=False)
            return
        q, offsets = _unsigned_int4(w)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # torch's int4 dequantization is (code - 8) * scale + zero: zero = our weight at code 8
        scales_and_zeros = torch.stack([w.scales, offsets + 8 * w.scales], -1)  # [out, groups, 2]
        self.register_buffer("qweight", packed, persistent=False)
        self.register_buffer(
            "scales", scales_and_zeros.transpose(0, 1).contiguous().to(dtype), persistent=False
        )

    def _pack_avx2(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self._ops = kernels.avx2_ops()
        q, offsets = _unsigned_int4(w) if w.bits == 4 else (w.q, w.offsets())  # int4: codes 0..15
        scales = w.scales
        # channels in whole blocks of 8: a vocabulary of 50,257 (GPT-2) gets channels of zero weight,
        # whose outputs the forward drops
        pad = -self.out_features % CHANNELS
        if pad:
            q, scales = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, scales))
            offsets = None if offsets is None else nn.functional.pad(offsets, (0, 0, 0, pad))
        self._padded = pad > 0
        self.register_buffer("qweight", interleave_codes(q, w.bits), persistent=False)
        # float16 where that holds them exactly (a Q8_0 or Q4_0 block's own scale); float32 where it
        # would round them (K-quants' scales and mins are products of two; ours)
        exact = all(t is None or torch.equal(t.half().float(), t) for t in (scales, offsets))
        held = torch.float16 if exact else torch.float32
        self.register_buffer("scales", interleave_groups(scales.to(held)), persistent=False)
        offsets = None if offsets is None else interleave_groups(offsets.to(held))
        self.register_buffer("offsets", offsets, persistent=False)

    def _pack_dequant(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self.register_buffer("weight", w.dequantize(dtype), persistent=False)

    # ---- the forward ----

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [num_tokens, in]
        if self.backend == "infer" and self.bits == 6:
            y = self._ops.six_bit_linear(
                flat.contiguous(), self.qweight, self.scales, self.super_scales, self.bias
            )
        elif self.backend == "infer":
            y = self._ops.quant_linear(
                flat.contiguous(),
                self.qweight,
                self.scales,
                self.offsets,
                self.bias,
                self.bits,
                self.group_size,
                self.qsums,
                INT8_ACTIVATIONS and flat.shape[0] > self._decode_rows,
            )
        elif self.backend == "avx2" and (INT8_ACTIVATIONS or flat.shape[0] <= KERNEL_ROWS):
            bias = None if self._padded else self.bias
            y = self._ops.avx2_linear(flat, self.qweight, self.scales, self.offsets, bias, INT8_ACTIVATIONS)
            if self._padded:
                y = y[:, : self.out_features].contiguous()
                y = y if self.bias is None else y + self.bias
        else:
            rows = flat.shape[0]
            if self._widens and rows > (TORCH_WIDEN_ROWS if self.backend == "torch" else WIDEN_ROWS):
                y = widened_matmul(flat, self.out_features, self._widened)
            elif self.backend == "dequant":
                y = nn.functional.linear(flat, self.weight)
            elif self.bits == 8:
                y = torch._weight_int8pack_mm(flat, self.qweight, self.scales)
            else:
                y = torch._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group_size, self.scales)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _widened(self, rows: slice) -> torch.Tensor:
        """Output channels `rows` of the weight in float32 (widened_matmul)."""
        if self.backend == "dequant":
            return self.weight[rows].float()
        if self.backend == "torch":
            return self.qweight[rows].float() * self.scales[rows, None].float()
        scales, offsets = self.scales, self.offsets
        if self.backend == "avx2":  # the whole blocks of 8 channels that hold `rows`, deinterleaved
            rows = slice(rows.start, min(rows.stop, self.out_features))  # not the padding channels
            first = rows.start // CHANNELS * CHANNELS
            blocks = slice(first, -(-rows.stop // CHANNELS) * CHANNELS)
            rows = slice(rows.start - first, rows.stop - first)
            codes = deinterleave_codes(self.qweight[blocks], self.bits)[rows]
            scales = deinterleave_groups(scales[blocks])
            offsets = None if offsets is None else deinterleave_groups(offsets[blocks])
        else:
            codes = self.qweight[rows]
        wide = codes.float().unflatten(1, (-1, self.group_size)) * scales[rows, :, None].float()
        if offsets is not None:
            wide += offsets[rows, :, None].float()
        return wide.flatten(1)

    def extra_repr(self) -> str:
        shape = f"{self.in_features} -> {self.out_features}"
        return f"{shape}, int{self.bits}, group {self.group_size}, {self.backend}"


@functools.cache
def decode_rows(ops, bits: int, group_size: int) -> int:
    """The most rows a step of the kernel takes with bf16 activations (above them, int8: see DECODE_ROWS)."""
    if "+amx" in ops.isa():
        return 0 if bits == 8 else 1
    return 0 if bits == 8 and "vnni" in ops.isa() else DECODE_ROWS


def _unsigned_int4(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 codes as both kernels store them, 0..15, and each group's weight at code 0: symmetric codes
    -8..7 shift to 0..15 with -8 * scale at code 0 (the same weights)."""
    if w.zeros is None and w.mins is None:
        return w.q + 8, -8 * w.scales
    return w.q, w.offsets()


def _backends(w: QuantizedWeight, dtype: torch.dtype) -> list[str]:
    """The paths that can run `w` with activations of `dtype`, fastest first."""
    out_features, in_features = w.shape
    found = []
    ops = kernels.bf16_ops() if dtype == torch.bfloat16 else None
    # avx2_linear: int8 codes (6-bit ones too, a byte each) and int4 ones, where the CPU has no AVX-512 BF16
    avx2 = (
        ["avx2"]
        if in_features % 32 == 0
        and w.group_size % (32 if w.bits == 4 else 16) == 0
        and dtype in (torch.bfloat16, torch.float32)
        and kernels.avx2_ops() is not None
        else []
    )
    if w.bits == 6:  # six_bit_linear.cpp, or dequantized
        six_bit_shape = out_features % 16 == 0 and in_features % SUPER_BLOCK == 0
        return (
            ["infer", "dequant"]
            if ops is not None and "+vnni" in ops.isa() and six_bit_shape
            else [*avx2, "dequant"]
        )
    kernel_shape = out_features % 16 == 0 and in_features % 32 == 0 and w.group_size % 32 == 0
    if kernel_shape and ops is not None and _fits_half(w):
        found.append("infer")
    found += avx2
    if w.bits == 8 and w.zeros is None and w.mins is None and w.group_size == in_features:
        found.append("torch")
    if w.bits == 4 and w.group_size in (32, 64, 128, 256):
        found.append("torch")
    return [*found, "dequant"]


def _fits_half(w: QuantizedWeight) -> bool:
    """Whether the kernel's float16 scales and offsets hold `w`'s (any weight a model has)."""
    offsets = w.offsets()
    return all(t is None or bool(t.abs().max() < 65504) for t in (w.scales, offsets))


def pack_kernel(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [out, in] -> the kernel's layout, oneDNN's for vdpbf16ps: blocks of 16 output channels,
    each block's input pairs in order, a pair's 16 channels side by side with their two inputs adjacent
    (a chunk: 32 codes = one bf16 vector once converted). int4: two chunks (pairs 2i and 2i + 1) share
    32 bytes, byte j holding code j of the first (low nibble) and of the second (high nibble): one
    mask, or one shift, unpacks a chunk in order."""
    out_features, in_features = q.shape
    chunks = pack_pairs(q).view(out_features // 16, in_features // 2, 32)  # [blocks, pairs, 16 x 2]
    if bits == 4:
        codes = chunks.to(torch.uint8).view(out_features // 16, in_features // 4, 2, 32)
        chunks = codes[:, :, 0] | (codes[:, :, 1] << 4)  # [blocks, pairs / 2, 32 bytes]
    return chunks.contiguous().view(out_features, -1)


def pack_six_bit(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """6-bit codes [out, in] (-32..31, groups of 16) -> (codes uint8 [out / 16, in / 16 x 192], the
    groups' int8 multiples of their super-scale [in / 16, out], super-scales float32 [in / 256, out]) in
    six_bit_linear.cpp's layout: per 16 channels and 16 inputs, quads of 4 inputs with channel c's codes
    in bytes 4c..4c+3; quads 0 and 1 as the low and high nibbles of 64 bytes, quads 2 and 3 of the next 64,
    then 64 bytes of the codes' top two bits (quad i at bits 2i, 2i + 1)."""
    out_features, in_features = w.shape
    codes = (w.q + 32).to(torch.uint8).view(out_features // 16, 16, in_features // 16, 4, 4)
    quads = codes.permute(0, 2, 3, 1, 4).reshape(out_features // 16, in_features // 16, 4, 64)
    low, top = quads & 0x0F, quads >> 4
    packed = torch.cat(
        [
            low[:, :, 0] | (low[:, :, 1] << 4),
            low[:, :, 2] | (low[:, :, 3] << 4),
            top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6),
        ],
        -1,
    )  # [out / 16, in / 16, 192]
    per_group = w.super_scales.repeat_interleave(SUPER_BLOCK // w.group_size, 1)
    # an fp16 d times an int8 is exact in float32, so the division gives the int8 back
    multiples = torch.where(per_group == 0, 0.0, w.scales / per_group).round().to(torch.int8)
    return (
        packed.reshape(out_features // 16, -1).contiguous(),
        multiples.t().contiguous(),
        w.super_scales.t().contiguous(),
    )


def quantize_model(model: nn.Module, method: str, group_size: int = GROUP_SIZE) -> dict:
    """Swap every nn.Linear of `model` for a QuantizedLinear of its weight, quantized here (round to
    nearest): int8 per output channel, or int4 in groups of `group_size` (see group_size_for); the LM head
    in int8 either way. A tied head gets its own codes (the embedding keeps its weight for lookups).
    Returns a summary for logs and /server_info."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
    if method == "none":
        return summarize(None, {})
    bits = 8 if method == "int8" else 4
    swapped = {}
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if type(child) not in (nn.Linear, MergedLinear):
                continue
            layer_bits = HEAD_BITS if name == "lm_head" else bits
            group = None if layer_bits == 8 else group_size_for(child.in_features, group_size)
            qweight = quantize(child.weight, layer_bits, group)
            new = QuantizedLinear(
                qweight, child.bias, child.weight.dtype, getattr(child, "output_sizes", None)
            )
            setattr(module, name, new)
            swapped[f"{path}.{name}" if path else name] = new
    return summarize(method, swapped)


def group_size_for(in_features: int, group_size: int) -> int:
    """group_size, or the largest of its halves down to 32 that divides the inputs (tiny test models),
    or one group per row."""
    while group_size >= 32:
        if in_features % group_size == 0:
            return group_size
        group_size //= 2
    return in_features


def quantized_bytes(out_features: int, in_features: int, bits: int, group_size: int = GROUP_SIZE) -> int:
    """Bytes of one linear's weight as quantize_model's kernel layers hold it, without quantizing it: the
    codes (two to a byte for int4), and per output channel (int8) or per group (int4) a float16 scale, and
    for int4 a float16 offset (the weight at code 0)."""
    groups = 1 if bits == 8 else in_features // group_size_for(in_features, group_size)
    per_group = 2 if bits == 8 else 4
    return out_features * (in_features * bits // 8 + groups * per_group)


def swap_quantized(net: nn.Module, pending: dict[str, Callable[..., QuantizedWeight]], packed: dict) -> dict:
    """The quantized linears of a pre-quantized checkpoint or GGUF file: `pending` maps each one's
    checkpoint prefix to a function of the (out, in) shape the model expects that returns its weight
    (unpacked and checked against that shape), `packed` maps a checkpoint projection to (fused module,
    shard). Joins the shards of fused projections (q/k/v, gate/up) and swaps the module for a
    QuantizedLinear. Returns {module path: QuantizedLinear}."""
    shards: dict[str, dict[int, QuantizedWeight]] = {}
    for prefix, unpack in pending.items():
        target, shard = linear_target(net, prefix, packed)
        module = net.get_submodule(target)
        out_features = module.out_features if shard is None else module.output_sizes[shard]
        shards.setdefault(target, {})[shard or 0] = unpack((out_features, module.in_features))
    swapped = {}
    for target, parts in shards.items():
        module = net.get_submodule(target)
        sizes = getattr(module, "output_sizes", None)
        if len(parts) != len(sizes or [0]):
            raise ValueError(
                f"{target}: only {len(parts)} of its {len(sizes)} fused projections are quantized"
            )
        try:
            new = fused_linear([parts[i] for i in range(len(parts))], module.bias, module.weight.dtype, sizes)
        except ValueError as e:
            raise ValueError(f"{target}: {e}") from None
        parent, _, child = target.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, child, new)
        swapped[target] = new
    return swapped


def _scheme(weight: QuantizedWeight) -> tuple:
    """What weights must share to be one QuantizedLinear (infer.quant.weights.concat)."""
    return weight.bits, weight.group_size, weight.zeros is None, weight.mins is None


def fused_linear(
    parts: list[QuantizedWeight], bias: torch.Tensor | None, dtype: torch.dtype, output_sizes=None
) -> QuantizedLinear | SplitQuantizedLinear:
    """The layer of a projection's quantized parts in output order (q, k, v): one QuantizedLinear when
    they share a scheme, else a SplitQuantizedLinear of one per run of parts that do (a GGUF file's Q4_K q
    and k, int4, beside a Q6_K v, int8), each part's codes as compact as its own scheme allows."""
    runs: list[list[QuantizedWeight]] = []
    for part in parts:
        if runs and _scheme(runs[-1][-1]) == _scheme(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    if len(runs) == 1:
        return QuantizedLinear(concat(parts), bias, dtype, output_sizes)
    if bias is not None:
        raise ValueError("fused projections of different quantization schemes cannot share a bias")
    return SplitQuantizedLinear([QuantizedLinear(concat(run), None, dtype) for run in runs], output_sizes)


def linear_target(net: nn.Module, prefix: str, packed: dict) -> tuple[str, int | None]:
    """(module path, shard) of the linear a checkpoint's `prefix` loads into: q_proj -> (qkv_proj, 0),
    o_proj -> (o_proj, None)."""
    probe = torch.empty(0)
    remapped = net.remap_weight(f"{prefix}.weight", probe)
    if remapped is None or remapped[1] is not probe:
        raise ValueError(f"{prefix}: quantized weights are not supported for {net.config.architecture}")
    module_path = remapped[0].removesuffix(".weight")
    parent, _, child = module_path.rpartition(".")
    target, shard = (
        (f"{parent}.{packed[child][0]}" if parent else packed[child][0], packed[child][1])
        if (child in packed)
        else (module_path, None)
    )
    try:
        net.get_submodule(target)
    except AttributeError:
        raise ValueError(f"{prefix}: quantized weights for a layer the model does not have") from None
    return target, shard


def summarize(method, swapped: dict[str, QuantizedLinear | SplitQuantizedLinear]) -> dict:
    """What was quantized, for the start-up log and /server_info. `method`: ours (int8/int4), a
    checkpoint's CheckpointQuant, or None."""
    backends: dict[str, int] = {}
    for layer in swapped.values():  # a SplitQuantizedLinear counts once, by its slowest part's path
        backends[layer.backend] = backends.get(layer.backend, 0) + 1
    body = [layer for name, layer in swapped.items() if not name.endswith("lm_head")]
    head = next((layer for name, layer in swapped.items() if name.endswith("lm_head")), None)
    if "dequant" in backends:
        logger.warning("%d layers have no quantized kernel here: dequantized at load", backends["dequant"])
    name = method if isinstance(method, str) or method is None else f"{method.method} ({method.format})"
    return {
        "method": name or "none",
        "layers": len(swapped),
        "bits": body[0].bits if body else None,
        "group_size": body[0].group_size if body else None,
        "lm_head": f"int{head.bits}" if head else None,
        "backends": backends,
    }
