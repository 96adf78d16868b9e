"""Find a model (folder, preset, hub id), build our model class, and load its weights.

Weights are copied tensor by tensor from memory-mapped safetensors files into parameters that were
allocated once, uninitialised, in the target dtype: a checkpoint is never held twice in RAM. Under tensor
parallelism each rank reads only its slice of each tensor (LazyTensor), as the model's `tp_plan` says.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from infer import kernels
from infer.config import LOAD_FORMATS
from infer.layers.linear import MergedLinear, can_prepack, prepack_linears
from infer.layers.parallel import COLUMN, ROW, SINGLE, TensorParallel, shard_range
from infer.layers.widened_linear import widen_linears, widens
from infer.models import gguf
from infer.models.config import ModelConfig
from infer.models.decoder_classifier import with_classifier_token_ids
from infer.models.dtypes import to_torch_dtype
from infer.models.registry import model_class
from infer.quant.embedding import QuantizedEmbedding
from infer.quant.formats import CheckpointQuant, parse_quantization_config, quantized_linear_prefix
from infer.quant.formats import unpack as unpack_checkpoint
from infer.quant.linear import linear_target, quantize_model, summarize, swap_quantized
from infer.quant.weights import QuantizedWeight

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EMBEDDED_MODEL = ASSETS / "embedded"
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def resolve_model_path(model: str | None, load_format: str = "auto") -> Path:
    """A local folder holding config.json, or a GGUF file (infer.models.gguf: a .gguf, the first of its
    splits, or a folder holding one). `None` or "embedded" is the project's own model.

    With load_format "dummy", a preset name (see infer.models.presets) or hub id with a preset needs
    no download: the preset's folder holds its config.json.
    """
    if model in (None, "", "embedded"):
        return EMBEDDED_MODEL
    path = Path(model).expanduser()
    if (gguf_file := gguf.find_gguf(path)) is not None:
        return gguf_file
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json nor .gguf file: not a model folder")
        return path
    if path.suffix == ".gguf":
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    if load_format == "dummy":
        from infer.models.presets import preset_path

        if (preset := preset_path(model)) is not None:
            return preset
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"model {model!r} is neither a model folder nor a hub id like 'org/name'")
    return _download(model)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as exc:  # offline, gated, or misspelt: all end the same way for the user
        raise ValueError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            f"Without internet, download it elsewhere (`hf download {repo_id} --local-dir DIR`) and pass "
            f"the folder, or run with --load-format dummy to use random weights in its shape."
        ) from exc


def tokenizer_folder(path: Path) -> Path:
    """Where the tokenizer of the model in `path` is read: its own tokenizer.json, else the embedded
    model's (random-weight presets ship a config.json only)."""
    return path if (path / "tokenizer.json").is_file() else EMBEDDED_MODEL


def read_config(path: Path, overrides: dict | None = None) -> dict:
    """config.json, with `overrides` (vLLM's --hf-overrides) laid over it."""
    with open(path / "config.json") as f:
        return json.load(f) | (overrides or {})


def pick_dtype(cfg: ModelConfig, dtype: str) -> torch.dtype:
    """`auto` follows the checkpoint, except on a CPU with bf16 hardware (AMX, or AVX-512 BF16), where
    bfloat16 wins everything, and for float16, which has no fast CPU path at all.

    Measured (benchmarks/bench_dtype.py, docs/benchmarks.md), bf16 weights prepacked for oneDNN: on an
    Intel Xeon with AMX, bf16 prefills 2-3x faster than fp32 and decodes a batch of 8 1.5-2x faster; on an
    AMD EPYC with AVX-512 BF16 and no AMX, 2.2-2.8x faster prefill and 2.5-3.6x faster decode at batch 1
    and 8. A CPU with neither keeps the checkpoint's dtype; a bf16 one there holds its linears' weights
    in bf16 under float32 activations (widens_activations; docs/optimizations.md).
    """
    if dtype != "auto":
        return to_torch_dtype(dtype)
    chosen = to_torch_dtype(cfg.dtype)
    if chosen != torch.bfloat16 and (chosen == torch.float16 or _cpu_has_fast_bf16()):
        return torch.bfloat16
    return chosen


def _cpu_has_fast_bf16() -> bool:
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return bool((kernels.cpu_has_amx() or avx512_bf16) and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def load_model(
    model: str | None = None,
    dtype: str = "auto",
    load_format: str = "auto",
    seed: int = 0,
    prepack: bool = True,
    quantization: str = "none",
    tp: TensorParallel = SINGLE,
    pooling: bool = False,
    hf_overrides: dict | None = None,
) -> tuple[nn.Module, ModelConfig, Path]:
    """Returns (model in eval mode on CPU, its config, its folder or GGUF file). `quantization` int8 or
    int4 swaps the linear layers for quantized ones (infer.quant; `model.quantization` summarises what was
    done; `model.gguf` what a GGUF file held). With
    `prepack`, the remaining bf16 linear layers get their weights reordered once for oneDNN where the CPU
    supports it (infer.layers.linear). `tp`: this rank's shard of the model (infer.layers.parallel); random
    weights (load_format dummy) are then drawn per shard, so they differ from the unsharded model's.
    `pooling`: the class the pooling runner serves (a decoder without its LM head; infer.models.registry).
    `hf_overrides`: keys laid over config.json (or a GGUF file's metadata read as one)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    path = resolve_model_path(model, load_format)
    gguf_model = gguf.open_gguf(path) if gguf.is_gguf(path) else None
    if (gguf_model is not None) != (load_format == "gguf") and load_format not in ("auto", "dummy"):
        raise ValueError(f"--load-format {load_format} does not read {path.name}")
    if gguf_model is not None:
        hf_config = gguf.hf_config(gguf_model) | (hf_overrides or {})  # refuses quantized tensors first
        cfg = gguf.model_config(gguf_model, hf_config)
    else:
        hf_config = read_config(path, hf_overrides)
        cfg = ModelConfig.from_hf(hf_config)
    if cfg.classifier_from_token and load_format != "dummy":  # random weights need no LM head rows
        cfg = with_classifier_token_ids(cfg, tokenizer_folder(path))
    torch_dtype = pick_dtype(cfg, dtype)
    quant = None if load_format == "dummy" else parse_quantization_config(hf_config)
    if gguf_model is not None and gguf_model.quantized() and load_format != "dummy":
        quant = "gguf"  # its quantized matrices (Q8_0, Q4_K, ...)
    wide = dtype == "auto" and prepack and not pooling and quant is None and quantization == "none"
    wide = wide and widens_activations(torch_dtype)
    with torch.device("meta"):
        net = model_class(cfg.architecture, pooling)(cfg, tp)
    net = net.to(dtype=torch.float32 if wide else torch_dtype)
    if wide:  # the linears keep the checkpoint's bf16 (widens_activations), a tied head the embedding's
        embedding = net.input_embeddings().weight
        for module in net.modules():
            if isinstance(module, nn.Linear) and module.weight is not embedding:
                module.to(torch_dtype)
    net = net.to_empty(device="cpu")
    net.tie_weights()
    for module in net.modules():  # buffers (rope tables) were left uninitialised by to_empty
        if hasattr(module, "init_buffers"):
            module.init_buffers()
    if quant is not None and quantization != "none":
        raise ValueError(
            f"{path.name} is already quantized ({_method(quant)}): drop --quantization {quantization}"
        )
    if quant is not None and tp.size > 1:
        raise ValueError(
            f"{path.name} is pre-quantized ({_method(quant)}): tensor parallelism loads bf16/fp32 "
            "checkpoints only (--quantization int8/int4 quantizes each rank's shard at load)"
        )
    swapped, paths = {}, {}
    if load_format == "dummy":
        init_dummy_weights(net, seed)
    elif gguf_model is not None:
        swapped, paths = load_gguf_weights(net, gguf_model, cfg, torch_dtype, tp)
    else:
        swapped = load_weights(net, path, quant, tp)
    net = net.eval().requires_grad_(False)
    net.gguf = None
    if gguf_model is not None:
        net.gguf = gguf_model.summary() | {"paths": paths}
    net.quantization = summarize(quant, swapped) if quant else quantize_model(net, quantization)
    if prepack and can_prepack(torch_dtype):
        prepack_linears(net)
    elif prepack and widens(torch_dtype):
        widen_linears(net, tied_head=wide)
    net.auto_kv_cache_dtype = auto_kv_cache_dtype(dtype, torch_dtype, wide, quant)
    return net, cfg, path


def auto_kv_cache_dtype(dtype: str, torch_dtype: torch.dtype, wide: bool, quant) -> torch.dtype | None:
    """The KV cache `--kv-cache-dtype auto` picks where it is not the model's dtype (None): under float32
    activations that `--dtype auto` chose, 16 bits, as llama.cpp's default cache (half the bytes every
    decode step reads; docs/quantization.md, "16-bit KV cache under a float32 model"): a widened bf16
    checkpoint's bf16, a quantized GGUF file's float16."""
    if wide:
        return torch_dtype
    if dtype == "auto" and quant == "gguf" and torch_dtype == torch.float32:
        return torch.float16
    return None


def widens_activations(torch_dtype: torch.dtype) -> bool:
    """A bf16 checkpoint under `--dtype auto` on a CPU without bf16 arithmetic, where infer's kernels are
    built: its activations run in float32 and its linears keep their bf16 weights (avx2_linear widens
    them as it reads them). A decode still reads 2 bytes a weight; the norms, rotary, attention and
    elementwise ops run in float32, which that CPU computes natively (bf16 ones convert at every op):
    faster prompts and wide batches, and closer to the float32 reference (docs/optimizations.md, "bf16 on
    a CPU without bf16 arithmetic"). The embedding is held in float32 (looked up, not streamed; a tied
    head gets a bf16 copy of its own); the KV cache stays bf16 unless asked."""
    return torch_dtype == torch.bfloat16 and widens(torch_dtype) and kernels.avx2_ops() is not None


def _method(quant) -> str:
    return quant if isinstance(quant, str) else quant.method


def check_model_files(model: str | None, load_format: str = "auto") -> None:
    """Fail early (ValueError) on a GGUF file that cannot load: unreadable, an unknown architecture, a
    quantized tensor. Reads the metadata and tensor table only; other models are checked at load."""
    if load_format == "dummy" or model in (None, "", "embedded"):
        return
    gguf_file = gguf.find_gguf(Path(model).expanduser())
    if gguf_file is not None:
        gguf.hf_config(gguf.open_gguf(gguf_file))
    elif model.endswith(".gguf"):
        raise ValueError(f"GGUF file {model!r} does not exist")


def load_engine_model(
    config, tp: TensorParallel = SINGLE, pooling: bool = False
) -> tuple[nn.Module, ModelConfig, Path]:
    """load_model with an EngineConfig's fields: what every rank of an engine loads."""
    return load_model(
        config.model,
        config.dtype,
        config.load_format,
        config.seed,
        config.prepack_weights,
        config.quantization,
        tp,
        pooling,
        config.hf_overrides,
    )


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            return [path / name for name in sorted(set(json.load(f)["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path} (use --load-format dummy for random weights)")
    return files


@torch.no_grad()
def load_weights(
    net: nn.Module, path: Path, quant: CheckpointQuant | None = None, tp: TensorParallel = SINGLE
) -> dict:
    """Copy the checkpoint's tensors (this rank's slices of them) into `net`. With `quant` (a
    pre-quantized checkpoint), the tensors of its quantized linears are unpacked instead, and those
    linears swapped for QuantizedLinear layers; returns what was swapped (swap_quantized)."""
    packed = _packed_shards(net)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # quantized linear prefix -> its tensors by leaf
    files = safetensors_files(path)
    names = _tensor_names(files) if quant is not None else None

    def tensors():
        for file in files:
            with safe_open(file, framework="pt") as f:
                for ckpt_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    hit = quant and quantized_linear_prefix(quant, ckpt_name, names)
                    if hit:
                        pending.setdefault(hit[0], {})[hit[1]] = f.get_tensor(ckpt_name)
                    else:
                        yield ckpt_name, LazyTensor(f.get_slice(ckpt_name))

    loaded = copy_weights(net, tensors(), path.name, tp)
    unpack = {prefix: functools.partial(unpack_checkpoint, quant, prefix, t) for prefix, t in pending.items()}
    swapped = swap_quantized(net, unpack, packed) if pending else {}
    check_complete(net, loaded | {f"{prefix}.weight" for prefix in pending}, path.name)
    return swapped


@torch.no_grad()
def load_gguf_weights(
    net: nn.Module, model: gguf.GGUFModel, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel
) -> tuple[dict, dict[str, str]]:
    """Copy a GGUF file's tensors into `net` (this rank's slices); its quantized matrices swap their
    linears for QuantizedLinear layers of the file's codes. Returns what was swapped (swap_quantized) and
    what became of each tensor type (gguf.tensor_paths)."""
    quantized: dict[str, QuantizedWeight] = {}  # linear prefix -> its weight

    def tensors():
        for name, t in gguf.hf_tensors(model, cfg.num_heads, cfg.num_kv_heads):
            if isinstance(t, QuantizedWeight):
                quantized[name.removesuffix(".weight")] = t
            else:
                yield name, LazyTensor(HeldTensor(t))

    loaded = copy_weights(net, tensors(), model.name, tp)
    embedding = quantized.pop(gguf.GLOBAL_TENSORS[gguf.EMBEDDING].removesuffix(".weight"), None)
    if embedding is not None:
        _swap_embedding(net, embedding, dtype)
        loaded.add(gguf.GLOBAL_TENSORS[gguf.EMBEDDING])
    packed = _packed_shards(net)
    kinds = {name.removesuffix(".weight"): kind for name, kind in gguf.tensor_types(model).items()}
    targets = {prefix: linear_target(net, prefix, packed)[0] for prefix in quantized}
    split = _split_by_scheme(quantized, targets, kinds)
    unpack = {prefix: functools.partial(_shaped, model.name, prefix, w) for prefix, w in quantized.items()}
    swapped = swap_quantized(net, unpack, packed) if quantized else {}
    check_complete(net, loaded | {f"{prefix}.weight" for prefix in quantized}, model.name)
    layers: dict[str, dict[str, str]] = {}  # block type -> {module path: backend}
    for prefix, target in targets.items():
        layers.setdefault(kinds[prefix], {})[target] = swapped[target].backend
    return swapped, gguf.tensor_paths(model, layers, dtype, split)


def _split_by_scheme(
    quantized: dict[str, QuantizedWeight], targets: dict[str, str], kinds: dict[str, str]
) -> dict[str, int]:
    """Block type -> how many of its tensors share a fused projection (q/k/v, gate/up) with parts of
    another quantization scheme (Q4_K q, k beside a Q6_K v): such a layer runs each scheme's parts as
    a layer of their own (infer.quant.linear.fused_linear), the codes as compact as their type allows."""
    parts: dict[str, list[str]] = {}
    for prefix, target in targets.items():
        parts.setdefault(target, []).append(prefix)
    split: Counter[str] = Counter()
    for prefixes in parts.values():
        if len({(quantized[p].bits, quantized[p].mins is None) for p in prefixes}) > 1:
            split.update(kinds[p] for p in prefixes)
    return dict(split)


def _swap_embedding(net: nn.Module, weight: QuantizedWeight, dtype: torch.dtype) -> None:
    """The model's embedding replaced by one that keeps `weight`'s codes (infer.quant.embedding)."""
    old = net.input_embeddings()
    if tuple(weight.shape) != (old.num_embeddings, old.embedding_dim):
        expected = [old.num_embeddings, old.embedding_dim]
        raise ValueError(f"token_embd.weight is {list(weight.shape)}, the model expects {expected}")
    path = next(name for name, module in net.named_modules() if module is old)
    parent, _, child = path.rpartition(".")
    setattr(net.get_submodule(parent) if parent else net, child, QuantizedEmbedding(weight, dtype))


def _shaped(source: str, prefix: str, weight: QuantizedWeight, shape: tuple[int, int]) -> QuantizedWeight:
    if tuple(weight.shape) != tuple(shape):
        expected = list(shape)
        raise ValueError(f"{source}: {prefix}.weight is {list(weight.shape)}, the model expects {expected}")
    return weight


def _packed_shards(net: nn.Module) -> dict[str, tuple[str, int]]:
    """checkpoint module name -> (our fused module, its shard index): q_proj -> (qkv_proj, 0)."""
    return {ckpt: (fused, i) for fused, names in net.packed_modules.items() for i, ckpt in enumerate(names)}


@torch.no_grad()
def copy_weights(net: nn.Module, tensors, source: str, tp: TensorParallel = SINGLE) -> set[str]:
    """Copy (checkpoint name, LazyTensor) pairs into `net`, fused and sharded as the model declares;
    returns the names loaded (as the checkpoint spells them). `source` names the checkpoint in errors."""
    params = dict(net.named_parameters())
    packed = _packed_shards(net)
    loaded: set[str] = set()
    for ckpt_name, lazy in tensors:
        remapped = net.remap_weight(ckpt_name, lazy)  # None, (name, tensor), or a list of those
        for name, tensor in (
            [] if remapped is None else remapped if isinstance(remapped, list) else [remapped]
        ):
            if name == "lm_head.weight" and net.config.tie_word_embeddings:
                continue  # some checkpoints store the tied copy too
            module_path, _, leaf = name.rpartition(".")
            parent, _, child = module_path.rpartition(".")
            if child in packed:
                fused, shard = packed[child]
                module = net.get_submodule(f"{parent}.{fused}" if parent else fused)
                shape = (module.output_sizes[shard], *getattr(module, leaf).shape[1:])
                module.load_shard(leaf, _rank_part(tensor, net.tp_plan.get(fused), leaf, shape, tp), shard)
                loaded.add(name)
            elif name in params:
                module = net.get_submodule(module_path)
                _load_param(name, module, leaf, tensor, net.tp_plan.get(child), tp)
                loaded.add(name)
            else:
                raise ValueError(f"unexpected weight {ckpt_name!r} in {source}")
    return loaded


def check_complete(net: nn.Module, loaded: set[str], source: str) -> None:
    missing = set(_checkpoint_names(net, dict(net.named_parameters()))) - loaded
    if net.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"weights missing from {source}: {', '.join(sorted(missing)[:8])}")


class LazyTensor:
    """A checkpoint tensor not read yet. `.t()` and `.narrow()` only record what is wanted; `.load()`
    reads just that part of the memory-mapped file (a rank's shard, not the whole tensor)."""

    def __init__(self, source, ranges: list[tuple[int, int]] | None = None, transposed: bool = False):
        self.source = source  # a safetensors slice (safe_open(...).get_slice(name))
        self.ranges = ranges if ranges is not None else [(0, n) for n in source.get_shape()]
        self.transposed = transposed

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.ranges)

    def t(self) -> LazyTensor:
        return LazyTensor(self.source, self.ranges[::-1], not self.transposed)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        ranges = list(self.ranges)
        ranges[dim] = (ranges[dim][0] + start, length)
        return LazyTensor(self.source, ranges, self.transposed)

    def load(self) -> torch.Tensor:
        stored = self.ranges[::-1] if self.transposed else self.ranges
        tensor = self.source[tuple(slice(a, a + n) for a, n in stored)]
        return tensor.t() if self.transposed else tensor


class HeldTensor:
    """A tensor already at hand (a memory-mapped GGUF tensor) as the slice source LazyTensor reads."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def _load_param(
    name: str, module: nn.Module, leaf: str, tensor: LazyTensor, style: str | None, tp: TensorParallel
):
    """Copy this rank's part of `tensor` into module.<leaf>. A weight the checkpoint stores fused (GPT-2's
    c_attn: q | k | v) is split into its projections first, each sharded on its own."""
    param = getattr(module, leaf)
    if isinstance(module, MergedLinear) and style == COLUMN and tp.size > 1:
        offset = 0
        for shard, size in enumerate(module.output_sizes):
            part = tensor.narrow(0, offset, size * tp.size)
            module.load_shard(leaf, _rank_part(part, style, leaf, (size, *param.shape[1:]), tp), shard)
            offset += size * tp.size
        return
    part = _rank_part(tensor, style, leaf, tuple(param.shape), tp)
    if param.shape != part.shape:
        raise ValueError(f"{name}: expected {tuple(param.shape)}, got {tuple(part.shape)}")
    param.copy_(part)


def _rank_part(
    tensor: LazyTensor, style: str | None, leaf: str, shape: tuple, tp: TensorParallel
) -> torch.Tensor:
    """What this rank's parameter of `shape` holds of checkpoint `tensor`: column shards split the
    outputs (dim 0), row shards the inputs (dim 1; their bias is added once, by rank 0, after the
    all-reduce), vocab shards the rows, zero-padded past the vocabulary; anything else whole."""
    if style is None or tp.size == 1 or len(tensor.shape) == 0:
        return tensor.load()
    if style == ROW and leaf == "bias":
        return tensor.load() if tp.rank == 0 else torch.zeros(shape)
    dim = 1 if style == ROW else 0
    start, length = shard_range(style, tensor.shape[dim], shape[dim], tp)
    part = tensor.narrow(dim, start, length).load()
    if length < shape[dim]:  # the vocabulary's last shard
        part = torch.cat([part, part.new_zeros(shape[dim] - length, *part.shape[1:])])
    return part


def _tensor_names(files: list[Path]) -> set[str]:
    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def _checkpoint_names(net: nn.Module, params: dict) -> list[str]:
    """Our parameter names as the checkpoint spells them: a fused parameter stands for its shards."""
    names = []
    for name in params:
        module_path, _, leaf = name.rpartition(".")
        parent, _, child = module_path.rpartition(".")
        shards = net.packed_modules.get(child)
        names += [f"{parent}.{shard}.{leaf}" for shard in shards] if shards else [name]
    return names


@torch.no_grad()
def init_dummy_weights(net: nn.Module, seed: int = 0) -> None:
    """Random weights in the model's shape: matrices ~ N(0, 0.02), biases 0, norms at their identity."""
    gen = torch.Generator().manual_seed(seed)
    for module in net.modules():
        if hasattr(module, "reset_parameters") and not isinstance(module, nn.Linear | nn.Embedding):
            module.reset_parameters()  # norms
    for name, param in net.named_parameters():
        if param.ndim >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        elif name.endswith(".bias"):
            param.zero_()


def num_parameters(net: nn.Module) -> int:
    """Parameters, counting the weights of prepacked layers (which are not parameters any more)."""
    packed = sum(getattr(m, "num_packed_params", 0) for m in net.modules())
    return sum(p.numel() for p in net.parameters()) + packed


def weight_bytes(net: nn.Module) -> int:
    """Bytes the weights take: parameters and buffers (quantized codes, scales), and prepacked bf16
    weights (opaque to torch, counted by their element count)."""
    held = sum(t.nbytes for t in (*net.parameters(), *net.buffers()))
    packed = (m for m in net.modules() if getattr(m, "packed_weight", None) is not None)
    return held + 2 * sum(getattr(m, "num_packed_params", 0) for m in packed)
