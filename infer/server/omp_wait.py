"""A pooling model's server lets torch's OpenMP threads sleep as soon as they wait (OMP_WAIT_POLICY=PASSIVE).

torch's OpenMP (libgomp) makes a thread that reaches the end of a parallel region spin for its team
before it sleeps. A pooling forward is a few large regions per op and layer (an 8,192-token BERT layer's
GEMMs take milliseconds each), so sleeping costs it a wake-up per region, noise beside the region; but
on cores that other processes also run, spinning threads take the time the team's slowest thread needs
to finish: BGE-small's shape, 64 texts of 128 tokens in-process, ran 1.37x the docs/s with PASSIVE,
alternated on a loaded 2-core Sapphire Rapids. A generation server keeps the default: a decode step's
regions last microseconds, and waking a sleeping thread for each would cost the step more than it saves.

libgomp reads the variable once, when torch loads it, so it is set here before torch is imported, and
only where the user has not set it; `prefer_passive_wait` says whether it did.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from infer.engine.pooling_architectures import pooling_task

WAIT_POLICY = "OMP_WAIT_POLICY"


def serves_pooling(model: str | None, runner: str, hf_overrides: dict | str | None = None) -> bool:
    """Whether `model` (a local folder) runs as a pooling model under `runner`, from its config.json and
    --hf-overrides' architectures; False where that cannot be told without loading it (hub ids, GGUF)."""
    if runner == "pooling":
        return True
    if runner == "generate" or not model:
        return False
    path = Path(model).expanduser() / "config.json"
    try:
        architectures = json.loads(path.read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return False
    overrides = json.loads(hf_overrides) if isinstance(hf_overrides, str) else hf_overrides
    if isinstance(overrides, dict) and overrides.get("architectures"):
        architectures = overrides["architectures"]
    if not isinstance(architectures, list) or not architectures:
        return False
    try:
        return pooling_task(str(architectures[0]), runner) is not None
    except ValueError:
        return False


def prefer_passive_wait(model: str | None, runner: str, hf_overrides: dict | str | None = None) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE for a pooling model's server process; True where it did. Nothing
    where the user set the variable, or torch (and with it libgomp) is already loaded."""
    if WAIT_POLICY in os.environ or "torch" in sys.modules:
        return False
    try:
        pooling = serves_pooling(model, runner, hf_overrides)
    except ValueError:  # a bad --hf-overrides: its own check reports it
        return False
    if pooling:
        os.environ[WAIT_POLICY] = "PASSIVE"
    return pooling
