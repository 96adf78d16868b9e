"""`python -m infer.server --model MODEL [flags]`: one engine in this process; see infer.server.args for
the flags. `infer serve` takes the same flags and also `--replicas N` (infer.deploy)."""

from __future__ import annotations

import argparse
import sys

from infer.server.args import add_server_args, parse_server_args


def main(argv: list[str] | None = None, prog: str = "python -m infer.server", positional_model=False) -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="OpenAI-compatible LLM inference server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_server_args(parser, positional_model)
    try:
        args = parse_server_args(parser, argv)
    except ValueError as exc:  # bad flag values or config file: say what to do, no traceback
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from infer.server.launch import run

    return run(args)


if __name__ == "__main__":
    from infer.server.tcmalloc import reexec_with_tcmalloc

    reexec_with_tcmalloc()
    sys.exit(main())
