"""A GGUF file opened again (each load of a server of several models) reads its header once: the
metadata and tensor table are kept per file, its mapping is not."""

from __future__ import annotations

import os

import numpy as np
from gguf import GGUFWriter

from infer.models import gguf


def write_gguf(path, width: int):
    writer = GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(1000)])
    writer.add_tensor("token_embd.weight", np.arange(16 * width, dtype=np.float32).reshape(16, width))
    writer.add_tensor("output_norm.weight", np.full(width, 2.0, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_alternating_files_read_each_header_once(tmp_path, monkeypatch):
    reads = []
    real = gguf._reader
    monkeypatch.setattr(gguf, "_reader", lambda file: reads.append(file.name) or real(file))
    gguf._open_files.cache_clear()
    a, b = write_gguf(tmp_path / "a.gguf", 64), write_gguf(tmp_path / "b.gguf", 32)
    for _ in range(3):
        model_a, model_b = gguf.open_gguf(a), gguf.open_gguf(b)
    assert sorted(reads) == ["a.gguf", "b.gguf"]
    assert model_a.metadata["tokenizer.ggml.tokens"][999] == "t999"
    embedding = model_a.tensors["token_embd.weight"]
    assert embedding.shape == (16, 64) and embedding.type_name == "F32"
    assert np.array_equal(embedding.data, np.arange(16 * 64, dtype=np.float32).reshape(16, 64))
    norm = model_b.tensors["output_norm.weight"]
    assert (norm.type_name, norm.shape) == ("F16", (32,)) and (norm.data == 2.0).all()
    assert model_b.metadata["llama.block_count"] == 1


def test_a_rewritten_file_is_read_again(tmp_path, monkeypatch):
    reads = []
    real = gguf._reader
    monkeypatch.setattr(gguf, "_reader", lambda file: reads.append(file.name) or real(file))
    path = write_gguf(tmp_path / "m.gguf", 64)
    assert gguf.open_gguf(path).tensors["token_embd.weight"].shape == (16, 64)
    write_gguf(path, 32)
    os.utime(path, ns=(1, 1))  # a new modification time even where the clock is coarse
    assert gguf.open_gguf(path).tensors["token_embd.weight"].shape == (16, 32)
    assert reads == ["m.gguf", "m.gguf"]
