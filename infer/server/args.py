"""Server flags: vLLM's names where vLLM has the flag (with aliases beside some: `--max-batch-size` for
`--max-num-seqs`), an optional YAML file with the same keys, and their mapping onto `EngineConfig`.

    python -m infer.server --model MODEL --max-batch-size 8 --num-gpu-blocks 2048 --prefix-caching
    infer serve MODEL --config serve.yaml --port 8001        # flags override the file

In the YAML file a key is a flag's long name, with dashes or underscores (`max-batch-size: 8`,
`prefix_caching: false`). Defaults are the best configuration: continuous batching over a paged cache with
chunked prefill and prefix caching.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from infer.config import (
    BATCHING_MODES,
    KV_CACHE_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    POLICIES,
    QUANTIZATION_METHODS,
    RUNNERS,
    EngineConfig,
)
from infer.server.auth import check_keys, owner_of, read_key_file, split_keys
from infer.server.model_specs import ModelSetArgs, add_model_set_args, model_set_args
from infer.server.reasoning import REASONING_PARSERS
from infer.server.tool_parsers import TOOL_PARSERS

_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


@dataclass(frozen=True)
class ServerArgs:
    """What the server needs beyond the engine's configuration."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the --model string, or "embedded"
    # the SHA-256 of each API key (the raw keys are not kept); none: the API is open (infer.server.auth)
    api_key_owners: tuple[str, ...] = field(default=(), repr=False)
    max_queued_requests: int = 1024
    max_request_bytes: int = 4 * 2**20  # a 4 MiB body holds ~1M tokens of text, beyond any context here
    header_timeout: float = 5.0  # to send a request's headers (nginx: 60 s; a client sends them at once)
    # an idle connection kept this long: beyond the 5 s after which httpx (the openai client) drops its
    # own, so that the client closes first and never sends a request into the server's close
    timeout_keep_alive: float = 20.0
    trust_request_chat_template: bool = False
    responses_store_mb: int = 64  # /v1/responses kept for GET and previous_response_id
    drain_timeout: float = 30.0
    cuda_graphs: bool = False
    log_level: str = "info"
    tool_call_parser: str | None = None  # tool_choice "auto" reads calls out of the text (tool_parsers)
    reasoning_parser: str | None = None  # <think>...</think> as reasoning_content (infer.server.reasoning)
    # CORS, vLLM's flags and defaults: browsers may call the API from any page ("*")
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    models: ModelSetArgs | None = None  # several models (infer.server.model_specs); None: the one engine

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model or "embedded"


def add_server_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """Add every server flag to `parser` (used by `python -m infer.server` and `infer serve`)."""
    d = _ENGINE_DEFAULTS
    bool_flag = argparse.BooleanOptionalAction
    if positional_model:
        parser.add_argument("model_arg", nargs="?", metavar="MODEL", help="same as --model")
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file with the same keys as the flags")
    parser.add_argument(
        "--model", default=None, help="model folder, hub id, preset or GGUF file; default: embedded"
    )
    parser.add_argument(
        "--tokenizer",
        default=d["tokenizer"],
        metavar="DIR",
        help="tokenizer folder to use instead of the model's own (e.g. the original of a GGUF file)",
    )
    parser.add_argument("--served-model-name", default=None, help="the name clients send as `model`")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--api-key",
        action=_Keys,
        default=None,
        metavar="KEY[,KEY...]",
        help="require `Authorization: Bearer KEY` on /v1 with one of these keys (comma-separated, "
        "repeatable); a response stored through /v1/responses answers only the key that stored it",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="FILE",
        default=None,
        help="more keys, one a line (blank lines and # comments left out), as --api-key",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="waiting requests beyond this get 429 with Retry-After",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=ServerArgs.max_request_bytes,
        help="larger request bodies get 413 before they are read whole",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=ServerArgs.header_timeout,
        help="seconds a client may take to send a request's headers; past it the connection is closed",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=ServerArgs.timeout_keep_alive,
        help="seconds an idle connection is kept open for the client's next request",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action=bool_flag,
        default=False,
        help="let requests send their own chat template (chat_template_kwargs.chat_template); off: 400",
    )
    parser.add_argument(
        "--grammar-cache-mb",
        type=int,
        default=d["grammar_cache_mb"],
        help="memory for compiled structured-output grammars (estimated), least recently used out first",
    )
    parser.add_argument(
        "--max-grammar-compilations",
        type=int,
        default=d["max_grammar_compilations"],
        help="structured-output grammars compiled at once, each on a thread of its own",
    )
    parser.add_argument(
        "--max-queued-grammars",
        type=int,
        default=d["max_queued_grammars"],
        help="distinct grammars waiting to compile beyond those compiling; more get 429 with Retry-After",
    )
    parser.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=d["grammar_compile_timeout"],
        help="seconds one grammar may take to compile; its requests then get 400",
    )
    parser.add_argument(
        "--responses-store-mb",
        type=int,
        default=ServerArgs.responses_store_mb,
        help="memory for stored /v1/responses (GET, previous_response_id), oldest out first; 0: none kept",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let running requests finish before aborting them",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='vLLM\'s: with tools and tool_choice "auto", read the calls the model writes out of its text '
        "(needs --tool-call-parser)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="vLLM's: how the model writes a call: hermes (Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1, "
        "3.2), mistral, pythonic (Llama 3.2 1B/3B)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="vLLM's: the model's <think>...</think> as the message's reasoning_content, apart from the "
        "answer (qwen3: Qwen3, SmolLM3; deepseek_r1: DeepSeek-R1 and its distills)",
    )
    for flag, what in (
        ("origins", "pages (origins)"),
        ("methods", "HTTP methods"),
        ("headers", "request headers"),
    ):
        parser.add_argument(
            f"--allowed-{flag}",
            type=string_list,
            default=["*"],
            metavar='\'["A", "B"]\'|A,B',
            help=f"vLLM's CORS flag: the {what} a browser may call the API with, a JSON list or "
            "comma-separated ('*': any)",
        )
    parser.add_argument(
        "--allow-credentials",
        action="store_true",
        help="vLLM's CORS flag: browsers may send cookies and HTTP authentication along",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="debug logs every request",
    )
    parser.add_argument(
        "--dtype",
        default=d["dtype"],
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache",
    )
    parser.add_argument(
        "--load-format",
        default=d["load_format"],
        choices=list(LOAD_FORMATS),
        help="dummy: random weights in the model's shape; auto reads safetensors or GGUF by the path",
    )
    parser.add_argument(
        "--runner",
        default=d["runner"],
        choices=list(RUNNERS),
        help="pooling: serve embeddings and scores (/v1/embeddings, /score, /rerank) instead of text; auto "
        "does for encoders (BERT, XLM-RoBERTa), cross-encoders and a decoder's body saved without its LM "
        "head; a decoder embedder saved as a causal LM (Qwen3-Embedding) needs --runner pooling",
    )
    parser.add_argument(
        "--pooler-config",
        default=d["pooler_config"],
        help="a pooling model's pooler as JSON, over what its sentence-transformers files say: "
        '\'{"pooling_type": "CLS"|"MEAN"|"LAST", "normalize": true|false, "use_activation": true|false}\'',
    )
    parser.add_argument(
        "--hf-overrides",
        default=d["hf_overrides"],
        help="JSON laid over the model's config.json, as vLLM's; Qwen3-Reranker as a reranker: "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true}\'',
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=d["quantization"],
        choices=QUANTIZATION_METHODS,
        help="weight-only, at load: int8 per channel, int4 in groups of 128 (pre-quantized AWQ/GPTQ/"
        "compressed-tensors checkpoints are recognised without it)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=d["kv_cache_dtype"],
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype, or 16 bits where --dtype auto runs float32 activations (a bf16 "
        "checkpoint's bf16, a quantized GGUF file's float16, llama.cpp's default cache); float16 or "
        "bfloat16 under a float32 model: half the bytes, faster decoding at 8 and more streams; fp8 "
        "(= fp8_e4m3) or fp8_e5m2: one byte per cached key and value element, no scale, as vLLM's flag: "
        "twice the tokens, faster long-context decoding",
    )
    parser.add_argument(
        "--seed", type=int, default=d["seed"], help="engine seed (dummy weights, unseeded sampling)"
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        default=d["enforce_eager"],
        help="every forward eager: no decode steps replayed from captured graphs (as vLLM's flag)",
    )
    parser.add_argument(
        "--speculative-config",
        default=d["speculative_config"],
        metavar="JSON",
        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' proposes the tokens that followed an earlier '
        "occurrence of the text's last n tokens and verifies them in one forward; "
        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\' has a small model of the '
        "same vocabulary propose them; "
        '"disable_by_batch_size" (default 4): speculate only while at most that many requests run; '
        '"disable_by_gain" (default true): below that, only at the batch sizes where it measured that '
        "speculating pays",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d["tensor_parallel_size"],
        help="ranks that each hold a shard of every layer, over torch.distributed (gloo): started here, "
        "or by a launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=d["max_model_len"],
        help="prompt + output tokens of one request; default: the model's context",
    )
    parser.add_argument("--block-size", type=int, default=d["block_size"], help="tokens per KV block")
    parser.add_argument(
        "--num-gpu-blocks",
        "--num-kv-blocks",
        dest="num_kv_blocks",
        type=int,
        default=d["num_kv_blocks"],
        help="KV pool size in blocks; default: from --kv-cache-memory-gb",
    )
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=d["kv_cache_memory_gb"],
        help="KV pool size when no block count is given",
    )
    parser.add_argument(
        "--kv-cache-backend",
        default=d["kv_cache_backend"],
        choices=KV_CACHE_BACKENDS,
        help="contiguous: the baseline",
    )
    parser.add_argument(
        "--prefix-caching",
        action=bool_flag,
        default=d["enable_prefix_caching"],
        dest="enable_prefix_caching",
        help="share the KV blocks of identical prompt prefixes",
    )
    parser.add_argument(
        "--max-num-seqs",
        "--max-batch-size",
        dest="max_num_seqs",
        type=int,
        default=d["max_num_seqs"],
        help="running requests at most; default: 128 (as vLLM's CPU server), at most the token budget",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d["max_num_batched_tokens"],
        help="token budget of one engine step; default: 2048 (vLLM's); a pooling model's forwards: 8192",
    )
    parser.add_argument(
        "--chunked-prefill",
        action=bool_flag,
        default=d["enable_chunked_prefill"],
        dest="enable_chunked_prefill",
        help="split long prompts into chunks interleaved with decodes",
    )
    parser.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=d["prefill_chunk_size"],
        help="default: --max-num-batched-tokens",
    )
    parser.add_argument(
        "--scheduling-policy",
        dest="policy",
        default=d["policy"],
        choices=POLICIES,
        help="priority: lower first; slo: by each request's TTFT / TPOT objectives (ttft_slo_ms and "
        "tpot_slo_ms in the body, else its class's in --slo-config)",
    )
    parser.add_argument(
        "--slo-config",
        metavar="FILE",
        default=d["slo_config"],
        help="YAML: request classes by prompt length and max_tokens with default ttft_ms / tpot_ms "
        "(infer.core.slo.SloClasses), for requests that bring no objectives",
    )
    parser.add_argument(
        "--slo-max-wait-s",
        type=float,
        default=d["slo_max_wait_s"],
        help="slo: no request is deferred longer than this; after it, it is served in arrival order",
    )
    parser.add_argument(
        "--slo-reject-late",
        action=bool_flag,
        default=d["slo_reject_late"],
        help="slo: refuse (429) a request that cannot meet its TTFT objective even on an idle step",
    )
    parser.add_argument(
        "--max-decode-slowdown",
        type=float,
        default=d["max_decode_slowdown"],
        help="a running stream's whole time beside prefills is at most about this many times its time "
        "alone: prefill chunks beside it are spent from a credit it earns as it decodes, and a prompt the "
        "credit cannot pay for runs before or after the streams, whichever keeps the bounds (a prompt's "
        "first token within 1.5x its time alone); and a step's decodes of a request's n choices (or, with "
        "several API keys, of one key's requests) beside other requests cost at most this many times the "
        "others' step; 0: off, every step takes the whole token budget",
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d["long_prefill_token_threshold"],
        help="vLLM's: a prompt longer than this is long and gets at most this many tokens a step (the "
        "longest gap a chunk puts in running streams); 0: none (4%% of --max-model-len with "
        "--max-num-partial-prefills > 1)",
    )
    parser.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=d["max_num_partial_prefills"],
        help="vLLM's: prompts prefilled at once, at most; 0: no bound",
    )
    parser.add_argument(
        "--max-long-partial-prefills",
        type=int,
        default=d["max_long_partial_prefills"],
        help="vLLM's: long prompts prefilled at once, at most (0: no bound); shorter prompts may be "
        "admitted past a long one that waits",
    )
    parser.add_argument(
        "--batching-mode", default=d["batching_mode"], choices=BATCHING_MODES, help="static: for benchmarks"
    )
    parser.add_argument(
        "--trace",
        dest="trace_path",
        metavar="FILE",
        default=d["trace_path"],
        help="record the engine trace (Chrome trace-event JSON, opens in ui.perfetto.dev), written to FILE "
        "at shutdown and served by GET /debug/trace?seconds=S",
    )
    parser.add_argument(
        "--trace-steps",
        type=int,
        default=d["trace_steps"],
        help="the trace keeps the last N engine steps (a ring)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=bool_flag,
        default=False,
        help="capture decode steps in CUDA graphs (needs a CUDA GPU)",
    )
    add_model_set_args(parser)


def string_list(value) -> list[str]:
    """A flag's list of strings: a JSON list (vLLM's form, '["a", "b"]') or comma-separated text (a YAML
    file may give a list)."""
    if isinstance(value, list):
        items = value
    elif value.strip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
    else:
        items = value.split(",")
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise argparse.ArgumentTypeError(f"must be a list of strings, got {value!r}")
    return [i.strip() for i in items if i.strip()]


class _Keys(argparse.Action):
    """--api-key, repeatable: the values add up, and replace the keys of a --config file (flags override
    the file, which sets this flag's default)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        keys = [] if current is self.default else current
        setattr(namespace, self.dest, [*keys, values])


def api_key_owners(args: argparse.Namespace) -> tuple[str, ...]:
    """The owners (digests) of the keys of --api-key (a list of values, or a --config file's string or
    list) and --api-key-file."""
    given = [] if args.api_key is None else args.api_key
    keys = split_keys([str(v) for v in (given if isinstance(given, list) else [given])])
    if args.api_key_file is not None:
        keys += read_key_file(Path(args.api_key_file))
    return tuple(owner_of(key.encode()) for key in check_keys(keys))


def parse_server_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> ServerArgs:
    """Parse argv, with the defaults taken from --config first so that flags override the file.
    Raises ValueError for a bad file, a bad value or an impossible combination."""
    args = parser.parse_args(argv)
    if args.config:
        parser.set_defaults(**read_config_file(Path(args.config), parser))
        args = parser.parse_args(argv)
    return to_server_args(args)


def read_config_file(path: Path, parser: argparse.ArgumentParser) -> dict:
    """The YAML file's keys as argparse destinations. Unknown keys are an error, not silently ignored."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ValueError(f"cannot read --config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of flag names to values")
    by_flag = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and not opt.startswith("--no-"):
                by_flag[opt[2:].replace("-", "_")] = action
    values = {}
    for key, value in data.items():
        action = by_flag.get(str(key).replace("-", "_"))
        if action is None or action.dest in ("config", "help"):
            raise ValueError(f"--config {path}: unknown key {key!r}; keys are the flags' long names")
        if action.type is not None and value is not None and not isinstance(value, bool):
            try:
                value = action.type(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"--config {path}: {key}: {exc}") from exc
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"--config {path}: {key} must be one of {list(action.choices)}, got {value!r}")
        values[action.dest] = value
    return values


def to_server_args(args: argparse.Namespace) -> ServerArgs:
    fields = {k: getattr(args, k) for k in _ENGINE_DEFAULTS if hasattr(args, k)}
    model = getattr(args, "model_arg", None) or args.model
    engine = EngineConfig(**{**fields, "model": model})
    from infer.engine.config_check import check_engine_config

    check_engine_config(engine)  # what would fail at load fails now, with exit code 2
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.responses_store_mb < 0:
        raise ValueError(f"--responses-store-mb must be >= 0, got {args.responses_store_mb}")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be >= 1024, got {args.max_request_bytes}")
    if not args.header_timeout > 0:
        raise ValueError(f"--header-timeout must be > 0 seconds, got {args.header_timeout}")
    if not args.timeout_keep_alive > 0:
        raise ValueError(f"--timeout-keep-alive must be > 0 seconds, got {args.timeout_keep_alive}")
    if not 1 <= args.port <= 65535 and args.port != 0:
        raise ValueError(f"--port must be in [1, 65535] (or 0 for any free port), got {args.port}")
    if args.cuda_graphs:
        check_cuda_graphs()
    if args.enable_auto_tool_choice and args.tool_call_parser is None:  # vLLM's check
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser NAME: say how the model writes its calls"
        )
    owners = api_key_owners(args)
    return ServerArgs(
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key_owners=owners,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        header_timeout=args.header_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
        trust_request_chat_template=args.trust_request_chat_template,
        responses_store_mb=args.responses_store_mb,
        drain_timeout=args.drain_timeout,
        cuda_graphs=args.cuda_graphs,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        models=model_set_args(args, engine),
    )


def check_cuda_graphs() -> None:
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "--cuda-graphs needs a CUDA GPU, and torch.cuda.is_available() is False on this machine "
            "(the engine runs on the CPU); drop the flag or pass --no-cuda-graphs"
        )
