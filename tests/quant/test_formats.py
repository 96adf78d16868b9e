"""infer/quant/formats.py: AWQ, GPTQ and compressed-tensors checkpoints read back into QuantizedWeights."""

from __future__ import annotations

import json

import pytest
import torch

from infer.quant.formats import (
    CheckpointQuant,
    parse_quantization_config,
    quantized_linear_prefix,
    required_leaves,
    unpack,
)
from infer.quant.weights import QuantizedWeight
from tests.quant.packing import (
    pack,
    pack_awq,
    pack_compressed_tensors,
    pack_gptq,
    quantization_config,
    random_quantized,
    write_quantized_checkpoint,
)

PREFIX = "model.layers.0.self_attn.q_proj"

# (method, bits, symmetric, checkpoint_format / ct_format): every variant each format has
VARIANTS = [
    ("awq", 4, False, None),
    *[("gptq", b, s, f) for b in (4, 8) for s in (True, False) for f in ("gptq", "gptq_v2")],
    *[
        ("compressed-tensors", b, s, f)
        for b in (4, 8)
        for s in (True, False)
        for f in ("pack-quantized", "int-quantized")
    ],
    ("compressed-tensors", 4, False, "naive-quantized"),  # the older name of int-quantized
]


def config_for(method, bits, group_size, symmetric, fmt, extra=None):
    kwargs = {"checkpoint_format": fmt} if method == "gptq" else {}
    if method == "compressed-tensors":
        kwargs["ct_format"] = fmt
    qc = quantization_config(method, bits, group_size, symmetric, **kwargs)
    qc.update(extra or {})
    return {"architectures": ["LlamaForCausalLM"], "quantization_config": qc}


def packed_for(method, w, fmt):
    if method == "gptq":
        return pack(method, w, checkpoint_format=fmt)
    if method == "compressed-tensors":
        return pack(method, w, ct_format=fmt)
    return pack(method, w)


def assert_same(got: QuantizedWeight, want: QuantizedWeight):
    assert (got.bits, got.group_size, got.shape) == (want.bits, want.group_size, want.shape)
    assert torch.equal(got.q, want.q)
    assert torch.equal(got.scales, want.scales)
    assert (got.zeros is None) == (want.zeros is None)
    if want.zeros is not None:
        assert torch.equal(got.zeros, want.zeros)
    assert torch.equal(got.dequantize(), want.dequantize())


# ---------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("group_size", [16, None], ids=["group16", "per_row"])
@pytest.mark.parametrize("method,bits,symmetric,fmt", VARIANTS, ids=lambda v: str(v))
def test_pack_unpack_round_trip(method, bits, symmetric, fmt, group_size):
    quant = parse_quantization_config(config_for(method, bits, group_size, symmetric, fmt))
    assert (quant.method, quant.bits, quant.group_size, quant.symmetric) == (
        method,
        bits,
        group_size,
        symmetric,
    )
    want = random_quantized(48, 64, bits, group_size, symmetric, seed=bits + 2 * symmetric)
    packed = packed_for(method, want, fmt)
    names = {f"{PREFIX}.{leaf}" for leaf in packed} | {"model.norm.weight", "model.embed_tokens.weight"}
    tensors = {}
    for name in names:
        split = quantized_linear_prefix(quant, name, names)
        if split is not None:
            assert split[0] == PREFIX
            tensors[split[1]] = packed[split[1]]
    assert tensors.keys() == packed.keys()
    assert required_leaves(quant) <= tensors.keys()
    assert_same(unpack(quant, PREFIX, tensors, (48, 64)), want)


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_compressed_tensors_pads_an_input_size_not_multiple_of_the_word(bits, symmetric):
    """pack_to_int32 pads the last word (and the last zero-point word): 20 inputs, 13 outputs."""
    quant = parse_quantization_config(config_for("compressed-tensors", bits, 4, symmetric, "pack-quantized"))
    want = random_quantized(13, 20, bits, 4, symmetric, seed=7)
    packed = pack_compressed_tensors(want)
    assert packed["weight_packed"].shape == (13, -(-20 * bits // 32))
    assert_same(unpack(quant, PREFIX, packed, (13, 20)), want)


def test_symmetric_codes_come_out_signed_and_asymmetric_8bit_shifted():
    """The QuantizedWeight conventions: zeros None when symmetric; 8-bit asymmetric codes fit int8."""
    quant = parse_quantization_config(config_for("gptq", 4, None, True, "gptq"))
    w = unpack(quant, PREFIX, pack_gptq(random_quantized(8, 32, 4, None, True)), (8, 32))
    assert w.zeros is None and w.q.min() >= -8 and w.q.max() <= 7
    quant = parse_quantization_config(config_for("gptq", 8, None, False, "gptq_v2"))
    want = random_quantized(8, 32, 8, None, False)
    w = unpack(quant, PREFIX, pack_gptq(want, "gptq_v2"), (8, 32))
    assert w.zeros is not None and w.q.dtype == torch.int8
    assert torch.equal(w.dequantize(), want.dequantize())


# ------------------------------------------------------------------ against hand-decoded int32 words


def test_awq_order_hand_made():
    """One AWQ word holding output columns 0..7 with code = column: nibbles (low first) 0,2,4,6,1,3,5,7."""
    word = 0x75316420
    quant = parse_quantization_config(config_for("awq", 4, None, False, None))
    tensors = {
        "qweight": torch.tensor([[word]], dtype=torch.int32),  # [in=1, out/8=1]
        "qzeros": torch.tensor([[0x00000000]], dtype=torch.int32),
        "scales": torch.ones(1, 8, dtype=torch.float16),
    }
    w = unpack(quant, PREFIX, tensors, (8, 1))
    assert w.q[:, 0].tolist() == list(range(8))
    # and the reference packer writes that same word
    packed = pack_awq(QuantizedWeight(w.q, w.scales, w.zeros, 4, 1))
    assert packed["qweight"].item() == word


def test_gptq_hand_made_words_and_v1_borrow():
    """GPTQ packs along the input dim in plain order; v1 zeros are the v2 word minus 0x11111111."""
    qweight = torch.tensor([[0x76543210]], dtype=torch.int32)  # in=8 inputs of output 0: codes 0..7
    # zeros 0..7 of 8 outputs: v2 word 0x76543210; v1 word 0x76543210 - 0x11111111 = 0x654320FF, where
    # the zero of 0 borrowed from its neighbour (AutoGPTQ's per-nibble +1 would read 16, 16, 3, ...)
    v1 = torch.tensor([[0x654320FF]], dtype=torch.int32)
    v2 = torch.tensor([[0x76543210]], dtype=torch.int32)
    for fmt, qzeros in (("gptq", v1), ("gptq_v2", v2)):
        quant = parse_quantization_config(config_for("gptq", 4, None, False, fmt))
        tensors = {
            "qweight": qweight.repeat(1, 8),  # [in*4/32=1, out=8]
            "qzeros": qzeros,  # [groups=1, out*4/32=1]
            "scales": torch.ones(1, 8, dtype=torch.float16),
        }
        w = unpack(quant, PREFIX, tensors, (8, 8))
        assert w.q[0].tolist() == list(range(8))
        assert w.zeros[:, 0].tolist() == list(range(8))
        assert pack_gptq(w, fmt, g_idx=False)["qzeros"].item() == qzeros.item()


def test_gptq_v1_matches_autogptq_per_field_minus_one_when_no_zero_is_0():
    """AutoGPTQ's own v1 writer (`zeros -= 1` before packing) agrees with the word-wise reading."""
    want = random_quantized(16, 32, 4, 8, False, seed=3)
    want.zeros.clamp_(min=1)
    autogptq = torch.zeros(4, 2, dtype=torch.int64)
    for n in range(16):
        autogptq[:, n // 8] |= (want.zeros[n].long() - 1) << (4 * (n % 8))
    tensors = pack_gptq(want, "gptq")
    assert torch.equal(tensors["qzeros"], autogptq.to(torch.int32))
    quant = parse_quantization_config(config_for("gptq", 4, 8, False, "gptq"))
    assert_same(unpack(quant, PREFIX, tensors, (16, 32)), want)


def test_compressed_tensors_docstring_example():
    """pack_to_int32's docstring: 8-bit [1, 2] -> [129, 130] -> 33409, padded to a word."""
    quant = parse_quantization_config(config_for("compressed-tensors", 8, None, True, "pack-quantized"))
    tensors = {
        "weight_packed": torch.tensor([[33409]], dtype=torch.int32),
        "weight_shape": torch.tensor([1, 2]),
        "weight_scale": torch.ones(1, 1, dtype=torch.bfloat16),
    }
    w = unpack(quant, PREFIX, tensors, (1, 2))
    assert w.q.tolist() == [[1, 2]] and w.zeros is None
    # 4-bit: codes -8..-1 are stored +8 = 0..7 in plain order
    quant = parse_quantization_config(config_for("compressed-tensors", 4, None, True, "pack-quantized"))
    tensors["weight_packed"] = torch.tensor([[0x76543210]], dtype=torch.int32)
    tensors["weight_shape"] = torch.tensor([1, 8])
    assert unpack(quant, PREFIX, tensors, (1, 8)).q.tolist() == [list(range(-8, 0))]


# ---------------------------------------------------------------------------------------------- names


def test_names_and_leaves():
    assert parse_quantization_config({"architectures": ["LlamaForCausalLM"]}) is None
    awq = parse_quantization_config(config_for("awq", 4, 128, False, None))
    assert required_leaves(awq) == {"qweight", "qzeros", "scales"}
    assert quantized_linear_prefix(awq, f"{PREFIX}.qweight") == (PREFIX, "qweight")
    for plain in ("model.norm.weight", "model.embed_tokens.weight", f"{PREFIX}.bias", "lm_head.weight"):
        assert quantized_linear_prefix(awq, plain) is None
    gptq = parse_quantization_config(config_for("gptq", 4, 128, True, "gptq"))
    assert quantized_linear_prefix(gptq, f"{PREFIX}.g_idx") == (PREFIX, "g_idx")
    ct = parse_quantization_config(config_for("compressed-tensors", 4, 128, True, "pack-quantized"))
    assert required_leaves(ct) == {"weight_packed", "weight_scale", "weight_shape"}
    assert quantized_linear_prefix(ct, "lm_head.weight_packed") is None  # ignored: ["lm_head"]
    assert quantized_linear_prefix(ct, f"{PREFIX}.weight") is None
    ct_asym = parse_quantization_config(config_for("compressed-tensors", 4, 128, False, "pack-quantized"))
    assert "weight_zero_point" in required_leaves(ct_asym)
    naive = parse_quantization_config(config_for("compressed-tensors", 8, None, True, "int-quantized"))
    names = {f"{PREFIX}.weight", f"{PREFIX}.weight_scale", "model.norm.weight", "lm_head.weight"}
    assert quantized_linear_prefix(naive, f"{PREFIX}.weight", names) == (PREFIX, "weight")
    assert quantized_linear_prefix(naive, "model.norm.weight", names) is None
    assert quantized_linear_prefix(naive, "lm_head.weight", names) is None
    with pytest.raises(ValueError, match="tensor names"):
        quantized_linear_prefix(naive, f"{PREFIX}.weight")


def test_ignore_patterns():
    config = config_for("compressed-tensors", 4, None, True, "pack-quantized")
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    quant = parse_quantization_config(config)
    assert quantized_linear_prefix(quant, "model.layers.3.mlp.gate.weight_packed") is None
    assert quantized_linear_prefix(quant, "model.layers.3.mlp.gate_proj.weight_packed") is not None


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "change,field",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method"),
        ({"bits": 3}, "bits"),
        ({"group_size": 0}, "group_size"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
        ({"sym": "yes"}, "sym"),
    ],
)
def test_gptq_config_refusals(change, field):
    config = config_for("gptq", 4, 128, True, "gptq", change)
    with pytest.raises(ValueError, match=rf"quantization_config\.{field}"):
        parse_quantization_config(config)


@pytest.mark.parametrize(
    "change,field",
    [({"version": "gemv"}, "version"), ({"version": "GEMV_FAST"}, "version"), ({"bits": 8}, "bits")],
)
def test_awq_config_refusals(change, field):
    with pytest.raises(ValueError, match=rf"quantization_config\.{field}"):
        parse_quantization_config(config_for("awq", 4, 128, False, None, change))
    # GEMM is accepted whatever its case
    assert (
        parse_quantization_config(config_for("awq", 4, 128, False, None, {"version": "GEMM"})).format
        == "gemm"
    )


@pytest.mark.parametrize(
    "path,value,message",
    [
        (
            ("input_activations",),
            {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
            "W8A8",
        ),
        (("weights", "type"), "float", r"weights\.type"),
        (("weights", "num_bits"), 2, r"weights\.num_bits"),
        (("weights", "strategy"), "tensor", r"weights\.strategy"),
        (("format",), "marlin-24", r"quantization_config\.format"),
    ],
)
def test_compressed_tensors_config_refusals(path, value, message):
    config = config_for("compressed-tensors", 4, 128, True, "pack-quantized")
    target = config["quantization_config"]["config_groups"]["group_0"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(config)


def test_act_order_g_idx_refused_but_trivial_g_idx_accepted():
    quant = parse_quantization_config(config_for("gptq", 4, 16, True, "gptq", {"desc_act": True}))
    assert quant.act_order and "g_idx" in required_leaves(quant)
    want = random_quantized(16, 64, 4, 16, True)
    tensors = pack_gptq(want)
    assert_same(unpack(quant, PREFIX, tensors, (16, 64)), want)  # trivial k // group_size
    tensors["g_idx"] = tensors["g_idx"][torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ValueError, match=rf"{PREFIX}\.g_idx: act-order"):
        unpack(quant, PREFIX, tensors, (16, 64))


def test_wrong_shape_names_tensor_and_expected_shape():
    quant = parse_quantization_config(config_for("gptq", 4, 16, False, "gptq"))
    tensors = pack_gptq(random_quantized(16, 64, 4, 16, False))
    tensors["qweight"] = tensors["qweight"][:, :8]
    with pytest.raises(ValueError, match=rf"{PREFIX}\.qweight: expected int32 of shape \[8, 16\]"):
        unpack(quant, PREFIX, tensors, (16, 64))
    awq = parse_quantization_config(config_for("awq", 4, 16, False, None))
    tensors = pack_awq(random_quantized(16, 64, 4, 16, False))
    with pytest.raises(ValueError, match=rf"{PREFIX}\.qweight: expected int32 of shape \[32, 2\]"):
        unpack(awq, PREFIX, tensors, (16, 32))  # the model's linear is narrower than the checkpoint's
    tensors["scales"] = tensors["scales"].to(torch.int32)
    with pytest.raises(ValueError, match=rf"{PREFIX}\.scales: expected float16/bfloat16/float32"):
        unpack(awq, PREFIX, tensors, (16, 64))
    del tensors["qzeros"]
    with pytest.raises(ValueError, match=rf"missing {PREFIX}\.qzeros"):
        unpack(awq, PREFIX, tensors, (16, 64))


def test_group_size_must_divide_in():
    quant = parse_quantization_config(config_for("gptq", 4, 48, True, "gptq"))
    with pytest.raises(ValueError, match="group size 48 does not divide the input size 64"):
        unpack(quant, PREFIX, pack_gptq(random_quantized(16, 96, 4, 48, True)), (16, 64))


def test_symmetric_config_with_other_zero_points_refused():
    quant = parse_quantization_config(config_for("gptq", 4, 16, True, "gptq_v2"))
    tensors = pack_gptq(random_quantized(16, 64, 4, 16, False), "gptq_v2")
    with pytest.raises(ValueError, match=rf"{PREFIX}\.qzeros: the config says symmetric"):
        unpack(quant, PREFIX, tensors, (16, 64))


def test_checkpoint_quant_is_frozen():
    quant = CheckpointQuant("gptq", 4, 128, True, "gptq")
    with pytest.raises(AttributeError):
        quant.bits = 8


# ------------------------------------------------------------------------------- whole checkpoints


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.models.tiny_models import save_byte_tokenizer, save_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    model, path = save_tiny_model("llama", root)
    save_byte_tokenizer(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, path


@pytest.mark.parametrize(
    "method,bits,group_size,symmetric,fmt",
    [
        ("awq", 4, 32, False, None),
        ("gptq", 4, 32, True, "gptq"),
        ("gptq", 8, None, False, "gptq_v2"),
        ("compressed-tensors", 4, 16, False, "pack-quantized"),
        ("compressed-tensors", 8, None, True, "int-quantized"),
    ],
)
def test_write_quantized_checkpoint(tiny_llama, tmp_path, method, bits, group_size, symmetric, fmt):
    from safetensors.torch import load_file

    state, src = tiny_llama
    kwargs = {"checkpoint_format": fmt} if method == "gptq" else {}
    if method == "compressed-tensors":
        kwargs["ct_format"] = fmt
    written = write_quantized_checkpoint(src, tmp_path, method, bits, group_size, symmetric, **kwargs)
    assert len(written) == 2 * 7
    assert (tmp_path / "tokenizer.json").exists()
    quant = parse_quantization_config(json.loads((tmp_path / "config.json").read_text()))
    tensors = load_file(tmp_path / "model.safetensors")
    names = set(tensors)
    linears, plain = {}, set()
    for name in names:
        split = quantized_linear_prefix(quant, name, names)
        if split is None:
            plain.add(name)
        else:
            linears.setdefault(split[0], {})[split[1]] = tensors[name]
    assert linears.keys() == written.keys()
    assert plain == {n for n in state if n.rpartition(".")[0] not in written}
    for prefix, leaves in linears.items():
        original = state[f"{prefix}.weight"]
        w = unpack(quant, prefix, leaves, tuple(original.shape))
        assert_same(w, written[prefix])
        # the codes stand for the original weight: within a step (half a step but for min-max's clamped
        # extremes); the exact check is assert_same above, this one catches a writer that lost the weight
        step = w.scales.repeat_interleave(w.group_size, dim=1)
        assert ((w.dequantize() - original).abs() <= step * 1.01).all()
