"""Benchmarks of the engine: in-process micro-benchmarks (`infer.bench.micro`) and serving benchmarks."""
