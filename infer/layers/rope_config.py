"""RopeConfig: the rotary embedding's base and frequency scaling, as the rotary code takes it.

Pure data (no torch), so that models/config.py can build it from a config.json and layers/rotary.py can
read it without the layers importing the models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    # llama3 scaling only: how the original context's frequencies are stretched
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # one divisor per frequency, applied after the above: how a GGUF file stores Llama 3.1's scaling
    freq_factors: tuple[float, ...] | None = None

    SUPPORTED = ("default", "linear", "llama3")

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
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if params.get(key) is not None:
                kw[key] = float(params[key])
        if params.get("original_max_position_embeddings") is not None:
            kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        return cls(**kw)
