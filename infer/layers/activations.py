"""Activation functions by their config.json names, and the gated product of Llama-style MLPs.

`gated_act` runs SiLU-and-multiply as one C++ pass where infer/kernels serves the tensor (layer_ops.cpp;
docs/optimizations.md, "C++ layer ops"), torch's two ops elsewhere and for other activations.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from infer import kernels

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_fast": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        supported = ", ".join(ACTIVATIONS)
        raise ValueError(f"activation {name!r} is not supported; supported: {supported}") from None


def gated_act(act, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for gate_up = [gate | up] along the last dim (two halves), in gate_up's dtype."""
    if act is F.silu and gate_up.dim() == 2 and gate_up.shape[1] % 32 == 0:
        ops = kernels.layer_ops(gate_up)
        if ops is not None:
            return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
