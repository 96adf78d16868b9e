"""GGUF files (llama.cpp's format), read with llama.cpp's own reader (the `gguf` package).

A GGUF file holds what a Hugging Face folder spreads over several files: the hyperparameters
(`{arch}.block_count`, `{arch}.attention.head_count`, ...), the tokenizer (`tokenizer.ggml.*`,
infer.engine.gguf_tokenizer), the chat template and the tensors, under llama.cpp's names
(`blk.0.attn_q.weight`). This module turns the file into what the safetensors path has: a config.json
dict for `ModelConfig.from_hf` and the tensors under Hugging Face's names, so one loader serves both.

    model.gguf                         one file
    model-00001-of-00003.gguf          the first of split files; the others are found beside it
    folder/                            a folder holding one .gguf (or one set of splits)

Unquantized tensors (F32, F16, BF16) load as `--dtype` says. Quantized matrices stay quantized
(infer.quant.gguf_blocks: int8 / int4 codes in groups of 32, run by the quantized linears; a quantized
token embedding keeps its codes too, its rows dequantized as they are looked up, and a head tied to it
gets them as well): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K as the file holds them (Q6_K as
6-bit codes in groups of 16: infer.quant.gguf_kquants). Projections run as one layer (q/k/v, gate/up) whose
parts differ (Q4_K q and k beside a Q6_K v, as in Q4_K_M files) run each type's parts as a layer of their
own (infer.quant.split_linear), the int4 codes still two to a byte. Every other type (IQ-quants,
ternary, Q2_K, Q3_K) is refused, naming the tensor and its type, before the model is allocated.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infer.models.config import ModelConfig
from infer.quant.gguf_blocks import LOADS_AS, TYPES, unpack_blocks
from infer.quant.weights import QuantizedWeight

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
# general.architecture -> the config.json `architectures` entry of the same model. llama.cpp writes
# Mistral (and its sliding-window variant) as llama.
ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# control tokens that end a turn, which llama.cpp adds to the end-of-generation ids by their text
EOG_TEXTS = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
}
UNQUANTIZED = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
QUANTIZED = TYPES  # Q8_0, Q4_0, ..., Q4_K, Q5_K, Q6_K: kept quantized
EMBEDDING = "token_embd.weight"
BACKEND_NAMES = {
    "infer": "infer kernel",
    "avx2": "infer AVX2 kernel",
    "torch": "torch kernel",
    "dequant": "dequantized: no kernel here",
}
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# blk.N.<llama.cpp name> -> model.layers.N.<Hugging Face name>
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 3 has four norms a layer: its ffn_norm is the one before the MLP
GEMMA3_LAYER_TENSORS = {**LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm"}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GPT-2 (blk.N.<name> -> transformer.h.N.<name>): LayerNorms with biases, learned positions, and q/k/v
# fused as in Hugging Face's c_attn, whose Conv1D weights llama.cpp's converter stored transposed
GPT2_LAYER_TENSORS = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
GPT2_GLOBAL_TENSORS = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
GPT2_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


def find_gguf(path: Path) -> Path | None:
    """The .gguf file `path` names: itself, or the one .gguf (or first split) in a folder; None when
    `path` is neither. ValueError for a folder holding several models."""
    if is_gguf(path):
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.glob("*.gguf") if not (m := _SPLIT.match(p.name)) or int(m["no"]) == 1)
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{path} holds several GGUF models ({names}): pass the file to serve")
    return found[0] if found else None


def split_files(path: Path) -> list[Path]:
    """All the files of a model: `path` alone, or every split of `name-0000K-of-0000N.gguf`."""
    match = _SPLIT.match(path.name)
    if not match:
        return [path]
    count = int(match["count"])
    files = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{path.name} is split in {count} files and {', '.join(missing)} is missing")
    return files


@dataclass
class GGUFTensor:
    name: str
    type_name: str  # F32, F16, BF16, Q8_0, ...
    shape: tuple[int, ...]  # torch order (outputs first), as the data is laid out
    data: np.ndarray  # memory-mapped bytes or elements
    file: str

    def to_torch(self) -> torch.Tensor:
        """The tensor, still memory-mapped (no copy): unquantized types only."""
        data = torch.from_numpy(self.data)
        if self.type_name == "BF16":  # the reader hands BF16 as raw bytes
            data = data.view(torch.bfloat16)
        return data.reshape(self.shape)


@dataclass
class GGUFModel:
    """The metadata (of the first file) and the tensors (of every split) of a GGUF model."""

    files: list[Path]
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def name(self) -> str:
        return self.files[0].name

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def quantized(self) -> bool:
        """Whether any tensor is in a quantized block type (which loads as such)."""
        return any(t.type_name in QUANTIZED for t in self.tensors.values())

    def type_counts(self) -> dict[str, int]:
        return dict(Counter(t.type_name for t in self.tensors.values()).most_common())

    def summary(self) -> dict[str, Any]:
        """What the file held, for the start-up log and /server_info."""
        mib = sum(t.data.nbytes for t in self.tensors.values()) / 2**20
        return {
            "file": self.name,
            "architecture": self.architecture,
            "tensor_types": self.type_counts(),
            "tensor_mib": round(mib, 1),
        }

    def get(self, key: str, default: Any = None) -> Any:
        """A hyperparameter of this architecture (`attention.head_count` -> `llama.attention.head_count`)."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def open_gguf(path: Path) -> GGUFModel:
    """Read the metadata and tensor table of `path` (and its splits). ValueError naming what is wrong for
    a file that is not GGUF, of a version the reader does not know, truncated, or inconsistent.

    The last file read is kept: a load reads it for its flags, its weights and its tokenizer. What each
    file's header says is kept for longer (_header): llama.cpp's reader takes seconds over a large
    vocabulary's metadata, and a server of several models reopens each file at every load. Read-only:
    callers never change what it returns."""
    files = split_files(path)
    return _open_files(tuple((f.absolute(), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=1)
def _open_files(key: tuple[tuple[Path, int, int], ...]) -> GGUFModel:
    metadata: dict[str, Any] = {}
    tensors: dict[str, GGUFTensor] = {}
    for i, (file, size, mtime_ns) in enumerate(key):
        fields, table = _header(file, size, mtime_ns)
        if i == 0:
            metadata = fields
        data = np.memmap(file, mode="c").view(np.ndarray)  # copy-on-write: torch wants writable arrays
        for name, type_name, shape, offset, dtype, data_shape in table:
            if name in tensors:
                raise ValueError(f"{file.name}: tensor {name!r} appears twice in {key[0][0].name}")
            count = int(np.prod(data_shape))
            view = data[offset : offset + count * dtype.itemsize].view(dtype).reshape(data_shape)
            tensors[name] = GGUFTensor(name, type_name, shape, view, file.name)
    return GGUFModel([file for file, _, _ in key], metadata, tensors)


@functools.lru_cache(maxsize=16)
def _header(file: Path, size: int, mtime_ns: int) -> tuple[dict[str, Any], list[tuple]]:
    """A file's metadata and where each tensor lies in it: (name, type name, shape in torch order, byte
    offset, numpy dtype, the reader's array shape), for that size and modification time of the file.
    Holds no mapping of the file: an unloaded model's pages are not kept resident."""
    fields, reader = _read_file(file)
    table = [
        (t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape.tolist())), int(t.data_offset),
         t.data.dtype, t.data.shape)
        for t in reader.tensors
    ]  # fmt: skip
    return fields, table


def _reader(file: Path):
    """llama.cpp's GGUFReader, which says where a file is too short rather than failing on a reshape."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            end = offset + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                part = "tensor data" if hasattr(self, "data_offset") else "header"
                raise ValueError(
                    f"{file.name} is truncated: it has {len(self.data)} bytes and its {part} needs bytes "
                    f"up to {end}"
                )
            # as GGUFReader._get, on a plain array over the same mapping: slicing the np.memmap itself
            # costs a memmap object per slice, seconds over a vocabulary's strings
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            arr = plain[offset:end].view(dtype=dtype)[: int(count)]
            return arr.view(
                arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order)
            )

    # copy-on-write: torch wants writable arrays, and the file is never written
    return Reader(file, "c")


def _read_file(file: Path) -> tuple[dict[str, Any], Any]:
    """The file's metadata, and llama.cpp's reader over it (its tensors), checked."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{file.name} is not a GGUF file: only {size} bytes")
    if head[:4] != GGUF_MAGIC:
        raise ValueError(f"{file.name} is not a GGUF file: it starts with {head[:4]!r}, not b'GGUF'")
    version = int.from_bytes(head[4:8], "little")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"{file.name} is GGUF version {version}; supported: {', '.join(map(str, SUPPORTED_VERSIONS))}"
        )
    try:
        reader = _reader(file)
    except ValueError as e:
        if str(e).startswith(file.name):
            raise
        raise ValueError(f"{file.name} cannot be read as GGUF: {e}") from e
    except Exception as e:  # anything else the reader meets in a corrupt file
        raise ValueError(f"{file.name} cannot be read as GGUF (corrupt?): {type(e).__name__}: {e}") from e
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            fields[name] = field.contents()
        except Exception as e:
            raise ValueError(f"{file.name}: metadata {name!r} cannot be read: {e}") from e
    _check_overlaps(file.name, reader)
    return fields, reader


def _check_overlaps(file: str, reader) -> None:
    """A tensor whose shape and type claim more bytes than lie before the next tensor's data (the reader
    sizes each tensor from its shape and type alone; a file running short is caught as it reads)."""
    spans = sorted((t.data_offset, t.data_offset + t.data.nbytes, t.name) for t in reader.tensors)
    for (_, end, name), (start, _, following) in zip(spans, spans[1:], strict=False):
        if end > start:
            raise ValueError(
                f"{file}: tensor {name!r} is larger than its shape and type allow: it runs into {following!r}"
            )


def check_loadable(model: GGUFModel) -> None:
    """ValueError unless the architecture is one we build and every tensor is F32/F16/BF16, or a matrix
    in a block type we read (QUANTIZED)."""
    arch = model.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{model.name}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    refused = [t for t in model.tensors.values() if t.type_name not in (*UNQUANTIZED, *QUANTIZED)]
    if refused:
        first = refused[0]
        counts = Counter(t.type_name for t in refused)
        kinds = ", ".join(f"{n} {k}" for k, n in counts.most_common())
        raise ValueError(
            f"{model.name}: tensor {first.name!r} is {first.type_name}, a quantized type infer cannot "
            f"run yet ({kinds} tensors in all); infer runs F32, F16, BF16, {', '.join(QUANTIZED)} "
            "tensors: requantize the file to one of those, e.g. Q4_K_M or Q8_0 "
            "(llama-quantize --allow-requantize), convert the model with `--outtype q8_0` or `bf16` "
            "(llama.cpp's convert_hf_to_gguf.py), or serve its Hugging Face folder with --quantization "
            "int8 / int4"
        )
    if arch == "gpt2" and model.quantized():
        first = next(t for t in model.tensors.values() if t.type_name in QUANTIZED)
        raise ValueError(
            f"{model.name}: tensor {first.name!r} is {first.type_name}: infer runs GPT-2 GGUF files in F32, "
            "F16 or BF16 only; convert the model with `--outtype f32|f16|bf16`, or serve its Hugging Face "
            "folder with --quantization int8 / int4"
        )
    for t in model.tensors.values():
        if t.type_name in QUANTIZED and len(t.shape) != 2:
            raise ValueError(
                f"{model.name}: tensor {t.name!r} is {t.type_name} with shape {list(t.shape)}: infer keeps "
                "only matrices quantized"
            )
    _check_fused_types(model)


def _check_fused_types(model: GGUFModel) -> None:
    """q/k/v and gate/up run as one fused layer each (the models' packed_modules): all quantized (of
    any block types: the loader brings them to one format) or all unquantized."""
    for i in range(int(model.get("block_count", 0) or 0)):
        for names in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")):
            found = [t for n in names if (t := model.tensors.get(f"blk.{i}.{n}.weight")) is not None]
            quantized = {t.type_name in QUANTIZED for t in found}
            if len(quantized) > 1:
                held = ", ".join(f"{t.name} is {t.type_name}" for t in found)
                raise ValueError(
                    f"{model.name}: {held}: infer runs {' / '.join(names)} as one layer, quantized or "
                    "not; requantize the file with quantized types for all of them"
                )


def hf_config(model: GGUFModel) -> dict[str, Any]:
    """The config.json a Hugging Face folder of this model would hold, from the GGUF metadata."""
    check_loadable(model)
    arch = model.architecture
    get = model.get
    for key in ("block_count", "embedding_length", "attention.head_count", "feed_forward_length"):
        if get(key) is None:
            raise ValueError(f"{model.name}: metadata {arch}.{key} is missing")
    if "token_embd.weight" not in model.tensors:
        raise ValueError(f"{model.name}: tensor 'token_embd.weight' is missing")
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokenizer = model.metadata
    if arch == "gpt2":
        return _gpt2(model)
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": model.tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden // num_heads)),
        "intermediate_size": int(get("feed_forward_length")),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5 if arch == "llama" else 1e-6)),
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "attention_bias": "blk.0.attn_q.bias" in model.tensors and arch != "qwen2",
        "mlp_bias": "blk.0.ffn_up.bias" in model.tensors,
        "rope_theta": _f32(get("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0)),
        "rope_scaling": _rope_scaling(model),
        "bos_token_id": tokenizer.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(end_ids(tokenizer)),
        "dtype": _dtype(model),
    }
    if arch == "llama" and get("attention.sliding_window"):  # Mistral's sliding window
        cfg["architectures"] = ["MistralForCausalLM"]
        cfg["sliding_window"] = int(get("attention.sliding_window"))
    if arch == "gemma3":
        cfg.update(_gemma3(model, cfg))
    return cfg


def _gpt2(model: GGUFModel) -> dict[str, Any]:
    """GPT-2's config.json (its own key names: n_embd, n_layer, ...); as many positions as the file has
    position embeddings."""
    get = model.get
    positions = model.tensors.get("position_embd.weight")
    return {
        "architectures": [ARCHITECTURES["gpt2"]],
        "vocab_size": model.tensors["token_embd.weight"].shape[0],
        "n_embd": int(get("embedding_length")),
        "n_layer": int(get("block_count")),
        "n_head": int(get("attention.head_count")),
        "n_inner": int(get("feed_forward_length")),
        "n_positions": int(positions.shape[0] if positions is not None else get("context_length", 1024)),
        "layer_norm_epsilon": _f32(get("attention.layer_norm_epsilon", 1e-5)),
        "activation_function": "gelu_new",
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "bos_token_id": model.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(end_ids(model.metadata)),
        "dtype": _dtype(model),
    }


def token_id(meta: dict[str, Any], key: str, tokens: list[str]) -> int | None:
    """tokenizer.ggml.<key> (bos_token_id, ...), None when absent or not a token of the vocabulary."""
    value = meta.get(f"tokenizer.ggml.{key}")
    return int(value) if value is not None and 0 <= int(value) < len(tokens) else None


def end_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """The ids that end generation, as llama.cpp finds them: eos, eot, eom, and control tokens whose
    text ends a turn in some model family."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    ids = {
        i
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (i := token_id(meta, key, tokens)) is not None
    }
    ids |= {
        i
        for i, (text, kind) in enumerate(zip(tokens, types, strict=True))
        if kind == CONTROL and text in EOG_TEXTS
    }
    return tuple(sorted(ids))


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it: 1e-05, not 9.99999974e-06."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _rope_scaling(model: GGUFModel) -> dict[str, Any] | None:
    kind = model.get("rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(model.get("rope.scaling.factor", 1.0))}
    if kind == "yarn":
        return _yarn(model)
    raise ValueError(f"{model.name}: rope scaling {kind!r} is not supported; supported: none, linear, yarn")


def _yarn(model: GGUFModel) -> dict[str, Any]:
    """YaRN as transformers' rope_scaling holds it, from what llama.cpp's converter writes of it."""
    get = model.get
    if get("rope.scaling.original_context_length") is None:
        raise ValueError(f"{model.name}: yarn rope scaling without rope.scaling.original_context_length")
    if get("rope.scaling.yarn_ext_factor") not in (None, 1.0) or get("rope.scaling.yarn_log_multiplier"):
        raise ValueError(f"{model.name}: yarn rope scaling with an extrapolation factor or log multiplier")
    params = {
        "rope_type": "yarn",
        "factor": _f32(get("rope.scaling.factor", 1.0)),
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
    }
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                      ("yarn_attn_factor", "attention_factor")):  # fmt: skip
        if get(f"rope.scaling.{key}") is not None:
            params[name] = _f32(get(f"rope.scaling.{key}"))
    return params


def _gemma3(model: GGUFModel, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's Gemma 3: every 6th layer global, the others a sliding window with a rope base of
    10000; the query scaled by head_dim ** -0.5 except in the 27B model (62 layers: hidden / heads)."""
    num_layers = cfg["num_hidden_layers"]
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if num_layers == 62 else cfg["head_dim"]
    extra: dict[str, Any] = {
        "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)],
        "sliding_window": int(model.get("attention.sliding_window", 4096)),
        "rope_local_base_freq": _f32(model.get("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    if model.get("final_logit_softcapping"):
        extra["final_logit_softcapping"] = _f32(model.get("final_logit_softcapping"))
    return extra


def _dtype(model: GGUFModel) -> str:
    """The type most matrices are stored in: what `--dtype auto` starts from."""
    names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    matrices = Counter(t.type_name for t in model.tensors.values() if len(t.shape) == 2)
    return names.get(matrices.most_common(1)[0][0], "float32") if matrices else "float32"


def rope_freq_factors(model: GGUFModel) -> tuple[float, ...] | None:
    """Llama 3.1's rope scaling, which llama.cpp's converter stores as a tensor of per-frequency divisors."""
    tensor = model.tensors.get("rope_freqs.weight")
    return None if tensor is None else tuple(float(x) for x in tensor.to_torch().float())


def hf_tensors(model: GGUFModel, num_heads: int, num_kv_heads: int):
    """(Hugging Face name, tensor) for every weight of the file, memory-mapped where nothing changes.
    Q8_0/Q4_0/Q4_1 matrices come as `QuantizedWeight`s (their codes, never widened); a head tied to a
    quantized token embedding comes as lm_head.weight with the embedding's codes.

    Undoes what llama.cpp's converter did to the tensors: for llama, the rows of q and k are permuted
    (LlamaModel.permute) for llama.cpp's rope; for Gemma 3, 1 was added to every norm weight.
    """
    arch = model.architecture
    for name, tensor in model.tensors.items():
        if name == "rope_freqs.weight":  # the rope's scaling, read into the config
            continue
        hf_name = _hf_name(name, arch)
        if hf_name is None:
            raise ValueError(f"{model.name}: unexpected tensor {name!r} for architecture {arch!r}")
        heads = num_heads if ".attn_q." in name else num_kv_heads
        permuted = arch == "llama" and (".attn_q." in name or ".attn_k." in name)
        if tensor.type_name in QUANTIZED:
            weight = _quantized(model, tensor)
            if permuted:
                weight = weight.rows(_unpermute(torch.arange(weight.shape[0]), heads))
            if name == EMBEDDING and "output.weight" not in model.tensors:  # the tied head
                yield GLOBAL_TENSORS["output.weight"], weight
            yield hf_name, weight
            continue
        data = tensor.to_torch()
        if permuted:
            data = _unpermute(data, heads)
        if arch == "gpt2" and hf_name.endswith(GPT2_CONV1D):  # back to Conv1D's [in, out]
            data = data.t()
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data - 1.0
        yield hf_name, data


def tensor_paths(
    model: GGUFModel, layers: dict[str, dict[str, str]], dtype: torch.dtype, split: dict[str, int]
) -> dict:
    """What became of each tensor type of a GGUF file, for the start-up log and /server_info, e.g.
    {"Q8_0": "int8 in groups of 32: 9 linear layers (infer kernel x9); token_embd.weight as int8 in groups
    of 32, rows dequantized to bfloat16 as looked up", "F32": "bfloat16 (--dtype)"}. `layers`: block type ->
    {module path: backend} of the quantized linears made from it; `split`: block type -> how many of its
    tensors share a fused layer with parts of another type (each type runs as a part of its own)."""
    dtype_name = str(dtype).removeprefix("torch.")
    embedding = model.tensors.get(EMBEDDING)
    paths = {}
    for kind in model.type_counts():
        if kind in UNQUANTIZED:
            paths[kind] = f"{dtype_name} (--dtype)"
            continue
        parts = []
        if kind in layers:
            backends = Counter(layers[kind].values())
            runs = ", ".join(f"{BACKEND_NAMES[b]} x{n}" for b, n in backends.most_common())
            count = len(layers[kind])
            parts.append(f"{LOADS_AS[kind]}: {count} linear layer{'s' * (count != 1)} ({runs})")
        if split.get(kind):
            parts.append(f"{split[kind]} fused with another type, each type a kernel call of its own")
        if embedding is not None and embedding.type_name == kind:
            parts.append(f"{EMBEDDING} as {LOADS_AS[kind]}, rows dequantized to {dtype_name} as looked up")
        paths[kind] = "; ".join(parts)
    return paths


def tensor_types(model: GGUFModel) -> dict[str, str]:
    """Hugging Face name -> block type of each quantized tensor (the tied head: the embedding's)."""
    types = {}
    for name, tensor in model.tensors.items():
        if tensor.type_name in QUANTIZED and (hf_name := _hf_name(name, model.architecture)) is not None:
            types[hf_name] = tensor.type_name
            if name == EMBEDDING and "output.weight" not in model.tensors:
                types[GLOBAL_TENSORS["output.weight"]] = tensor.type_name
    return types


def _quantized(model: GGUFModel, tensor: GGUFTensor) -> QuantizedWeight:
    try:
        return unpack_blocks(tensor.type_name, tensor.data, tensor.shape)
    except ValueError as e:
        raise ValueError(f"{model.name}: tensor {tensor.name!r}: {e}") from e


def _hf_name(name: str, arch: str) -> str | None:
    """The Hugging Face name of llama.cpp's tensor `name` in a model of `arch`, None if it has none."""
    gpt2 = arch == "gpt2"
    global_names = GPT2_GLOBAL_TENSORS if gpt2 else GLOBAL_TENSORS
    if name in global_names:
        return global_names[name]
    layer_names = GPT2_LAYER_TENSORS if gpt2 else GEMMA3_LAYER_TENSORS if arch == "gemma3" else LAYER_TENSORS
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match is None or match[2] not in layer_names:
        return None
    return f"{'transformer.h' if gpt2 else 'model.layers'}.{match[1]}.{layer_names[match[2]]}.{match[3]}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of convert_hf_to_gguf.py's LlamaModel.permute: each head's rows go from interleaved
    pairs (llama.cpp's rope) back to two halves (Hugging Face's)."""
    # [num_heads * head_dim, ...] -> [num_heads, head_dim // 2, 2, ...] -> [num_heads, 2, head_dim // 2, ...]
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_config(model: GGUFModel, config: dict[str, Any] | None = None) -> ModelConfig:
    """Our ModelConfig of the file: `ModelConfig.from_hf` of its config.json (hf_config), with Llama
    3.1's rope divisors where the file holds them."""
    cfg = ModelConfig.from_hf(config if config is not None else hf_config(model))
    factors = rope_freq_factors(model)
    if factors is None:
        return cfg
    if len(factors) != cfg.head_dim // 2:
        raise ValueError(f"{model.name}: rope_freqs has {len(factors)} entries for head_dim {cfg.head_dim}")
    return dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, freq_factors=factors))
