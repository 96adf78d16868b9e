"""GGUF files that cannot be served: each refused with a message naming what is wrong (and by the server
with exit code 2 and no traceback). The files are written with the `gguf` package's writer, then broken."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from infer.models.loader import check_model_files, load_model, resolve_model_path


def write_gguf(path, arch="llama", quantized=False, skip=()):
    """A one-layer model's metadata and a few of its tensors (enough to be read, not to run)."""
    writer = GGUFWriter(path, arch)
    for key, value in [("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4), ("context_length", 256)]:  # fmt: skip
        if key not in skip:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.ones((16, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    if quantized:  # an i-quant: IQ4_NL blocks of 32 weights in 18 bytes (non-linear 4-bit levels)
        codes = np.zeros((64, 2 * 18), dtype=np.uint8)
        writer.add_tensor("blk.0.ffn_down.weight", codes, raw_dtype=GGMLQuantizationType.IQ4_NL)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refused(path, match: str):
    with pytest.raises(ValueError, match=match):
        check_model_files(str(path))
    with pytest.raises(ValueError, match=match):
        load_model(str(path))


def test_a_well_formed_file_passes_the_checks(tmp_path):
    check_model_files(str(write_gguf(tmp_path / "ok.gguf")))  # the model itself is incomplete: no more


def test_wrong_magic(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    path.write_bytes(b"GGML" + path.read_bytes()[4:])
    refused(path, r"m.gguf is not a GGUF file: it starts with b'GGML', not b'GGUF'")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"GGU")
    refused(path, r"empty.gguf is not a GGUF file: only 3 bytes")


def test_unsupported_version(tmp_path):
    path = write_gguf(tmp_path / "v.gguf")
    data = bytearray(path.read_bytes())
    data[4:8] = (4).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    refused(path, r"v.gguf is GGUF version 4; supported: 2, 3")


def test_truncated_in_the_header(tmp_path):
    path = write_gguf(tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[:60])
    refused(path, r"t.gguf is truncated: it has 60 bytes and its header needs bytes up to \d+")


def test_truncated_in_the_tensor_data(tmp_path):
    path = write_gguf(tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[:-200])
    size = path.stat().st_size
    refused(path, rf"t.gguf is truncated: it has {size} bytes and its tensor data needs bytes up to \d+")


def test_tensor_larger_than_its_data(tmp_path):
    """token_embd's rows changed from 16 to 17 in the tensor table: its data would run into the next."""
    path = write_gguf(tmp_path / "s.gguf")
    data = path.read_bytes()
    dims = (64).to_bytes(8, "little") + (16).to_bytes(8, "little")
    at = data.index(b"token_embd.weight") + len("token_embd.weight") + 4  # after the name and n_dims
    assert data[at : at + 16] == dims
    path.write_bytes(data[:at] + (64).to_bytes(8, "little") + (17).to_bytes(8, "little") + data[at + 16 :])
    refused(path, r"s.gguf: tensor 'token_embd.weight' is larger than its shape and type allow")


def test_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "a.gguf", arch="mamba")
    refused(
        path,
        r"a.gguf: GGUF architecture 'mamba' is not supported; supported: gemma3, gpt2, llama, qwen2, qwen3",
    )


def test_a_quantized_gpt2_file_is_refused_naming_a_tensor(tmp_path):
    writer = GGUFWriter(tmp_path / "g.gguf", "gpt2")
    for key, value in [("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 256),
                       ("attention.head_count", 4), ("context_length", 256)]:  # fmt: skip
        writer.add_uint32(f"gpt2.{key}", value)
    writer.add_tensor("token_embd.weight", np.ones((16, 64), dtype=np.float32))
    codes = np.zeros((256, 2 * 34), dtype=np.uint8)  # Q8_0: blocks of 32 in 34 bytes
    writer.add_tensor("blk.0.ffn_up.weight", codes, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refused(tmp_path / "g.gguf", r"tensor 'blk.0.ffn_up.weight' is Q8_0: infer runs GPT-2 GGUF files in F32")


def test_missing_hyperparameter(tmp_path):
    path = write_gguf(tmp_path / "h.gguf", skip=("block_count",))
    refused(path, r"h.gguf: metadata llama.block_count is missing")


def test_quantized_tensor_is_refused_naming_it(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", quantized=True)
    refused(
        path,
        r"q.gguf: tensor 'blk.0.ffn_down.weight' is IQ4_NL, a quantized type infer cannot run yet \(1 "
        r"IQ4_NL tensors in all\); infer runs F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, "
        r"Q6_K tensors: requantize the file",
    )


def test_a_quantized_vector_is_refused_naming_it(tmp_path):
    """Q8_0 runs as matrices only: a norm in Q8_0 is not something llama.cpp writes, nor we read."""
    writer = GGUFWriter(tmp_path / "v.gguf", "llama")
    for key, value in [("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4)]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", np.ones((16, 64), dtype=np.float32))
    writer.add_tensor(
        "output_norm.weight", np.zeros(2 * 34, dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refused(
        tmp_path / "v.gguf",
        r"tensor 'output_norm.weight' is Q8_0 with shape \[64\]: infer keeps only matrices",
    )


def test_fused_projections_of_different_types_are_refused(tmp_path):
    """q/k/v run as one layer: quantized q and k with a float v have no one kernel (quantized parts of
    different block types do: the loader brings them to int8)."""
    writer = GGUFWriter(tmp_path / "mix.gguf", "llama")
    for key, value in [("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4)]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", np.ones((16, 64), dtype=np.float32))
    for name, kind, size in [("attn_q", "Q4_0", 18), ("attn_k", "Q8_0", 34)]:
        codes = np.zeros((64, 2 * size), dtype=np.uint8)
        writer.add_tensor(f"blk.0.{name}.weight", codes, raw_dtype=GGMLQuantizationType[kind])
    writer.add_tensor("blk.0.attn_v.weight", np.zeros((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refused(
        tmp_path / "mix.gguf",
        r"blk.0.attn_q.weight is Q4_0, blk.0.attn_k.weight is Q8_0, blk.0.attn_v.weight is F32: infer runs "
        r"attn_q / attn_k / attn_v as one layer, quantized or not",
    )


def test_folder_with_two_models_asks_for_the_file(tmp_path):
    write_gguf(tmp_path / "a.gguf")
    write_gguf(tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=r"holds several GGUF models \(a.gguf, b.gguf\): pass the file"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "b.gguf").unlink()
    assert resolve_model_path(str(tmp_path)) == tmp_path / "a.gguf"


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="GGUF file .*nope.gguf' does not exist"):
        check_model_files(str(tmp_path / "nope.gguf"))


@pytest.mark.slow  # a server process
def test_server_exits_2_with_the_message_and_no_traceback(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", quantized=True)
    result = subprocess.run(
        [sys.executable, "-m", "infer", "serve", str(path), "--port", "0"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "tensor 'blk.0.ffn_down.weight' is IQ4_NL" in result.stderr
    assert "Traceback" not in result.stderr


def test_load_format_must_match_the_file(tmp_path):
    path = write_gguf(tmp_path / "ok.gguf")
    with pytest.raises(ValueError, match="--load-format safetensors does not read ok.gguf"):
        load_model(str(path), load_format="safetensors")
    with pytest.raises(ValueError, match="--load-format gguf does not read embedded"):
        load_model(None, load_format="gguf")
