"""RopeConfig: the rotary embedding's base and frequency scaling, as the rotary code takes it.

Pure data (no torch), so that models/config.py can build it from a config.json and layers/rotary.py can
read it without the layers importing the models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

YARN_FLOATS = ("beta_fast", "beta_slow", "attention_factor")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    # llama3 scaling only: how the original context's frequencies are stretched
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    # yarn only (transformers' names and defaults): the rotations per original context above which a
    # frequency is kept (beta_fast) and below which it is divided by `factor` (beta_slow), and the
    # factor on cos and sin (None: 0.1 ln(factor) + 1)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    # one divisor per frequency, applied after the above: how a GGUF file stores Llama 3.1's scaling
    freq_factors: tuple[float, ...] | None = None

    SUPPORTED = ("default", "linear", "llama3", "yarn")

    def __post_init__(self):
        if self.rope_type not in self.SUPPORTED:
            raise ValueError(
                f"rope scaling type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(self.SUPPORTED)}"
            )

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, theta: float) -> RopeConfig:
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        kw: dict[str, Any] = {"theta": float(params.get("rope_theta", theta)), "rope_type": rope_type}
        for key in ("factor", "low_freq_factor", "high_freq_factor") + YARN_FLOATS:
            if params.get(key) is not None:
                kw[key] = float(params[key])
        if params.get("original_max_position_embeddings") is not None:
            kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        if rope_type == "yarn" and (params.get("mscale") or params.get("mscale_all_dim")):
            raise ValueError("yarn rope scaling with mscale / mscale_all_dim is not supported")
        if rope_type == "yarn" and params.get("truncate") is False:
            raise ValueError("yarn rope scaling with truncate=false is not supported")
        return cls(**kw)
