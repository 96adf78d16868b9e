"""Model shapes shipped with infer: the Hugging Face `config.json` of the models we serve and benchmark.

A preset lets the engine build a model with random weights (tests, CPU performance work, memory sizing)
without downloading anything. Each lives in `infer/assets/presets/<name>/config.json`; where its values
came from is written down in `infer/assets/presets/README.md`.

    preset_config("Qwen3-0.6B")                          # the folder name, any case
    preset_config("meta-llama/Llama-3.2-1B-Instruct")    # a Hugging Face id (Instruct shares the base shape)
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

PRESETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "presets"

# Hugging Face ids (and their bare names) -> preset folder. Instruct models have the base model's shape;
# their config.json differs only in eos_token_id, which the tokenizer folder supplies anyway.
_HF_IDS = {
    "meta-llama/Llama-3.2-1B": "Llama-3.2-1B",
    "meta-llama/Llama-3.2-1B-Instruct": "Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B": "Llama-3.2-3B",
    "meta-llama/Llama-3.2-3B-Instruct": "Llama-3.2-3B",
    "Qwen/Qwen3-0.6B": "Qwen3-0.6B",
    "Qwen/Qwen3-4B": "Qwen3-4B",
    "google/gemma-3-1b-it": "gemma-3-1b-it",
}


@cache
def list_presets() -> tuple[str, ...]:
    """The preset folder names, sorted case-insensitively."""
    names = [p.name for p in PRESETS_DIR.iterdir() if (p / "config.json").is_file()]
    return tuple(sorted(names, key=str.lower))


@cache
def _lookup() -> dict[str, str]:
    """lowercase name -> folder, for folder names, HF ids and HF ids without their organisation."""
    table = {name.lower(): name for name in list_presets()}
    for hf_id, name in _HF_IDS.items():
        table[hf_id.lower()] = name
        table.setdefault(hf_id.split("/", 1)[1].lower(), name)
    return table


@cache
def _load(name: str) -> dict[str, Any]:
    return json.loads((PRESETS_DIR / name / "config.json").read_text(encoding="utf-8"))


def preset_config(name: str) -> dict[str, Any] | None:
    """The config.json dict of preset `name` (folder name or HF id, any case), or None if unknown.

    Returns a fresh copy: the caller may modify it.
    """
    folder = _lookup().get(name.strip().lower())
    return None if folder is None else copy.deepcopy(_load(folder))


def preset_path(name: str) -> Path | None:
    """The folder holding preset `name`'s config.json, or None if unknown."""
    folder = _lookup().get(name.strip().lower())
    return None if folder is None else PRESETS_DIR / folder


def preset_names() -> tuple[str, ...]:
    """Every accepted spelling (lowercased), for error messages and CLI completion."""
    return tuple(sorted(_lookup()))
