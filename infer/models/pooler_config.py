"""What a pooling model returns, read from its folder: which pooler, whether normalised, which Matryoshka
dimensions, which activation a cross-encoder's score takes.

In the order of precedence:
  - vLLM's `--pooler-config` JSON (`{"pooling_type": "MEAN", "normalize": false}`): an override.
  - sentence-transformers' files: `modules.json` lists the modules after the transformer; its Pooling
    module's `config.json` (`1_Pooling/config.json`) names the mode (`"pooling_mode": "cls"`, or the older
    `"pooling_mode_cls_token": true` flags), Dense modules map the pooled vector (`2_Dense`:
    infer.models.st_dense), a Normalize module means unit-length vectors. A cross-encoder's
    `config.json` may name its activation (`sentence_transformers.activation_fn`).
  - The model's kind: BERT-family embedders pool CLS, decoders LAST (vLLM's defaults); normalised.
A cross-encoder's score is its classifier's logit through a sigmoid when it has one label, as
sentence-transformers' CrossEncoder.predict computes it; `use_activation: false` returns the logit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# sentence-transformers' pooling modes -> vLLM's pooling types
ST_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
ST_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
OVERRIDE_KEYS = ("pooling_type", "normalize", "use_activation")
EMBED, CLASSIFY = "embed", "classify"


@dataclass(frozen=True)
class PoolerConfig:
    task: str  # EMBED (/v1/embeddings, and /score as cosine similarity) or CLASSIFY (a cross-encoder)
    pooling_type: str = "CLS"  # infer.layers.pooler.POOLING_TYPES; a cross-encoder reads the first token
    normalize: bool = True
    # Matryoshka: whether `dimensions` may cut the embedding, and to which sizes (None: any)
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    use_activation: bool = True  # a cross-encoder's sigmoid (with one label)
    # sentence-transformers' Dense modules after the pooler (infer.models.st_dense), their folders in order
    dense_folders: tuple[str, ...] = ()

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """ValueError (a 400) for a `dimensions` this model cannot return."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError(
                "this model does not support Matryoshka embeddings: `dimensions` would cut its vectors to "
                "meaningless ones; leave it out"
            )
        if dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {dimensions}")
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise ValueError(f"this model supports dimensions {list(allowed)} only, got {dimensions}")
        if dimensions > hidden_size:
            raise ValueError(f"dimensions must be <= {hidden_size} (the model's), got {dimensions}")


def read_pooler_config(
    path: Path,
    hf_config: dict[str, Any],
    task: str,
    decoder: bool,
    override: str | None = None,
    num_labels: int | None = None,
) -> PoolerConfig:
    """The pooler of the model in folder `path` (see the module docstring). ValueError for a
    sentence-transformers pipeline or an override that cannot be served. `num_labels`: a classifier's,
    where config.json does not say it (a score head built from an LM head's rows)."""
    fields: dict[str, Any] = {"task": task, "pooling_type": "LAST" if decoder else "CLS", "normalize": True}
    if task == EMBED:
        fields |= _sentence_transformers(path)
    else:
        fields["use_activation"] = _cross_encoder_activation(hf_config, num_labels)
    dims = hf_config.get("matryoshka_dimensions")
    fields["is_matryoshka"] = bool(hf_config.get("is_matryoshka") or dims)
    fields["matryoshka_dimensions"] = tuple(int(d) for d in dims) if dims else None
    if override:
        fields |= _override(override)
    return PoolerConfig(**fields)


def _sentence_transformers(path: Path) -> dict[str, Any]:
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    found: dict[str, Any] = {"normalize": False}
    dense: list[str] = []
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            found["pooling_type"] = _st_pooling_type(path / module.get("path", ""))
        elif kind == "Dense":
            if found["normalize"]:  # the vector is normalised last (layers.pooler): Dense must come first
                raise ValueError(f"{path.name}: a Dense module after Normalize is not supported")
            dense.append(module.get("path", ""))
        elif kind == "Normalize":
            found["normalize"] = True
        elif kind not in ("Transformer", "Router"):
            raise ValueError(
                f"{path.name}: the sentence-transformers module {module.get('type')!r} is not supported "
                "(Transformer, Pooling, Dense and Normalize are)"
            )
    return found | ({"dense_folders": tuple(dense)} if dense else {})


def _st_pooling_type(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [name for flag, name in ST_LEGACY_FLAGS.items() if config.get(flag)]
    if isinstance(mode, list):
        if len(mode) != 1:
            raise ValueError(
                f"{folder}: pooling modes {mode} together are not supported; one of {list(ST_MODES)}"
            )
        mode = mode[0]
    if mode not in ST_MODES:
        raise ValueError(
            f"{folder}: pooling mode {mode!r} is not supported; supported: {', '.join(ST_MODES)}"
        )
    return ST_MODES[mode]


def _cross_encoder_activation(hf_config: dict[str, Any], num_labels: int | None = None) -> bool:
    """sentence-transformers' CrossEncoder: a sigmoid with one label unless its config names another."""
    saved = (hf_config.get("sentence_transformers") or {}).get("activation_fn")
    if saved is not None:
        return not saved.endswith("Identity")
    if num_labels is None:
        num_labels = (
            len(hf_config["id2label"]) if hf_config.get("id2label") else hf_config.get("num_labels", 2)
        )
    return num_labels == 1


def _override(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--pooler-config is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError('--pooler-config must be a JSON object, e.g. \'{"pooling_type": "MEAN"}\'')
    unknown = set(value) - set(OVERRIDE_KEYS)
    if unknown:
        raise ValueError(
            f"--pooler-config: unknown keys {sorted(unknown)}; known: {', '.join(OVERRIDE_KEYS)}"
        )
    fields = {k: v for k, v in value.items() if v is not None}
    if "pooling_type" in fields:
        fields["pooling_type"] = str(fields["pooling_type"]).upper()
        if fields["pooling_type"] not in ST_MODES.values():
            raise ValueError(f"--pooler-config: pooling_type must be one of {', '.join(ST_MODES.values())}")
    return fields
