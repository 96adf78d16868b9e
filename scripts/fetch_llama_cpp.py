"""Fetch llama.cpp's model converter (convert_hf_to_gguf.py, pure Python) for the GGUF tests.

It ships in the source distribution of `llama-cpp-python` on PyPI, under vendor/llama.cpp/, with the
`gguf-py` package and `conversion/` modules it imports. This downloads that sdist with pip (nothing is
built), keeps only those files and prints the folder holding convert_hf_to_gguf.py. Run again, it finds
them and downloads nothing.

    python scripts/fetch_llama_cpp.py            # -> ~/.cache/infer/llama.cpp/<version>/
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's; the tests were written against this converter
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")


def converter_dir(cache: Path | None = None) -> Path:
    cache = cache or Path(os.environ.get("INFER_LLAMA_CPP_CACHE", Path.home() / ".cache/infer/llama.cpp"))
    return cache / VERSION


def fetch(cache: Path | None = None) -> Path:
    """The folder holding convert_hf_to_gguf.py, downloaded and unpacked if not there yet."""
    target = converter_dir(cache)
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # beside target: the rename stays atomic
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            + ["-d", tmp, f"llama-cpp-python=={VERSION}"],
            check=True,
        )
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        staging = Path(tmp) / "out"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                inner = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and inner.startswith(KEEP) and member.isfile():
                    member.name = inner
                    tar.extract(member, staging, filter="data")
        staging.rename(target)  # whole or not at all: a half-unpacked folder is never left
    return target


if __name__ == "__main__":
    print(fetch())
