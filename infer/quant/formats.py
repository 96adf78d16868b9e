"""Pre-quantized Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors) read into `QuantizedWeight`s.

Each format packs the same thing, integer codes with per-group scales and zero points, in its own bit
order; this module turns one linear's tensors back into the plain codes of infer/quant/weights.py, so the
rest of `infer` never sees a checkpoint layout. The layouts follow each project's own packing code:

AWQ, GEMM version (casper-hansen/AutoAWQ, awq/modules/linear/gemm.py `WQLinear_GEMM.from_linear`,
awq/utils/packing_utils.py `unpack_awq` / `reverse_awq_order`):
    qweight int32 [in, out/8]         eight 4-bit codes per word along the output dim, nibble i holding
    qzeros  int32 [in/group, out/8]   output column 8*word + AWQ_ORDER[i], AWQ_ORDER = [0,2,4,6,1,3,5,7]
    scales  fp16  [in/group, out]     weight = (q - zero) * scale; always asymmetric (zero_point true)

GPTQ (AutoGPTQ/AutoGPTQ, auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py `QuantLinear.pack`;
ModelCloud/GPTQModel, gptqmodel/utils/model.py `convert_gptq_v1_to_v2_format_module`):
    qweight int32 [in*bits/32, out]   32/bits codes per word along the input dim, element j at bit bits*j
    qzeros  int32 [in/group, out*bits/32]  same order along the output dim
    scales  fp16  [in/group, out]
    g_idx   int32 [in]                group of each input column (act-order permutes it: refused)
    checkpoint_format "gptq" (v1) stores every zero point minus one. GPTQModel writes v1 from v2 by
    subtracting 0x11111111 (4-bit) / 0x01010101 (8-bit) from each whole int32 word, so a zero of 0
    borrows from the next field; adding the constant back word-wise, as GPTQModel does on load, is the
    exact inverse (and equals per-field +1 whenever no zero is 0). "gptq_v2" stores zeros as they are.
    Symmetric GPTQ still stores zeros, all 2^(bits-1).

compressed-tensors (neuralmagic/compressed-tensors, compressors/quantized_compressors/pack_quantized.py
`pack_to_int32` / `unpack_from_int32`, naive_quantized.py; quantization/quant_args.py for the config):
    pack-quantized: weight_packed int32 [out, ceil(in*bits/32)]: signed codes plus 2^(bits-1) (+8 for
        4-bit), element j of a word at bit bits*j, the last word zero-padded; weight_shape [2] = (out, in);
        weight_zero_point (asymmetric only) int32 [ceil(out*bits/32), groups], signed zero points packed
        the same way along the output dim (older releases stored them unpacked, int8 [out, groups]).
    int-quantized / naive-quantized: weight int8 [out, in] signed codes, weight_zero_point int8.
    weight_scale [out, groups] in the model's dtype; weight = (q - zero_point) * scale.

Codes come out as weights.py documents them: signed (-2^(bits-1) .. 2^(bits-1) - 1) with zeros None for a
symmetric checkpoint; unsigned 0..15 with integer zeros for asymmetric 4-bit. Asymmetric 8-bit codes
0..255 do not fit QuantizedWeight's int8, so both codes and zeros are stored minus 128: q - zero, and
so the weight, is unchanged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Container
from dataclasses import dataclass

import torch

from infer.quant.weights import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c is nibble AWQ_REVERSE_ORDER[c]

_METHODS = ("awq", "gptq", "compressed-tensors")
_GPTQ_FORMATS = ("gptq", "gptq_v2")
_CT_PACKED = "pack-quantized"
_CT_UNPACKED = ("int-quantized", "naive-quantized")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's `quantization_config` says about its quantized linears.

    group_size None means one group per output row (AWQ/GPTQ group_size -1, compressed-tensors "channel").
    format picks the layout within a method: "gemm" (AWQ), "gptq" = v1 or "gptq_v2" (GPTQ),
    "pack-quantized" / "int-quantized" / "naive-quantized" (compressed-tensors).
    ignore names modules kept unquantized: AWQ's modules_to_not_convert (substrings, as transformers
    matches them) or compressed-tensors' ignore (exact names or "re:" patterns, as compressed-tensors does).
    act_order: the config declares act-order (GPTQ desc_act, compressed-tensors actorder "group"); only a
    g_idx that leaves the groups in order is accepted, which unpack checks per linear.
    """

    method: str
    bits: int
    group_size: int | None
    symmetric: bool
    format: str
    ignore: tuple[str, ...] = ()
    act_order: bool = False


# ---------------------------------------------------------------------------------------------- config


def parse_quantization_config(config: dict) -> CheckpointQuant | None:
    """Read config.json's quantization_config, refusing up front what unpack could not honour.

    Refusing here, with the field's name, beats a shape error deep in loading: a checkpoint with
    activation quantization or an unknown layout would otherwise load codes we misread.
    """
    key = "quantization_config"
    qc = config.get(key)
    if qc is None and config.get("compression_config") is not None:
        key = "compression_config"  # the name early compressed-tensors checkpoints used
        qc = config[key]
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{key}: expected a JSON object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _parse_awq(qc, key)
    if method == "gptq":
        return _parse_gptq(qc, key)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc, key)
    raise ValueError(f"{key}.quant_method: {qc.get('quant_method')!r} is not supported (only {_METHODS})")


def _bits(value, field: str, allowed: tuple[int, ...]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        raise ValueError(f"{field}: {value!r}-bit weights are not supported (only {allowed})")
    return value


def _group_size(value, field: str) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and value != -1):
        raise ValueError(f"{field}: group size {value!r} is invalid (a positive integer, or -1 for per-row)")
    return None if value == -1 else value


def _bool(value, field: str, default: bool) -> bool:
    if value is None:  # GPTQModel may write null for an option left at its default
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{field}: expected true or false, got {value!r}")
    return value


def _parse_awq(qc: dict, key: str) -> CheckpointQuant:
    version = str(qc.get("version") or "gemm").lower()
    if version != "gemm":
        raise ValueError(
            f"{key}.version: AWQ version {qc.get('version')!r} is not supported (only 'gemm'; "
            "gemv, gemv_fast and marlin checkpoints pack their words differently)"
        )
    bits_field = "bits" if "bits" in qc else "w_bit"
    bits = _bits(qc.get(bits_field, 4), f"{key}.{bits_field}", (4,))
    gs_field = "group_size" if "group_size" in qc else "q_group_size"
    group_size = _group_size(qc.get(gs_field, 128), f"{key}.{gs_field}")
    if not _bool(qc.get("zero_point"), f"{key}.zero_point", True):
        raise ValueError(f"{key}.zero_point: false is not supported (AWQ GEMM checkpoints carry zero points)")
    ignore = qc.get("modules_to_not_convert") or ()
    return CheckpointQuant("awq", bits, group_size, False, "gemm", tuple(ignore))


def _parse_gptq(qc: dict, key: str) -> CheckpointQuant:
    fmt_field = "checkpoint_format" if "checkpoint_format" in qc else "format"
    fmt = str(qc.get(fmt_field) or "gptq").lower()
    if fmt not in _GPTQ_FORMATS:
        raise ValueError(f"{key}.{fmt_field}: GPTQ format {fmt!r} is not supported (only {_GPTQ_FORMATS})")
    if qc.get("is_marlin_format"):
        raise ValueError(f"{key}.is_marlin_format: Marlin-packed GPTQ checkpoints are not supported")
    if str(qc.get("pack_dtype", "int32")) != "int32":
        raise ValueError(f"{key}.pack_dtype: {qc['pack_dtype']!r} is not supported (only int32 words)")
    if qc.get("dynamic"):
        raise ValueError(f"{key}.dynamic: per-module overrides of bits or group size are not supported")
    bits = _bits(qc.get("bits", 4), f"{key}.bits", (4, 8))
    group_size = _group_size(qc.get("group_size", 128), f"{key}.group_size")
    symmetric = _bool(qc.get("sym"), f"{key}.sym", True)
    act_order = _bool(qc.get("desc_act"), f"{key}.desc_act", False)
    return CheckpointQuant("gptq", bits, group_size, symmetric, fmt, (), act_order)


def _parse_compressed_tensors(qc: dict, key: str) -> CheckpointQuant:
    for field in ("kv_cache_scheme", "transform_config"):
        if qc.get(field):
            raise ValueError(f"{key}.{field}: not supported (only weight-only quantization)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise ValueError(f"{key}.sparsity_config.format: {sparsity.get('format')!r} is not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{key}.config_groups: expected at least one quantization scheme")
    parsed = set()
    for name, scheme in groups.items():
        field = f"{key}.config_groups.{name}"
        if not isinstance(scheme, dict):
            raise ValueError(f"{field}: expected a quantization scheme object, got {scheme!r}")
        for acts in ("input_activations", "output_activations"):
            if scheme.get(acts):
                raise ValueError(
                    f"{field}.{acts}: activation quantization (e.g. W8A8) is not supported, "
                    "only weight-only schemes (W4A16, W8A16)"
                )
        fmt = str(scheme.get("format") or qc.get("format") or "").lower()
        if fmt != _CT_PACKED and fmt not in _CT_UNPACKED:
            raise ValueError(
                f"{key}.format: compressed-tensors format {fmt!r} is not supported "
                f"(only {(_CT_PACKED, *_CT_UNPACKED)})"
            )
        parsed.add((fmt, *_parse_ct_weights(scheme.get("weights"), f"{field}.weights")))
    if len(parsed) > 1:
        raise ValueError(f"{key}.config_groups: schemes that differ between modules are not supported")
    fmt, bits, group_size, symmetric, act_order = parsed.pop()
    ignore = tuple(qc.get("ignore") or ())
    return CheckpointQuant("compressed-tensors", bits, group_size, symmetric, fmt, ignore, act_order)


def _parse_ct_weights(w, field: str) -> tuple[int, int | None, bool, bool]:
    if not isinstance(w, dict):
        raise ValueError(f"{field}: expected the weights' quantization arguments, got {w!r}")
    if str(w.get("type", "int")).lower() != "int":
        raise ValueError(f"{field}.type: {w.get('type')!r} quantization is not supported (only 'int')")
    if w.get("dynamic"):
        raise ValueError(f"{field}.dynamic: dynamic weight quantization is not supported")
    bits = _bits(w.get("num_bits", 8), f"{field}.num_bits", (4, 8))
    symmetric = _bool(w.get("symmetric"), f"{field}.symmetric", True)
    group_size = w.get("group_size")
    strategy = w.get("strategy")  # inferred from group_size when absent, as compressed-tensors does
    if strategy is None:
        strategy = "group" if isinstance(group_size, int) and group_size > 0 else "channel"
    strategy = str(strategy).lower()
    if strategy == "channel":
        if group_size not in (None, -1):
            raise ValueError(f"{field}.group_size: {group_size!r} with strategy 'channel'")
        group_size = None
    elif strategy == "group":
        group_size = _group_size(group_size, f"{field}.group_size")
        if group_size is None:
            raise ValueError(f"{field}.group_size: strategy 'group' needs a positive group size")
    else:
        raise ValueError(f"{field}.strategy: {strategy!r} is not supported (only 'channel' and 'group')")
    actorder = w.get("actorder")
    act_order = actorder is True or str(actorder).lower() in ("group", "dynamic")
    return bits, group_size, symmetric, act_order


# ---------------------------------------------------------------------------------------------- names


def _leaves(quant: CheckpointQuant) -> tuple[frozenset[str], frozenset[str]]:
    """(required, optional) leaves of one quantized linear."""
    required, optional = set(), set()
    if quant.method == "awq":
        required = {"qweight", "qzeros", "scales"}
    elif quant.method == "gptq":
        required = {"qweight", "qzeros", "scales"}
        (required if quant.act_order else optional).add("g_idx")
    else:
        codes = {"weight_packed", "weight_shape"} if quant.format == _CT_PACKED else {"weight"}
        required = codes | {"weight_scale"}
        # a symmetric checkpoint may still carry all-zero zero points
        (optional if quant.symmetric else required).add("weight_zero_point")
        (required if quant.act_order else optional).add("weight_g_idx")
    return frozenset(required), frozenset(optional)


def required_leaves(quant: CheckpointQuant) -> set[str]:
    """The leaves without which a linear's weight cannot be rebuilt (a missing one means a broken file)."""
    return set(_leaves(quant)[0])


def _ignored(quant: CheckpointQuant, module: str) -> bool:
    if quant.method == "compressed-tensors":
        return any(
            re.match(p.removeprefix("re:"), module) is not None if p.startswith("re:") else p == module
            for p in quant.ignore
        )
    return any(p in module for p in quant.ignore)


def quantized_linear_prefix(
    quant: CheckpointQuant, ckpt_name: str, names: Container[str] | None = None
) -> tuple[str, str] | None:
    """Split a checkpoint tensor name into (linear prefix, leaf) when it belongs to a quantized linear.

    Anything else (norms, embeddings, biases, an ignored lm_head's weight) is None: the loader reads it
    as a plain tensor. int-quantized compressed-tensors checkpoints keep the plain `weight` leaf for
    their int8 codes, so only a `weight_scale` sibling tells a quantized linear's weight from a norm's:
    for them `names` (every tensor name in the checkpoint, ideally a set) is required.
    """
    prefix, dot, leaf = ckpt_name.rpartition(".")
    required, optional = _leaves(quant)
    if not dot or leaf not in required | optional or _ignored(quant, prefix):
        return None
    if leaf == "weight":
        if names is None:
            raise ValueError(
                f"{ckpt_name}: a {quant.format} checkpoint stores quantized codes under the plain 'weight' "
                "name; pass the checkpoint's tensor names to tell them from unquantized weights"
            )
        if f"{prefix}.weight_scale" not in names:
            return None
    return prefix, leaf


# ---------------------------------------------------------------------------------------------- unpack


def unpack(
    quant: CheckpointQuant, prefix: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int]
) -> QuantizedWeight:
    """One linear's checkpoint tensors -> QuantizedWeight of the (out, in) shape the model expects.

    Every tensor is checked against the config and the model's shape before any bit is read, so a
    checkpoint that does not match its config (or the model) fails naming the tensor instead of
    producing a wrong weight.
    """
    out_features, in_features = shape
    group_size = quant.group_size or in_features
    if in_features % group_size:
        raise ValueError(
            f"{prefix}: group size {group_size} does not divide the input size {in_features} "
            f"(the model expects a [{out_features}, {in_features}] weight)"
        )
    required, optional = _leaves(quant)
    missing = sorted(required - tensors.keys())
    if missing:
        raise ValueError(f"{prefix}: missing {', '.join(f'{prefix}.{m}' for m in missing)}")
    unknown = sorted(tensors.keys() - required - optional)
    if unknown:
        raise ValueError(f"{prefix}: unexpected {', '.join(f'{prefix}.{u}' for u in unknown)}")
    groups = in_features // group_size
    for leaf in ("g_idx", "weight_g_idx"):
        if leaf in tensors:
            _check_g_idx(f"{prefix}.{leaf}", tensors[leaf], in_features, group_size)
    if quant.method == "awq":
        q, zeros, scales = _unpack_awq(quant, prefix, tensors, out_features, in_features, groups)
    elif quant.method == "gptq":
        q, zeros, scales = _unpack_gptq(quant, prefix, tensors, out_features, in_features, groups)
    else:
        q, zeros, scales = _unpack_ct(quant, prefix, tensors, out_features, in_features, groups)
    if quant.symmetric:
        mid = 1 << (quant.bits - 1)
        if zeros is not None and not bool((zeros == mid).all()):
            name = f"{prefix}.qzeros" if quant.method == "gptq" else f"{prefix}.weight_zero_point"
            raise ValueError(f"{name}: the config says symmetric but the zero points are not all {mid}")
        q, zeros = q - mid, None
    elif quant.bits == 8:  # 0..255 does not fit int8: shift codes and zeros alike
        q, zeros = q - 128, zeros - 128
    return QuantizedWeight(
        q.to(torch.int8).contiguous(),
        scales.float().contiguous(),
        None if zeros is None else zeros.float().contiguous(),
        quant.bits,
        group_size,
    )


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
    if t.dtype not in dtypes or tuple(t.shape) != shape:
        want = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        got = str(t.dtype).removeprefix("torch.")
        raise ValueError(
            f"{name}: expected {want} of shape {list(shape)}, got {got} of shape {list(t.shape)}"
        )


def _check_multiple(prefix: str, what: str, size: int, factor: int) -> None:
    if size % factor:
        raise ValueError(f"{prefix}: the {what} size {size} is not a multiple of {factor}, as packing needs")


def _check_g_idx(name: str, g_idx: torch.Tensor, in_features: int, group_size: int) -> None:
    _check(name, g_idx, _INT_DTYPES, (in_features,))
    trivial = torch.arange(in_features, device=g_idx.device) // group_size
    if not torch.equal(g_idx.long(), trivial):
        raise ValueError(
            f"{name}: act-order (desc_act / actorder 'group') checkpoints are not supported: this g_idx "
            "sends input columns to groups out of order"
        )


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., n] -> their unsigned bit fields [..., n, 32/bits] as int16, lowest bits first.

    One shift at a time keeps the temporaries the packed tensor's size (a 14336 x 4096 layer would need
    ~470 MB for an int64 [..., n, 8] intermediate). The mask drops what the arithmetic shift sign-extends.
    """
    per_word = 32 // bits
    out = torch.empty(*packed.shape, per_word, dtype=torch.int16, device=packed.device)
    for i in range(per_word):
        out[..., i] = (packed >> (bits * i)) & ((1 << bits) - 1)
    return out


def _unpack_awq(quant, prefix, tensors, out_features, in_features, groups):
    _check_multiple(prefix, "output", out_features, 8)
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    _check(f"{prefix}.qweight", qweight, (torch.int32,), (in_features, out_features // 8))
    _check(f"{prefix}.qzeros", qzeros, (torch.int32,), (groups, out_features // 8))
    _check(f"{prefix}.scales", scales, _FLOAT_DTYPES, (groups, out_features))
    order = list(AWQ_REVERSE_ORDER)

    def columns(packed):  # [rows, out/8] -> [rows, out] in output-column order
        return _fields(packed, 4)[..., order].reshape(packed.shape[0], -1)

    return columns(qweight).T, columns(qzeros).T, scales.T


def _unpack_gptq(quant, prefix, tensors, out_features, in_features, groups):
    bits = quant.bits
    per_word = 32 // bits
    _check_multiple(prefix, "input", in_features, per_word)
    _check_multiple(prefix, "output", out_features, per_word)
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    _check(f"{prefix}.qweight", qweight, (torch.int32,), (in_features // per_word, out_features))
    _check(f"{prefix}.qzeros", qzeros, (torch.int32,), (groups, out_features // per_word))
    _check(f"{prefix}.scales", scales, _FLOAT_DTYPES, (groups, out_features))
    q = _fields(qweight.T, bits).reshape(out_features, in_features)  # [out, in/pw, pw]: along the input
    zeros = qzeros.to(torch.int64)
    if quant.format == "gptq":  # v1: undo GPTQModel's word-wise "- 0x11111111" (see the module docstring)
        zeros = zeros + sum(1 << (bits * i) for i in range(per_word))
    zeros = _fields(zeros, bits).reshape(groups, out_features).T
    return q, zeros, scales.T


def _unpack_ct(quant, prefix, tensors, out_features, in_features, groups):
    bits = quant.bits
    mid = 1 << (bits - 1)
    scale = tensors["weight_scale"]
    _check(f"{prefix}.weight_scale", scale, _FLOAT_DTYPES, (out_features, groups))
    zp = tensors.get("weight_zero_point")
    if quant.format == _CT_PACKED:
        per_word = 32 // bits
        packed, stored_shape = tensors["weight_packed"], tensors["weight_shape"]
        _check(
            f"{prefix}.weight_packed",
            packed,
            (torch.int32,),
            (out_features, math.ceil(in_features / per_word)),
        )
        _check(f"{prefix}.weight_shape", stored_shape, _INT_DTYPES, (2,))
        if stored_shape.tolist() != [out_features, in_features]:
            raise ValueError(
                f"{prefix}.weight_shape: expected [{out_features}, {in_features}], "
                f"got {stored_shape.tolist()}"
            )
        if zp is not None and zp.dtype == torch.int8:  # unpacked: releases before zero-point packing
            _check(f"{prefix}.weight_zero_point", zp, (torch.int8,), (out_features, groups))
            zp = zp.to(torch.int64) + mid
        elif zp is not None:  # packed along the output dim
            zp_shape = (math.ceil(out_features / per_word), groups)
            _check(f"{prefix}.weight_zero_point", zp, (torch.int32,), zp_shape)
            zp = _fields(zp.T, bits).reshape(groups, -1)[:, :out_features].T
        q = _fields(packed, bits).reshape(out_features, -1)[:, :in_features]
    else:
        weight = tensors["weight"]
        _check(f"{prefix}.weight", weight, (torch.int8,), (out_features, in_features))
        if zp is not None:
            _check(f"{prefix}.weight_zero_point", zp, (torch.int8,), (out_features, groups))
            zp = zp.to(torch.int64) + mid
        q = weight.to(torch.int64) + mid
        if bits == 4 and not bool(((q >= 0) & (q < 16)).all()):
            raise ValueError(f"{prefix}.weight: 4-bit codes must lie in -8..7")
    if zp is not None and not bool(((zp >= 0) & (zp < (1 << bits))).all()):
        raise ValueError(f"{prefix}.weight_zero_point: {bits}-bit zero points must lie in {-mid}..{mid - 1}")
    return q, zp, scale
