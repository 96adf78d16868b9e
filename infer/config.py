"""Engine configuration: frozen dataclasses, validated in `__post_init__`, no I/O.

The model's own configuration (from config.json) lives in `infer.models.config`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

KV_CACHE_BACKENDS = ("paged", "contiguous")
POLICIES = ("fcfs", "priority", "slo")
BATCHING_MODES = ("continuous", "static")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The KV cache pool, counted in blocks of `block_size` tokens.

    num_blocks: blocks in the preallocated pool (`--num-gpu-blocks` / `--num-kv-blocks`, or sized from a
        memory budget by the runner). Pool capacity in tokens = num_blocks * block_size.
    enable_prefix_caching: share full blocks of identical prefixes between requests (paged backend only;
        the contiguous backend has no shareable blocks and ignores it).
    kv_cache_backend: "paged" = blocks handed out one at a time as sequences grow; "contiguous" = each
        running request reserves one whole max_model_len slot of consecutive blocks (the
        paged_attention workload's baseline, kept for comparison).
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_backend: str = "paged"

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        _positive_int("num_blocks", self.num_blocks)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        _one_of("kv_cache_backend", self.kv_cache_backend, KV_CACHE_BACKENDS)

    @property
    def num_tokens(self) -> int:
        """Capacity of the pool in tokens."""
        return self.num_blocks * self.block_size

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is actually in effect (it needs the paged backend)."""
        return self.enable_prefix_caching and self.kv_cache_backend == "paged"


# vLLM's budget, on every CPU. A wave of requests is prefilled in one or two steps and then decodes in
# lockstep, instead of prefill chunks riding beside its decodes: against 512, the same or more throughput
# and a third to a half of the ITL p99 (docs/optimizations.md, "The step budget").
DEFAULT_TOKEN_BUDGET = 2048


# Running streams at most 2x slower while a prompt is prefilled beside them: docs/engine.md, "Long prompts
# beside running streams", has the tradeoff against the long prompt's time to first token.
DEFAULT_MAX_DECODE_SLOWDOWN = 2.0


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """What one engine step may contain and in which order requests are served.

    max_num_seqs: running requests at most (the micro-benchmarks' `max_batch_size`).
    max_num_batched_tokens: token budget of one step, decode and prefill tokens together. Must be at least
        max_num_seqs so every running request can decode in every step.
    enable_chunked_prefill: split prompts into chunks of at most prefill_chunk_size tokens, interleaved
        with decodes. Off: a prompt is prefilled whole in one step (a request whose prompt + max_tokens
        cannot fit the budget is refused, as a preempted one must recompute all of it at once).
    prefill_chunk_size: largest prefill chunk of one request in one step; None = max_num_batched_tokens.
    policy: "fcfs" (arrival order) or "priority" (lower `Request.priority` first, ties by arrival; an
        urgent waiting request may preempt a less urgent running one), or "slo" (by each request's
        objectives, infer/core/scheduler.py).
    slo_max_wait_s: under "slo", a request waiting this long is served before every request that has
        not (in arrival order): the bound on how long the policy may defer it.
    slo_reject_late: under "slo", refuse a request at admission (LateRequest) when even a lower bound
        of its time to first token (the prefill queued ahead of it and its own, back to back at the
        step-cost model's rate) misses its TTFT objective.
    batching_mode: "continuous" (admit and retire every step) or "static" (admit up to max_num_seqs,
        run them all to completion, then admit the next batch; for benchmarks).
    max_model_len: prompt + max_tokens of one request at most.
    max_decode_slowdown: a running stream's whole time beside prefills is at most about this many times
        its time alone: each stream earns credit as it decodes (and for its next tokens), and a prefill
        chunk beside it is spent from it, decode-only steps when it runs out (infer/core/prefill_pacer.py);
        0 (or 1) = off, every step takes the whole budget. Off here, the mechanism alone; EngineConfig's
        default (DEFAULT_MAX_DECODE_SLOWDOWN) turns it on.
    long_prefill_token_threshold: vLLM's: a prompt longer than this is "long", and gets at most this many
        tokens a step (so also the most a chunk beside running streams stalls them); 0 = none, or 4% of
        max_model_len when max_num_partial_prefills > 1 (as vLLM).
    max_num_partial_prefills: vLLM's: requests whose prefill is under way at once, at most; 0 = no bound
        (as vLLM v1's scheduler).
    max_long_partial_prefills: vLLM's: of those, long ones at most (0 = no bound); a shorter prompt may be
        admitted past a long one that waits for this, so short requests keep their time to first token.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET
    enable_chunked_prefill: bool = True
    prefill_chunk_size: int | None = None
    policy: str = "fcfs"
    batching_mode: str = "continuous"
    max_model_len: int = 2048
    slo_max_wait_s: float = 30.0
    slo_reject_late: bool = False
    max_decode_slowdown: float = 0.0
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 0
    max_long_partial_prefills: int = 0

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _check_prefill_sharing(self)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_model_len", self.max_model_len)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode each step; "
                "raise the token budget or lower max_num_seqs"
            )
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}")
        if self.prefill_chunk_size is None:
            object.__setattr__(self, "prefill_chunk_size", self.max_num_batched_tokens)
        if self.long_prefill_token_threshold == 0 and self.max_num_partial_prefills > 1:
            object.__setattr__(self, "long_prefill_token_threshold", max(1, int(0.04 * self.max_model_len)))
        _positive_int("prefill_chunk_size", self.prefill_chunk_size)
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                f"prefill_chunk_size ({self.prefill_chunk_size}) cannot exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}); lower the chunk size or raise the budget"
            )
        _one_of("policy", self.policy, POLICIES)
        _one_of("batching_mode", self.batching_mode, BATCHING_MODES)
        if not (isinstance(self.slo_max_wait_s, int | float) and 0 < self.slo_max_wait_s < float("inf")):
            raise ValueError(
                f"slo_max_wait_s must be a finite number of seconds > 0, got {self.slo_max_wait_s!r}"
            )

    @property
    def max_batch_size(self) -> int:
        """The micro-benchmarks' name for max_num_seqs."""
        return self.max_num_seqs


def _check_prefill_sharing(cfg) -> None:
    """Validate the fields that share steps between prefills and decodes (SchedulerConfig's and
    EngineConfig's names); SchedulerConfig then sets vLLM's default threshold."""
    slowdown = cfg.max_decode_slowdown
    if (
        isinstance(slowdown, bool)
        or not isinstance(slowdown, int | float)
        or not 0 <= slowdown < float("inf")
    ):
        raise ValueError(f"max_decode_slowdown must be a number >= 0 (0: off), got {slowdown!r}")
    threshold = cfg.long_prefill_token_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be an int >= 0 (0: none), got {threshold!r}")
    for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0 (0: no bound), got {value!r}")
    if 0 < cfg.max_num_partial_prefills < cfg.max_long_partial_prefills:
        raise ValueError(
            f"max_long_partial_prefills ({cfg.max_long_partial_prefills}) cannot exceed "
            f"max_num_partial_prefills ({cfg.max_num_partial_prefills})"
        )


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


QUANTIZATION_METHODS = ("none", "int8", "int4")
RUNNERS = ("auto", "generate", "pooling")
# auto: the model's dtype; fp8 = fp8_e4m3 (as vLLM), one byte per element (infer/runner/kv_cache.py)
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATIVE_FIELDS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "draft_tensor_parallel_size",
    "disable_by_batch_size",
    "disable_by_gain",
)
DEFAULT_SPEC_BATCH_SIZE = 4  # speculate only while this many requests or fewer run


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config` JSON, its field names and defaults): each step
    a decoding request feeds its last token and up to num_speculative_tokens proposed ones, and one
    forward verifies them all (infer/runner/rejection_sampler.py, docs/speculative-decoding.md).

    method: "ngram" (prompt lookup: the tokens that followed the first earlier occurrence of the
        sequence's last n tokens, in the prompt or the output; infer/runner/ngram_proposer.py), or
        "draft_model" (a small model of the same vocabulary proposes greedily, with a KV cache of its
        own: infer/runner/draft_proposer.py). None: "draft_model" when a model is given, else "ngram".
    num_speculative_tokens: proposals per step at most (K); a decode then costs 1 + K tokens of the budget.
    prompt_lookup_min, prompt_lookup_max: ngram only: the n-gram lengths tried, longest first; vLLM's
        defaults: both 5 when neither is given, else the one given for both.
    model: draft_model only: the draft's folder, hub id or GGUF file (loaded as the target is).
    draft_tensor_parallel_size: draft_model only; 1, the draft runs in the engine's process.
    disable_by_batch_size: speculate only in steps where at most this many requests run: a larger
        batch is compute-bound, and the proposals' extra tokens would cost what they save.
    disable_by_gain: ours, not vLLM's: below that cap, speculate at a batch size only while this engine
        measures that it pays there (its verification steps' tokens against their cost over a plain
        decode step's: infer/core/speculation_gate.py); false: wherever the cap allows.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    disable_by_batch_size: int = DEFAULT_SPEC_BATCH_SIZE
    disable_by_gain: bool = True

    def __post_init__(self) -> None:
        method = self.method or ("draft_model" if self.model is not None else "ngram")
        object.__setattr__(self, "method", method)
        _one_of("speculative_config method", method, SPECULATIVE_METHODS)
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens (proposals per step, >= 1)")
        _positive_int("speculative_config num_speculative_tokens", self.num_speculative_tokens)
        _positive_int("speculative_config disable_by_batch_size", self.disable_by_batch_size)
        if not isinstance(self.disable_by_gain, bool):
            raise ValueError(
                f"speculative_config disable_by_gain must be true or false, got {self.disable_by_gain!r}"
            )
        if method == "draft_model":
            self._check_draft_model()
        else:
            self._check_ngram()

    def _check_draft_model(self) -> None:
        if not self.model or not isinstance(self.model, str):
            raise ValueError('speculative_config: method "draft_model" needs "model", the draft\'s path')
        tp = self.draft_tensor_parallel_size
        if tp is not None and tp != 1:
            raise ValueError(
                f"speculative_config: draft_tensor_parallel_size must be 1 (the draft runs in the "
                f"engine's process), got {tp!r}"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f'speculative_config: {name} is the "ngram" method\'s, not "draft_model"\'s')

    def _check_ngram(self) -> None:
        for name in ("model", "draft_tensor_parallel_size"):
            if getattr(self, name) is not None:
                raise ValueError(f'speculative_config: {name} is the "draft_model" method\'s, not "ngram"\'s')
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        _positive_int("speculative_config prompt_lookup_min", lo)
        _positive_int("speculative_config prompt_lookup_max", hi)
        if lo > hi:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from the flag's JSON text, a dict of its fields, or itself; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, (str, dict)):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        value = _json_object("speculative_config", value)
        unknown = sorted(set(value) - set(SPECULATIVE_FIELDS))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                f"the fields are {', '.join(SPECULATIVE_FIELDS)}"
            )
        return cls(**value)


# auto: safetensors for a folder, GGUF for a .gguf file (infer.models.gguf); dummy: random weights
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def _json_object(name: str, value: dict | str | None) -> dict | None:
    """A JSON object given as text (a flag's value) or as a dict; None stays None."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be a JSON object, got {parsed!r}")
    return parsed


def _one_of(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything `LLMEngine` needs, with the server's flags as field names. Defaults are the best
    configuration: continuous batching over a paged cache with chunked prefill and prefix caching.

    model: folder, hub id or preset, or a GGUF file (infer.models.gguf); None = the embedded model.
    tokenizer: a tokenizer folder to use instead of the model's own (its tokenizer.json, template...).
    num_kv_blocks: KV pool size in blocks; None = as many as fit in kv_cache_memory_gb.
    max_num_seqs: running requests at most; None = DEFAULT_MAX_NUM_SEQS (vLLM's CPU server's), or the
        token budget if that is smaller.
    max_num_batched_tokens: the step's token budget (SchedulerConfig's); None = DEFAULT_TOKEN_BUDGET.
    max_model_len: prompt + output tokens of one request; None = the model's context length.
    use_kv_cache: False recomputes every sequence from scratch each step (the KV-cache benchmark's
        baseline); the scheduler is unchanged.
    prepack_weights: bf16 linear weights reordered once for oneDNN where the CPU does bf16 (False: the
        plain F.linear path, for comparison).
    quantization: none, int8 (per output channel) or int4 (groups of 128): weight-only, done at load on
        a bf16/fp32 checkpoint (infer/quant). A pre-quantized checkpoint (AWQ, GPTQ, compressed-tensors)
        is recognised from its config.json whatever this says, unless it asks for another method.
    kv_cache_dtype: auto (the model's dtype, or 16 bits where dtype auto chose float32 activations: a bf16
        checkpoint's bf16, a quantized GGUF file's float16); float16 or bfloat16: under a float32 model (a
        CPU without bf16 arithmetic), keys and values stored in 16 bits as llama.cpp's default cache, the
        decode kernel's queries rounded to match; or fp8 / fp8_e4m3 / fp8_e5m2: keys and values stored as one
        byte each, no scale (vLLM's flag and its default scale of 1.0): twice the tokens in the same
        memory, half the bytes a long-context decode step reads (infer/runner/kv_cache.py).
    trace_path: record the engine trace (infer.engine.trace: Chrome trace-event JSON for Perfetto) and
        write it there at shutdown (`LLMEngine.close()`); None = off, at no cost.
    trace_steps: the trace keeps the events of this many last steps (a ring), so its memory is bounded.
    slo_config: a YAML file of request classes with default TTFT / TPOT objectives (infer.core.slo.
        SloClasses), for requests that bring none; slo_max_wait_s, slo_reject_late: SchedulerConfig's.
    max_decode_slowdown, long_prefill_token_threshold, max_num_partial_prefills,
        max_long_partial_prefills: SchedulerConfig's (how prefills share steps with running streams).
    enforce_eager: run every forward eagerly; by default a batch size that decodes steadily is replayed
        from a captured graph (infer.runner.decode_graph), as vLLM's flag turns off its CUDA graphs.
    tensor_parallel_size: ranks that each hold a shard of every layer (infer.runner.parallel); 1 = one
        process.
    grammar_cache_mb, max_grammar_compilations, max_queued_grammars, grammar_compile_timeout: the bounds
        of structured outputs' compilations (infer.structured_outputs.compile_pool): the compiled-grammar
        cache's memory (LRU), the compilations run at once, those waiting beyond them (more are refused:
        429), and the seconds one may take (then its requests are refused: 400).
    runner: vLLM's: "generate" (text), "pooling" (embeddings, scores: infer.engine.pooling), or "auto":
        pooling for an encoder, a cross-encoder or a decoder's body saved without its LM head.
    pooler_config: vLLM's `--pooler-config` JSON, overriding what the model's folder says of its pooler
        (infer.models.pooler_config).
    hf_overrides: vLLM's `--hf-overrides`: keys laid over the model's config.json (a dict, or its JSON
        text), e.g. Qwen3-Reranker served as the classifier it is (infer.models.decoder_classifier).
    speculative_config: speculative decoding (SpeculativeConfig, or its fields as a dict or JSON text, as
        vLLM's `--speculative-config`); None = off.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    kv_cache_backend: str = "paged"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    prefill_chunk_size: int | None = None
    policy: str = "fcfs"
    batching_mode: str = "continuous"
    max_model_len: int | None = None
    use_kv_cache: bool = True
    prepack_weights: bool = True
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    trace_path: str | None = None
    trace_steps: int = 10_000
    slo_config: str | None = None
    slo_max_wait_s: float = 30.0
    slo_reject_late: bool = False
    max_decode_slowdown: float = DEFAULT_MAX_DECODE_SLOWDOWN
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 0
    max_long_partial_prefills: int = 0
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    grammar_cache_mb: int = 64
    max_grammar_compilations: int = 1
    max_queued_grammars: int = 16
    grammar_compile_timeout: float = 10.0
    runner: str = "auto"
    pooler_config: str | None = None
    hf_overrides: dict | str | None = None
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        _one_of("runner", self.runner, RUNNERS)
        object.__setattr__(self, "hf_overrides", _json_object("hf_overrides", self.hf_overrides))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config is not served under tensor parallelism; leave one out")
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", DEFAULT_TOKEN_BUDGET)
        if self.max_num_seqs is None and isinstance(self.max_num_batched_tokens, int):
            object.__setattr__(self, "max_num_seqs", min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens))
        _positive_int("trace_steps", self.trace_steps)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        _positive_int("max_grammar_compilations", self.max_grammar_compilations)
        for name in ("grammar_cache_mb", "max_queued_grammars"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not (isinstance(self.grammar_compile_timeout, int | float) and self.grammar_compile_timeout > 0):
            raise ValueError(
                f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout!r}"
            )
        _one_of("quantization", self.quantization, QUANTIZATION_METHODS)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_prefill_sharing(self)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's part of this configuration, for a model of max_model_len (built in one place:
        the engine, and the server's check of its flags before the model loads)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            prefill_chunk_size=self.prefill_chunk_size,
            policy=self.policy,
            batching_mode=self.batching_mode,
            max_model_len=max_model_len,
            slo_max_wait_s=self.slo_max_wait_s,
            slo_reject_late=self.slo_reject_late,
            max_decode_slowdown=self.max_decode_slowdown,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
        )

    def cache_config(self, num_blocks: int) -> CacheConfig:
        """The KV pool's part of this configuration, for a pool of num_blocks (known once the model's shape
        is: built in one place, the engine and the server's check of its flags)."""
        return CacheConfig(
            num_blocks=num_blocks,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_backend=self.kv_cache_backend,
        )


# vLLM's CPU default. Against 32: waiting requests no longer queue behind the running 32, so more
# throughput and a shorter TTFT beyond 32 streams (docs/optimizations.md, "Running requests").
DEFAULT_MAX_NUM_SEQS = 128


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_local_ranks(tensor_parallel_size: int) -> None:
    """Tensor-parallel ranks started on this machine need a CPU core each (with a launcher, RANK set, the
    launcher places them and this does not apply)."""
    if tensor_parallel_size == 1 or "RANK" in os.environ:
        return
    cores = usable_cores()
    if tensor_parallel_size > cores:
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size} needs a CPU core per rank; this machine gives "
            f"{cores}: lower it, or launch ranks on several machines (torchrun, see the README)"
        )
