"""Benchmarks of the engine: in-process micro-benchmarks (`infer.bench.micro`) and serving benchmarks."""

import importlib.util

# The bench client's libraries: the `bench` extra, not needed to serve.
REQUIREMENTS = ("aiohttp", "httpx", "matplotlib", "tqdm")


def missing_requirement() -> str | None:
    """The first of the bench extra's libraries that is not installed, or None."""
    return next((name for name in REQUIREMENTS if importlib.util.find_spec(name) is None), None)
