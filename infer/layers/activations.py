"""Activation functions by their config.json names."""

from __future__ import annotations

import functools

import torch.nn.functional as F

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
