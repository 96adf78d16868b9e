"""infer: an LLM inference server and serving-benchmark lab."""

__version__ = "0.1.0"
