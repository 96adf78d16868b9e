"""GGUF files with Q8_0 / Q4_0 / Q4_1 matrices run on the int8 / int4 paths, their codes kept: the
logits are those of the dequantized weights, and greedy text follows the unquantized model's.

Q8_0 comes from llama.cpp's converter (`--outtype q8_0`); Q4_0 and Q4_1, which only llama-quantize
writes, from the converter's float32 file re-encoded by the gguf package's reference quantizers: Q4_0
with the token embedding (the head tied to it) in Q8_0, as llama-quantize leaves it when rows are not
multiples of 256, Q4_1 with it in Q4_1.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from infer import kernels
from infer.engine.llm import LLM
from infer.models.loader import EMBEDDED_MODEL, load_model
from infer.quant import linear as quant_linear
from infer.quant.embedding import QuantizedEmbedding
from infer.quant.linear import QuantizedLinear
from infer.sampling_params import SamplingParams

from .gguf_files import convert, rewrite
from .test_loader import forward_logits

pytestmark = pytest.mark.slow  # llama.cpp's converter and several model loads: ~1 min

HAS_KERNEL = kernels.bf16_ops() is not None
QUANTIZED = ["q8_0", "q4_0", "q4_1"]
BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4}
PROMPTS = [
    "In the beginning God created",
    "And the LORD said unto Moses",
    "Blessed is the man that",
    "The kingdom of heaven is like",
    "And it came to pass",
    "Now the serpent was more subtil",
    "Thou shalt not",
    "Let there be light",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """name -> GGUF file of the embedded model: bf16, q8_0, q4_0, q4_1, and `<type>-dequantized` (each
    quantized file with its tensors dequantized by the gguf package, stored as float32)."""
    root = tmp_path_factory.mktemp("gguf_quant")
    out = {t: root / f"embedded-{t}.gguf" for t in ("f32", "bf16", "q8_0")}
    convert(
        [{"model": str(EMBEDDED_MODEL), "out": str(f), "outtype": t, "pre": "gpt-2"} for t, f in out.items()]
    )
    for kind, qtype in (("q4_0", GGMLQuantizationType.Q4_0), ("q4_1", GGMLQuantizationType.Q4_1)):

        def encode(name, values, qtype=qtype):
            if values.ndim != 2:
                return None  # norms stay float32
            embedding = name == "token_embd.weight" and qtype == GGMLQuantizationType.Q4_0
            return GGMLQuantizationType.Q8_0 if embedding else qtype

        out[kind] = rewrite(out["f32"], root / f"embedded-{kind}.gguf", encode)
    for kind in QUANTIZED:
        dequantized = root / f"embedded-{kind}-dequantized.gguf"
        out[f"{kind}-dequantized"] = rewrite(out[kind], dequantized, lambda name, v: GGMLQuantizationType.F32)
    return out


def _ids(vocab_size: int) -> list[int]:
    return [0, *range(5, vocab_size, vocab_size // 80)]


@pytest.mark.parametrize("kind", QUANTIZED)
def test_logits_are_the_dequantized_weights(files, kind, monkeypatch):
    """float32: the int8 path dequantizes groups of 32 (torch has no int8 kernel in groups) and the int4
    path runs torch's kernel, or on an AVX2 CPU avx2_linear widens both in registers (x as it is, not
    rounded to int8): the dequantized model's logits to float32 rounding. bf16: our kernel, to bf16
    rounding and the rounding of activations to int8."""
    monkeypatch.setattr(quant_linear, "INT8_ACTIVATIONS", False)
    ours, cfg, _ = load_model(str(files[kind]), dtype="float32", prepack=False)
    ref, _, _ = load_model(str(files[f"{kind}-dequantized"]), dtype="float32", prepack=False)
    linears = {name: m for name, m in ours.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(linears) == cfg.num_layers * 4 + 1  # qkv, o, gate_up, down; the head tied to token_embd
    assert {(m.bits, m.group_size) for n, m in linears.items() if n != "lm_head"} == {(BITS[kind], 32)}
    head_bits = 4 if kind == "q4_1" else 8  # the type of token_embd
    assert (linears["lm_head"].bits, linears["lm_head"].group_size) == (head_bits, 32)
    embedding = ours.input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding) and embedding.bits == head_bits
    assert ours.quantization["method"] == "gguf" and ref.quantization["method"] == "none"
    ids = _ids(cfg.vocab_size)
    a, b = forward_logits(ours, ids), forward_logits(ref, ids)
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))

    monkeypatch.undo()
    ours, _, _ = load_model(str(files[kind]), dtype="bfloat16")
    ref, _, _ = load_model(str(files[f"{kind}-dequantized"]), dtype="bfloat16")
    if HAS_KERNEL:
        assert ours.quantization["backends"] == {"infer": len(linears)}
    a, b = forward_logits(ours, ids), forward_logits(ref, ids)
    # measured: max error 1.7-2.3% of the largest logit, the same top token at 98.8-100% of positions
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def _greedy(path, dtype: str = "bfloat16") -> list[list[int]]:
    llm = LLM(str(path), dtype=dtype, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


def _agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, int]:
    """(share of all tokens generated before each prompt's first difference, prompts equal throughout)."""
    same = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in zip(ours, ref, strict=True)
    ]
    return sum(same) / sum(len(a) for a in ours), sum(n == len(a) for n, a in zip(same, ours, strict=True))


def test_q8_0_greedy_text_follows_the_bf16_file(files):
    """int8 noise moves an argmax where two tokens are close; then the texts part. Measured on 8 prompts x
    32 tokens: 82% of the tokens before the first difference, 6 prompts equal throughout."""
    share, equal = _agreement(_greedy(files["q8_0"]), _greedy(files["bf16"]))
    assert share >= 0.6 and equal >= 4


@pytest.mark.parametrize("kind", QUANTIZED)
def test_greedy_text_is_that_of_the_dequantized_weights(files, kind, monkeypatch):
    """float32 with x as it is: the text of the dequantized weights, token for token. bf16 (our kernels, or
    avx2_linear on a CPU with AVX2 alone: int8 activations): about as close to it as the unquantized bf16
    path of the same weights.
    Measured, share of tokens before the first difference from the float32 text: ours 66-77%, the bf16
    path 81-91%; the embedded model is small and its top tokens close."""
    exact = _greedy(files[f"{kind}-dequantized"], "float32")
    with monkeypatch.context() as patched:
        patched.setattr(quant_linear, "INT8_ACTIVATIONS", False)
        assert _greedy(files[kind], "float32") == exact
    ours, _ = _agreement(_greedy(files[kind]), exact)
    bf16, _ = _agreement(_greedy(files[f"{kind}-dequantized"]), exact)
    assert ours >= 0.5 and ours >= bf16 - 0.25, (ours, bf16)


def test_auto_keeps_a_float32_models_cache_in_float16(files):
    """`--dtype auto` on a quantized file runs float32 activations where the CPU has no bf16 arithmetic;
    its `auto` cache is then float16, llama.cpp's default (an explicit --dtype float32 keeps float32), and
    its greedy text follows the float32-cache one's (measured: 82% of the tokens before each prompt's
    first difference)."""
    auto = LLM(str(files["q4_0"]), num_kv_blocks=64)
    model_dtype = next(auto.engine.runner.model.parameters()).dtype
    expected = torch.float16 if model_dtype == torch.float32 else model_dtype
    assert auto.engine.runner.kv_caches[0][0].dtype == expected
    explicit = LLM(str(files["q4_0"]), dtype="float32", num_kv_blocks=64)
    assert explicit.engine.runner.kv_caches[0][0].dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    texts = [[out.token_ids for out in llm.generate(PROMPTS, params)] for llm in (auto, explicit)]
    if model_dtype == torch.float32:  # the same weights and activations, the cache rounded
        share, _ = _agreement(*texts)
        assert share >= 0.6, share


def test_a_quantized_file_takes_no_more_quantization_nor_tensor_parallelism(files):
    from infer.layers.parallel import TensorParallel

    with pytest.raises(ValueError, match=r"already quantized \(gguf\): drop --quantization int4"):
        load_model(str(files["q8_0"]), quantization="int4")
    with pytest.raises(ValueError, match="pre-quantized"):
        load_model(str(files["q8_0"]), tp=TensorParallel(0, 2))


def test_server_says_which_path_each_type_took(files, tmp_path):
    import httpx

    from tests.server.conftest import ServerProcess

    args = ["--model", str(files["q4_0"]), "--enforce-eager", "--num-kv-blocks", "64", "--dtype", "bfloat16"]
    server = ServerProcess(args, tmp_path / "server.log").start()
    try:
        held = httpx.get(server.url + "/server_info").json()["quantization"]["gguf"]
        log = server.log_tail(100_000)
    finally:
        server.stop()
    assert held["tensor_types"] == {"Q4_0": 42, "F32": 13, "Q8_0": 1}
    int4 = int8 = "infer kernel" if HAS_KERNEL else "infer AVX2 kernel"
    if not HAS_KERNEL and kernels.avx2_ops() is None:
        int4, int8 = "torch kernel", "dequantized: no kernel here"
    assert held["paths"] == {
        "Q4_0": f"int4 in groups of 32: 24 linear layers ({int4} x24)",
        "F32": "bfloat16 (--dtype)",
        "Q8_0": f"int8 in groups of 32: 1 linear layer ({int8} x1); "
        "token_embd.weight as int8 in groups of 32, rows dequantized to bfloat16 as looked up",
    }
    for kind, path in held["paths"].items():
        assert f"GGUF {kind} tensors: {path}" in log
