"""`python -m infer.server --model MODEL [flags]`: see infer.server.args for the flags."""

from __future__ import annotations

import argparse
import sys

from infer.deploy.args import add_replica_args, replica_args
from infer.server.args import add_server_args, parse_server_args


def main(argv: list[str] | None = None, prog: str = "python -m infer.server", positional_model=False) -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="OpenAI-compatible LLM inference server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_server_args(parser, positional_model)
    add_replica_args(parser)
    try:
        args = parse_server_args(parser, argv)
        replicas = replica_args(parser.parse_args(argv))  # --config's values are the defaults by now
        if replicas is not None and args.models is not None:
            raise ValueError("--replicas serves one model; leave out --models-dir and --models")
        if replicas is not None:  # N engine replicas on Ray Serve (the `ray` extra), infer.deploy
            try:
                from infer.deploy.app import run as run_replicas
            except ImportError as exc:
                raise ValueError(f"--replicas needs Ray Serve: pip install 'infer[ray]' ({exc})") from exc
            return run_replicas(args, replicas)
    except ValueError as exc:  # bad flag values or config file: say what to do, no traceback
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from infer.server.launch import run

    return run(args)


if __name__ == "__main__":
    from infer.server.tcmalloc import reexec_with_tcmalloc

    reexec_with_tcmalloc()
    sys.exit(main())
