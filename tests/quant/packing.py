"""Reference packers (QuantizedWeight -> a checkpoint's tensors) and a writer of tiny quantized checkpoints.

The packers are the inverse of infer/quant/formats.py written from the other side: each transcribes the
packing code of the project that defines the format, loop for loop where that is cheap, so a mistake in
the unpacker is not mirrored here:
    AWQ        casper-hansen/AutoAWQ  awq/modules/linear/gemm.py  WQLinear_GEMM.from_linear
    GPTQ       AutoGPTQ/AutoGPTQ      auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py  QuantLinear.pack
               ModelCloud/GPTQModel   gptqmodel/utils/model.py  convert_gptq_v2_to_v1_format_module
    compressed neuralmagic/compressed-tensors  compressors/quantized_compressors/pack_quantized.py
      -tensors                                 pack_to_int32, PackedQuantizationCompressor.compress_weight
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch

from infer.quant.weights import QuantizedWeight, quantize

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------------- codes helpers


def unsigned_codes(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, zeros) as AWQ/GPTQ store them: 0 .. 2^bits - 1, symmetric zero at 2^(bits-1)."""
    mid = 1 << (w.bits - 1)
    if w.zeros is None:
        return w.q.int() + mid, torch.full(w.scales.shape, mid, dtype=torch.int32)
    shift = 128 if w.bits == 8 else 0  # weights.py keeps 8-bit asymmetric codes minus 128
    return w.q.int() + shift, w.zeros.int() + shift


def signed_codes(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes, zero points) as compressed-tensors quantizes them: both in -2^(bits-1) .. 2^(bits-1) - 1."""
    if w.zeros is None:
        return w.q.clone(), None
    q, z = unsigned_codes(w)
    mid = 1 << (w.bits - 1)
    return (q - mid).to(torch.int8), (z - mid).to(torch.int8)


def _grouped(weight: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, int]:
    out_features, in_features = weight.shape
    group_size = group_size or in_features
    return weight.detach().float().view(out_features, -1, group_size), group_size


def quantize_symmetric(
    weight: torch.Tensor, bits: int, group_size: int | None, scale_dtype: torch.dtype = torch.float32
) -> QuantizedWeight:
    """Round-to-nearest symmetric codes over the full signed range (GPTQ sym, compressed-tensors).

    The codes are rounded against the scales as the checkpoint will store them (AutoAWQ and AutoGPTQ
    likewise divide by their fp16 scales), so each weight stays within half a step of the original.
    """
    w, group_size = _grouped(weight, group_size)
    qmax = (1 << (bits - 1)) - 1
    scales = (w.abs().amax(-1) / qmax).clamp(min=1e-6).to(scale_dtype).float()
    q = torch.round(w / scales[..., None]).clamp(-qmax - 1, qmax).to(torch.int8)
    return QuantizedWeight(q.view(weight.shape), scales, None, bits, group_size)


def quantize_asymmetric(
    weight: torch.Tensor, bits: int, group_size: int | None, scale_dtype: torch.dtype = torch.float32
) -> QuantizedWeight:
    """Min-max codes 0 .. 2^bits - 1 with an integer zero point; 8-bit stored (as weights.py must) - 128.

    4-bit takes its scales and zeros from infer.quant.weights.quantize.
    """
    w, group_size = _grouped(weight, group_size)
    qmax = (1 << bits) - 1
    if bits == 4:
        ref = quantize(weight, 4, group_size)
        scales, zeros = ref.scales, ref.zeros
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((hi - lo) / qmax).clamp(min=1e-6)
        zeros = torch.round(-lo / scales).clamp(0, qmax)
    scales = scales.to(scale_dtype).float()
    q = (torch.round(w / scales[..., None]) + zeros[..., None]).clamp(0, qmax)
    shift = 128 if bits == 8 else 0
    q = (q - shift).to(torch.int8).view(weight.shape)
    return QuantizedWeight(q, scales, zeros - shift, bits, group_size)


def quantize_with_mins(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    """4-bit codes 0..15 from each group's min with a float min, not an integer zero (llama.cpp's Q4_1):
    weight = q * scale + min."""
    w, group_size = _grouped(weight, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-6)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int8)
    return QuantizedWeight(q.view(weight.shape), scales, None, 4, group_size, mins=lo.contiguous())


def quantize_for(
    weight: torch.Tensor,
    bits: int,
    group_size: int | None,
    symmetric: bool | str,
    scale_dtype: torch.dtype = torch.float32,
) -> QuantizedWeight:
    """symmetric: True (no zero point), False (integer zero points) or "mins" (quantize_with_mins)."""
    if symmetric == "mins":
        return quantize_with_mins(weight, group_size)
    if symmetric:
        return quantize_symmetric(weight, bits, group_size, scale_dtype)
    return quantize_asymmetric(weight, bits, group_size, scale_dtype)


def random_quantized(
    out_features: int, in_features: int, bits: int, group_size: int | None, symmetric: bool, seed: int = 0
) -> QuantizedWeight:
    """Codes and zeros over their whole range (0 and 2^bits - 1 included), scales exact in fp16 and bf16."""
    gen = torch.Generator().manual_seed(seed)
    group_size = group_size or in_features
    groups = (out_features, in_features // group_size)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    if not symmetric and bits == 4:
        lo, hi = 0, 16
    q = torch.randint(lo, hi, (out_features, in_features), generator=gen, dtype=torch.int8)
    zeros = None if symmetric else torch.randint(lo, hi, groups, generator=gen).float()
    if zeros is not None:  # make sure the extreme zero points, the ones that overflow, appear
        zeros.view(-1)[:2] = torch.tensor([lo, hi - 1], dtype=torch.float32)
    scales = torch.randint(1, 256, groups, generator=gen).float() / 4096  # 8 significant bits: exact in bf16
    return QuantizedWeight(q, scales, zeros, bits, group_size)


# ------------------------------------------------------------------------------------------- packers


def pack_awq(w: QuantizedWeight, scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """AutoAWQ WQLinear_GEMM.from_linear, from its integer codes on."""
    assert w.bits == 4 and w.zeros is not None, "AWQ GEMM is 4-bit with zero points"
    intweight, zeros = unsigned_codes(w)
    intweight = intweight.t().contiguous().to(torch.int32)  # [in, out]
    zeros = zeros.t().contiguous().to(torch.int32)  # [groups, out]
    pack_num = 32 // w.bits
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    # AutoAWQ sizes these `shape // 32 * w_bit`, the same whenever the size is a multiple of 32 (real
    # models); written `shape // pack_num` here so that the tests' smaller shapes pack too
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // pack_num), dtype=torch.int32)
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight_col = intweight[:, col * pack_num + order_map[i]]
            qweight[:, col] |= qweight_col << (i * w.bits)
    qzeros = torch.zeros((zeros.shape[0], zeros.shape[1] // pack_num), dtype=torch.int32)
    for col in range(zeros.shape[1] // pack_num):
        for i in range(pack_num):
            qzero_col = zeros[:, col * pack_num + order_map[i]]
            qzeros[:, col] |= qzero_col << (i * w.bits)
    return {"qweight": qweight, "qzeros": qzeros, "scales": w.scales.t().contiguous().to(scale_dtype)}


def pack_gptq(
    w: QuantizedWeight,
    checkpoint_format: str = "gptq",
    scale_dtype: torch.dtype = torch.float16,
    g_idx: bool = True,
) -> dict[str, torch.Tensor]:
    """AutoGPTQ QuantLinear.pack (2/4/8-bit branch) for the v2 words; v1 = GPTQModel's v2 -> v1 export."""
    bits = w.bits
    intweight, zeros = unsigned_codes(w)
    intweight = intweight.t().contiguous().numpy().astype(np.uint32)  # [in, out]
    i = 0
    row = 0
    pack_num = 32 // bits  # AutoGPTQ writes `shape // 32 * bits`: equal for multiples of 32 (see pack_awq)
    qweight = np.zeros((intweight.shape[0] // pack_num, intweight.shape[1]), dtype=np.uint32)
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    zeros = zeros.t().contiguous().numpy().astype(np.uint32)  # [groups, out]
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // pack_num), dtype=np.uint32)
    i = 0
    col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    if checkpoint_format == "gptq":  # GPTQModel: module.qzeros.data -= 0b0001...0001 on whole words
        qzeros -= np.uint32(sum(1 << (bits * k) for k in range(32 // bits)))  # wraps like int32 does
    out = {
        "qweight": torch.from_numpy(qweight.astype(np.int32)),
        "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
        "scales": w.scales.t().contiguous().to(scale_dtype),
    }
    if g_idx:
        in_features = w.shape[1]
        out["g_idx"] = torch.tensor([k // w.group_size for k in range(in_features)], dtype=torch.int32)
    return out


def pack_to_int32(value: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors pack_to_int32, as released."""
    assert value.dtype is torch.int8
    offset = 1 << (num_bits - 1)
    value = (value + offset).to(torch.uint8)
    pack_factor = 32 // num_bits
    if packed_dim == 0:
        value = value.transpose(0, 1)
    rows, cols = value.shape
    padded_cols = math.ceil(cols / pack_factor) * pack_factor
    pad_len = padded_cols - cols
    if pad_len > 0:
        value = torch.nn.functional.pad(value, (0, pad_len))
    num_groups = padded_cols // pack_factor
    reshaped = value.view(rows, num_groups, pack_factor).to(torch.int32)
    bit_shifts = torch.arange(pack_factor, dtype=torch.int32) * num_bits
    packed = (reshaped << bit_shifts).sum(dim=2, dtype=torch.int32)
    if packed_dim == 0:
        packed = packed.transpose(0, 1)
    return packed


def pack_compressed_tensors(
    w: QuantizedWeight, fmt: str = "pack-quantized", scale_dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """PackedQuantizationCompressor.compress_weight / NaiveQuantizationCompressor, from the int8 codes on."""
    q, zp = signed_codes(w)
    out = {"weight_scale": w.scales.to(scale_dtype)}
    if fmt == "pack-quantized":
        out["weight_packed"] = pack_to_int32(q, w.bits)
        out["weight_shape"] = torch.tensor(w.q.shape)  # int64, as torch.tensor(weight.shape) makes it
        if zp is not None:  # group / channel asymmetric zero points are packed along the output dim
            out["weight_zero_point"] = pack_to_int32(zp, w.bits, packed_dim=0).contiguous()
    else:
        out["weight"] = q
        if zp is not None:
            out["weight_zero_point"] = zp
    return out


# ------------------------------------------------------------------------------------------- configs


def quantization_config(
    method: str,
    bits: int,
    group_size: int | None,
    symmetric: bool,
    checkpoint_format: str = "gptq",
    ct_format: str = "pack-quantized",
    ignore: tuple[str, ...] = ("lm_head",),
) -> dict:
    """The quantization_config each project's tooling writes into config.json."""
    gs = -1 if group_size is None else group_size
    if method == "awq":  # AutoAWQ AwqConfig.to_transformers_dict
        assert bits == 4 and not symmetric
        return {
            "quant_method": "awq",
            "zero_point": True,
            "group_size": gs,
            "bits": 4,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    if method == "gptq":  # transformers GPTQConfig / GPTQModel QuantizeConfig.to_dict, trimmed
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": gs,
            "desc_act": False,
            "sym": symmetric,
            "true_sequential": True,
            "lm_head": False,
            "checkpoint_format": checkpoint_format,
            "format": checkpoint_format,
            "pack_dtype": "int32",
        }
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "channel" if group_size is None else "group",
        "group_size": group_size,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": ct_format,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": ct_format,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
        "sparsity_config": {},
    }


def pack(
    method: str, w: QuantizedWeight, checkpoint_format: str = "gptq", ct_format: str = "pack-quantized"
) -> dict[str, torch.Tensor]:
    if method == "awq":
        return pack_awq(w)
    if method == "gptq":
        return pack_gptq(w, checkpoint_format)
    return pack_compressed_tensors(w, ct_format)


def stored_scale_dtype(method: str) -> torch.dtype:
    return torch.bfloat16 if method == "compressed-tensors" else torch.float16


def write_quantized_checkpoint(
    src_dir: Path,
    dst_dir: Path,
    method: str,
    bits: int,
    group_size: int | None,
    symmetric: bool,
    checkpoint_format: str = "gptq",
    ct_format: str = "pack-quantized",
) -> dict[str, QuantizedWeight]:
    """Quantize every *_proj linear of an HF folder into `method`'s layout.

    Returns the QuantizedWeight each linear's tensors encode exactly, by linear prefix, so a test can
    compare what it loads against what was written.
    """
    from safetensors.torch import load_file, save_file

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    out, written = {}, {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in PROJECTIONS:
            out[name] = t
            continue
        w = quantize_for(t, bits, group_size, symmetric, stored_scale_dtype(method))
        written[prefix] = w
        for leaf_name, packed in pack(method, w, checkpoint_format, ct_format).items():
            out[f"{prefix}.{leaf_name}"] = packed.contiguous()
    save_file(out, str(dst_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(
        method, bits, group_size, symmetric, checkpoint_format, ct_format
    )
    (dst_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in src_dir.iterdir():  # tokenizer and generation files
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model.safetensors"):
            shutil.copy(f, dst_dir / f.name)
    return written
