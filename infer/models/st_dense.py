"""sentence-transformers' Dense modules: a pooled vector mapped through `activation(W x + b)` (plus x, or
a projection of x, with `use_residual`), as sentence_transformers.models.Dense computes it.

modules.json lists them after the Pooling module and before Normalize (a folder such as `2_Dense` with
its config.json: in_features, out_features, bias, activation_function; and its weights: `linear.weight`,
`linear.bias`, `residual.weight` in model.safetensors or pytorch_model.bin). Some models project their
embedding to another size this way (1792 from a 1024 encoder, or down to 256).

They run in float32 on the pooled vectors, whatever the model's dtype: a few small matrices per batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# sentence-transformers saves the activation as the class's full name
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch.nn.modules.activation.Tanh": torch.tanh,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.ReLU": F.relu,
    "torch.nn.modules.activation.GELU": F.gelu,
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
    "torch.nn.modules.activation.SiLU": F.silu,
}
SENTENCE_EMBEDDING = "sentence_embedding"  # the feature a Dense module reads and writes by default


@dataclass(frozen=True)
class DenseLayer:
    weight: torch.Tensor  # [out_features, in_features] float32
    bias: torch.Tensor | None  # [out_features]
    activation: Callable[[torch.Tensor], torch.Tensor]
    use_residual: bool = False
    residual: torch.Tensor | None = None  # [out_features, in_features]: x's projection when sizes differ

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[num_seqs, in_features] -> [num_seqs, out_features]."""
        out = self.activation(F.linear(x, self.weight, self.bias))
        if self.use_residual:
            out = out + (x if self.residual is None else F.linear(x, self.residual))
        return out


def load_dense(folder: Path) -> DenseLayer:
    """One Dense module's folder. ValueError for what sentence-transformers' Dense would not compute
    the way this does (another input or output feature, an activation not in ACTIVATIONS)."""
    config = json.loads((folder / "config.json").read_text())
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in (None, SENTENCE_EMBEDDING):
            raise ValueError(f"{folder}: a Dense module over {config[key]!r} is not supported")
    name = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if name not in ACTIVATIONS:
        raise ValueError(
            f"{folder}: Dense activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        )
    tensors = _read_weights(folder)
    shape = (config["out_features"], config["in_features"])
    weight = tensors["linear.weight"].float()
    if tuple(weight.shape) != shape:
        raise ValueError(f"{folder}: linear.weight is {list(weight.shape)}, its config says {list(shape)}")
    bias = tensors["linear.bias"].float() if config.get("bias", True) else None
    residual = tensors.get("residual.weight")
    return DenseLayer(
        weight,
        bias,
        ACTIVATIONS[name],
        bool(config.get("use_residual", False)),
        residual.float() if residual is not None else None,
    )


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(folder / "model.safetensors")
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{folder}: a Dense module without model.safetensors or pytorch_model.bin")


class DenseStack:
    """The Dense modules of a model, applied in the order modules.json lists them."""

    def __init__(self, path: Path, folders: tuple[str, ...]):
        self.layers = [load_dense(path / folder) for folder in folders]

    @property
    def out_features(self) -> int:
        """The size of the embeddings it returns."""
        return self.layers[-1].weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
