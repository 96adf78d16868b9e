"""The `infer` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="model folder, hub id, preset (see `infer presets`) or GGUF file; default: the embedded model",
    )
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer folder instead of the model's")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="dummy: random weights in the model's shape (presets need no download)",
    )
    p.add_argument("--seed", type=int, default=0)


def cmd_generate(args) -> int:
    import time

    from infer.engine.llm import LLM
    from infer.sampling_params import SamplingParams

    llm = LLM(
        args.model, tokenizer=args.tokenizer, dtype=args.dtype, load_format=args.load_format, seed=args.seed
    )
    if llm.engine is None:
        print(
            f"infer generate: {args.model} is a pooling model (embeddings, scores): serve it with "
            "`infer serve` for /v1/embeddings, /score and /rerank, or use LLM.embed / LLM.score",
            file=sys.stderr,
        )
        return 2
    tokenizer = llm.engine.tokenizer
    prompt = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        prompt = tokenizer.encode(text, add_special_tokens=False)  # the template already holds BOS
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, seed=args.seed
    )
    start = time.perf_counter()
    (result,) = llm.generate(prompt, params)
    elapsed = time.perf_counter() - start
    print(result.text)
    print(
        f"[{result.num_prompt_tokens} prompt + {len(result.token_ids)} generated tokens in {elapsed:.2f}s, "
        f"finish_reason={result.finish_reason}, {llm.engine.model_config.architecture}, "
        f"{llm.engine.runner.dtype}]",
        file=sys.stderr,
    )
    return 0


def cmd_presets(args) -> int:
    from infer.models.presets import list_presets

    for name in list_presets():
        print(name)
    return 0


def cmd_serve(args) -> int:
    # Parsed again, so that --config FILE.yaml gives the defaults and flags override it.
    return serve(args.argv[args.argv.index("serve") + 1 :])


def serve(argv: list[str], prog: str = "infer serve") -> int:
    """One engine in this process (infer.server), or `--replicas N` of them on Ray Serve (infer.deploy)."""
    from infer.deploy.args import add_replica_args, replica_args
    from infer.server.args import add_server_args, parse_server_args

    parser = argparse.ArgumentParser(
        prog=prog,
        description="OpenAI-compatible LLM inference server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_server_args(parser, positional_model=True)
    add_replica_args(parser)
    try:
        server_args = parse_server_args(parser, argv)
        replicas = replica_args(parser.parse_args(argv))  # --config's values are the defaults by now
        if replicas is not None and server_args.models is not None:
            raise ValueError("--replicas serves one model; leave out --models-dir and --models")
        if replicas is not None:  # N engine replicas on Ray Serve (the `ray` extra)
            try:
                from infer.deploy.app import run as run_replicas
            except ImportError as exc:
                raise ValueError(f"--replicas needs Ray Serve: pip install 'infer[ray]' ({exc})") from exc
            return run_replicas(server_args, replicas)
    except ValueError as exc:  # bad flag values or config file: say what to do, no traceback
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from infer.server.launch import run

    return run(server_args)


def add_missing_extra_parser(sub, name: str, help: str, extra: str, missing: str) -> None:
    """A subcommand whose optional extra is not installed: it takes any arguments and says what to install."""
    install = f"pip install 'infer[{extra}]'"
    p = sub.add_parser(name, help=f"{help} (needs `{install}`)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)

    def missing_extra(args) -> int:
        print(
            f"infer {name}: needs the `{extra}` extra ({missing} is not installed): {install}",
            file=sys.stderr,
        )
        return 2

    p.set_defaults(func=missing_extra)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    add_model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=cmd_generate)

    from infer.server.args import add_server_args

    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible server (flags as python -m infer.server)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_server_args(serve, positional_model=True)
    from infer.deploy.args import add_replica_args

    add_replica_args(serve)  # --replicas N: infer.deploy (Ray Serve, an optional extra)
    serve.set_defaults(func=cmd_serve)

    from infer.bench.cli import add_bench_parsers, missing_requirement

    missing = missing_requirement()
    if missing is None:
        add_bench_parsers(sub)
    else:
        add_missing_extra_parser(sub, "bench", "benchmarks against a server", extra="bench", missing=missing)

    presets = sub.add_parser("presets", help="list the model presets usable with --load-format dummy")
    presets.set_defaults(func=cmd_presets)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["serve"]:  # a server process, not a call from Python
        from infer.server.tcmalloc import reexec_with_tcmalloc

        reexec_with_tcmalloc()
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: say what to do, no traceback
        print(f"infer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
