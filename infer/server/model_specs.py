"""Several models behind one server: the flags, the models they name, and what each is expected to hold.

    infer serve --models-dir ~/models --models-max 2 --models-memory-gb 24 --keep-alive 10m
    infer serve --models models.yaml

--models-dir serves every Hugging Face folder (a folder with a config.json) and every .gguf file in DIR,
each named by its folder or file name (without .gguf). --models names them in YAML, each with its own
engine flags (EngineConfig's field names, dashes or underscores) over the command line's:

    chat: /models/Qwen3-0.6B                   # name: path
    coder:
      model: /models/coder.gguf                # or name: {model: path, flag: value, ...}
      max_model_len: 8192
      kv_cache_memory_gb: 0.5
      quantization: int8
      keep_alive: -1                           # this model's default keep_alive

A model's bytes are estimated before it loads (its weight files at the dtype it loads in, and its KV pool),
so that the bound is kept before memory is spent; once loaded, its engine's own figures replace them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from infer.config import EngineConfig
from infer.engine.config_check import gguf_config_json

DEFAULT_KEEP_ALIVE = "5m"  # Ollama's
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp32": 4, "fp16": 2, "bf16": 2}
QUANTIZED_SHARE = {"none": 1.0, "int8": 0.5, "int4": 0.25}  # of a 16-bit weight's bytes
MACHINE_SHARE = 0.8  # --models-memory-gb's default: of the machine's memory


@dataclass(frozen=True)
class ModelSpec:
    """One model the server may load: its name, its engine's flags, its default keep_alive (seconds;
    None: until evicted)."""

    name: str
    engine: EngineConfig
    keep_alive_s: float | None


@dataclass(frozen=True)
class ModelSetArgs:
    """The models of a server that holds several, and the bounds on what stays loaded."""

    specs: tuple[ModelSpec, ...]
    max_loaded: int | None  # --models-max; None: no bound on the count
    max_bytes: int  # --models-memory-gb, in bytes
    keep_alive_s: float | None  # --keep-alive: a request without one, a model without its own


def add_model_set_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several models (llama.cpp's router mode, Ollama's keep_alive)")
    group.add_argument(
        "--models-dir",
        metavar="DIR",
        default=None,
        help="serve every Hugging Face folder and .gguf file in DIR, by folder or file name; each loads "
        "on its first request",
    )
    group.add_argument(
        "--models",
        dest="models_file",
        metavar="FILE.yaml",
        default=None,
        help="serve the models this YAML file names (name: path, or name: {model: path, engine flags})",
    )
    group.add_argument(
        "--models-max",
        type=int,
        metavar="N",
        default=None,
        help="models loaded at once, at most: the least recently used idle one is unloaded first",
    )
    group.add_argument(
        "--models-memory-gb",
        type=float,
        default=None,
        metavar="G",
        help="memory the loaded models may hold (weights + KV pools); None: "
        f"{MACHINE_SHARE * 100:.0f}%% of the machine's",
    )
    group.add_argument(
        "--keep-alive",
        default=DEFAULT_KEEP_ALIVE,
        metavar="DURATION",
        help="how long an idle model stays loaded (Ollama's: '5m', '1h', seconds; 0: unload after each "
        "request; negative: until evicted); a request's keep_alive overrides it",
    )


def model_set_args(args: argparse.Namespace, engine: EngineConfig) -> ModelSetArgs | None:
    """The several-models part of the flags, or None when the server holds one model. ValueError: a bad
    folder, file or value."""
    models_dir, models_file = getattr(args, "models_dir", None), getattr(args, "models_file", None)
    if models_dir is None and models_file is None:
        return None
    if engine.model is not None:
        raise ValueError("--model serves one model; with --models-dir or --models, leave it out")
    if getattr(args, "served_model_name", None) is not None:
        raise ValueError("--served-model-name names the one model; with several, each has its name")
    if engine.tensor_parallel_size > 1 or engine.trace_path is not None:
        raise ValueError("--tensor-parallel-size and --trace serve one model; leave them out")
    keep_alive = parse_keep_alive(args.keep_alive, "--keep-alive")
    found: dict[str, ModelSpec] = {}
    if models_dir is not None:
        for name, path in discover(Path(models_dir).expanduser()):
            found[name] = ModelSpec(name, dataclasses.replace(engine, model=str(path)), keep_alive)
    if models_file is not None:
        for spec in read_models_file(Path(models_file).expanduser(), engine, keep_alive):
            found[spec.name] = spec  # the file's settings win over the folder's plain entry
    if args.models_max is not None and args.models_max < 1:
        raise ValueError(f"--models-max must be >= 1, got {args.models_max}")
    gb = args.models_memory_gb
    if gb is not None and not gb > 0:
        raise ValueError(f"--models-memory-gb must be > 0, got {gb}")
    max_bytes = int(gb * 2**30) if gb is not None else int(MACHINE_SHARE * machine_bytes())
    return ModelSetArgs(tuple(found.values()), args.models_max, max_bytes, keep_alive)


def discover(folder: Path) -> list[tuple[str, Path]]:
    """(name, path) of every model in folder: subfolders with a config.json, and .gguf files."""
    if not folder.is_dir():
        raise ValueError(f"--models-dir {folder} is not a folder")
    found = []
    for path in sorted(folder.iterdir()):
        if path.is_dir() and (path / "config.json").is_file():
            found.append((path.name, path))
        elif path.is_file() and path.suffix == ".gguf":
            found.append((path.stem, path))
    if not found:
        raise ValueError(f"--models-dir {folder} holds no model (a folder with config.json, or a .gguf)")
    return found


def read_models_file(path: Path, engine: EngineConfig, keep_alive: float | None) -> list[ModelSpec]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read --models {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"--models {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict) or not data:
        raise ValueError(f"--models {path} must map model names to paths (or to {{model: path, ...}})")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    specs = []
    for name, entry in data.items():
        where = f"--models {path}: {name}"
        entry = {"model": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise ValueError(f"{where}: give a path, or a mapping with `model: path`")
        flags = {str(k).replace("-", "_"): v for k, v in entry.items()}
        own_keep_alive = keep_alive
        if "keep_alive" in flags:
            own_keep_alive = parse_keep_alive(flags.pop("keep_alive"), f"{where}: keep_alive")
        unknown = sorted(set(flags) - fields)
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; keys are the engine flags' names")
        if not Path(flags["model"]).expanduser().is_absolute():  # relative to the file, as a user reads it
            flags["model"] = str(path.parent / flags["model"])
        try:
            specs.append(ModelSpec(str(name), dataclasses.replace(engine, **flags), own_keep_alive))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
    return specs


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value, where: str = "keep_alive") -> float | None:
    """Ollama's keep_alive as seconds: a number of seconds or a duration ('5m', '1h30m', '300ms'); 0
    unloads after the request; a negative value keeps the model until evicted (None)."""
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a duration such as '5m' or a number of seconds, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(
                    f"{where} must be a duration such as '5m', '1h30m' or a number of seconds, got {value!r}"
                ) from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"{where} must be finite, got {value!r}")
    return None if seconds < 0 else seconds


def machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def estimated_bytes(engine: EngineConfig) -> int:
    """What loading this model will hold: its weights (the files' bytes at the dtype it loads in, less
    for weight-only quantization) and its KV pool (the engine sizes it from kv_cache_memory_gb, or from
    num_kv_blocks). A preset, a hub id or a dummy load has no files here: its weights count 0."""
    path = Path(engine.model).expanduser() if engine.model else None
    config = _config_json(path)
    weights = _weight_file_bytes(path) if engine.load_format != "dummy" else 0
    stored = DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype")), 2)
    loaded = DTYPE_BYTES.get(engine.dtype, stored)
    if path is not None and path.suffix != ".gguf":
        weights = weights * loaded // stored
    weights = int(weights * QUANTIZED_SHARE.get(engine.quantization, 1.0))
    if engine.num_kv_blocks is None:
        kv = int(engine.kv_cache_memory_gb * 2**30)
    else:
        kv = engine.num_kv_blocks * engine.block_size * _kv_bytes_per_token(config, engine, loaded)
    return weights + kv


def _config_json(path: Path | None) -> dict:
    if path is not None and path.suffix == ".gguf" and path.is_file():
        return gguf_config_json(path)
    try:
        return json.loads((path / "config.json").read_text()) if path and path.is_dir() else {}
    except (OSError, ValueError):
        return {}  # a broken folder: its load will say why


def _weight_file_bytes(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def _kv_bytes_per_token(config: dict, engine: EngineConfig, dtype_bytes: int) -> int:
    """Keys and values of one token over every layer (as the engine's kv_bytes_per_token); a GGUF file's
    shape comes from its metadata; without a shape, a 4096-wide, 32-layer model stands in."""
    text = config.get("text_config", config)
    layers = text.get("num_hidden_layers", 32)
    heads = text.get("num_attention_heads", 32)
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text.get("hidden_size", 4096) // heads
    if engine.kv_cache_dtype.startswith("fp8"):
        dtype_bytes = 1
    return 2 * layers * kv_heads * head_dim * dtype_bytes
