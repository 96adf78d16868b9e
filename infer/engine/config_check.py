"""What an EngineConfig must pass before its model loads, checked without loading it.

`infer serve` calls this while it parses its flags, so that an impossible combination, a bad GGUF file or
an unreadable SLO file exits with code 2 at once rather than after the weights have loaded.
"""

from __future__ import annotations

from pathlib import Path

from infer.config import EngineConfig, check_local_ranks
from infer.core.slo import SloClasses


def check_engine_config(config: EngineConfig) -> None:
    """Raises ValueError, with a message a user can act on, for what would fail at load or at start."""
    config.scheduler_config(config.max_model_len or 1)
    check_local_ranks(config.tensor_parallel_size)
    from infer.models.loader import check_model_files  # torch: only once there is a model to check

    check_model_files(config.model, config.load_format)  # a GGUF file's header and tensor table
    if config.slo_config is not None:
        SloClasses.from_file(config.slo_config)
    config.cache_config(config.num_kv_blocks or 1)


def gguf_config_json(path: Path) -> dict:
    """The config.json a GGUF file's metadata amounts to (its shape, for sizing before a load); {} for a
    file that cannot load (its load will say why)."""
    from infer.models.gguf import hf_config, open_gguf  # the gguf reader and torch: only for a GGUF file

    try:
        return hf_config(open_gguf(path))
    except (OSError, ValueError):
        return {}
