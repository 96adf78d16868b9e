"""A GGUF file of a folder that scripts/make_dummy_model.py wrote, by llama.cpp's own converter
(convert_hf_to_gguf.py, fetched by scripts/fetch_llama_cpp.py), for races against llama-server:

    python scripts/dummy_gguf.py /work/models/llama-1b /work/models/llama-1b-Q8_0.gguf --outtype q8_0

The folder's tokenizer (the embedded model's recipe: byte-level BPE) is one the converter does not know
by its hash; it is declared as GPT-2's pre-tokenizer, which it is.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.models.gguf_files import convert  # noqa: E402 (the tests' driver of the converter)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--outtype", default="q8_0", help="f32, f16, bf16 or q8_0 (the converter's)")
    args = p.parse_args()
    convert([{"model": str(args.folder), "out": str(args.out), "outtype": args.outtype, "pre": "gpt-2"}])
    print(args.out)


if __name__ == "__main__":
    main()
