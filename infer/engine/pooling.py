"""The pooling engine: embeddings and scores of whole texts, for embedding models and cross-encoders.

    PoolingEngine(EngineConfig(model=..., runner="pooling"))
      .encode([PoolingInput(token_ids), ...])  -> per input its embedding, or a cross-encoder's scores

A pooling request is a prefill and nothing more, so it needs none of generation's machinery: no KV
blocks, no scheduler steps, no sampling. Inputs are packed into batches of at most
`max_num_batched_tokens` tokens (POOLING_TOKEN_BUDGET unless set) and `max_num_seqs` sequences
(`token_batches`), each one forward of the pooling runner (infer.runner.pooling_runner); an input
longer than the budget runs alone. Which runner
a model gets is `pooling_task`'s decision, vLLM's `--runner`.
"""

from __future__ import annotations

import math
from pathlib import Path

from infer.config import DEFAULT_TOKEN_BUDGET, EngineConfig
from infer.engine.pooling_architectures import (  # noqa: F401 (the engine's names for them)
    DECODER_ARCHITECTURES,
    DECODER_CLASSIFIERS,
    POOLING_ARCHITECTURES,
    pooling_task,
)
from infer.engine.tokenizer import load_tokenizer
from infer.models.loader import load_engine_model, read_config, resolve_model_path
from infer.models.pooler_config import CLASSIFY, read_pooler_config
from infer.models.st_dense import DenseStack
from infer.runner.pooling_runner import PoolingInput, PoolingRunner

# A pooling forward's token budget where --max-num-batched-tokens is left at its default (generation's
# 2048, which bounds a step that decodes beside a prefill): a pooling batch has no decodes to keep
# moving, and each forward pays a fixed count of parallel regions (one per op and layer), which a loaded
# machine makes dear. 32 texts of 128 tokens are one forward instead of two: BGE-small's shape took ~30%
# less time in-process on a loaded Sapphire Rapids (2 cores); Qwen3-Embedding-0.6B's was unchanged.
POOLING_TOKEN_BUDGET = 8192


def model_task(config: EngineConfig) -> str | None:
    """pooling_task of the model `config` names (its config.json read; a GGUF file is a generation model)."""
    if config.runner == "generate":
        return None
    path = resolve_model_path(config.model, config.load_format)
    if not (path / "config.json").is_file():
        return pooling_task("", config.runner) if config.runner == "pooling" else None
    architectures = read_config(path, config.hf_overrides).get("architectures") or [""]
    return pooling_task(architectures[0], config.runner)


def pooling_token_budget(max_num_batched_tokens: int) -> int:
    """The tokens of one pooling forward: --max-num-batched-tokens where it was set, else
    POOLING_TOKEN_BUDGET."""
    if max_num_batched_tokens == DEFAULT_TOKEN_BUDGET:
        return POOLING_TOKEN_BUDGET
    return max_num_batched_tokens


def token_batches(lengths: list[int], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Indices of `lengths` in batches of at most max_tokens tokens and max_seqs sequences, in order; a
    length beyond max_tokens makes a batch of its own."""
    batches: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(lengths):
        if current and (total + n > max_tokens or len(current) >= max_seqs):
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        batches.append(current)
    return batches


class PoolingEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.task = model_task(config)
        if self.task is None:
            raise ValueError(f"{config.model or 'embedded'} is a generation model, not a pooling model")
        if config.tensor_parallel_size > 1:
            raise ValueError("pooling models run on one rank: drop --tensor-parallel-size")
        model, self.model_config, path = load_engine_model(config, pooling=True)
        self.path = Path(path)
        self.tokenizer = load_tokenizer(self.path, config.tokenizer)
        hf_config = read_config(self.path, config.hf_overrides)
        decoder = self.model_config.architecture in DECODER_ARCHITECTURES
        self.pooler = read_pooler_config(
            self.path, hf_config, self.task, decoder, config.pooler_config, self.model_config.num_labels
        )
        if self.task == CLASSIFY and not hasattr(model, "classify"):
            raise ValueError(f"{self.model_config.architecture} has no classifier to score with")
        self.runner = PoolingRunner(
            model,
            self.pooler.pooling_type,
            self.pooler.normalize,
            self.task == CLASSIFY,
            self.pooler.use_activation,
            DenseStack(self.path, self.pooler.dense_folders) if self.pooler.dense_folders else None,
        )
        self.dtype = next(model.parameters()).dtype
        self.max_model_len = min(config.max_model_len or math.inf, self.model_config.max_position_embeddings)
        self.max_num_batched_tokens = pooling_token_budget(config.max_num_batched_tokens)
        self.max_num_seqs = config.max_num_seqs

    @property
    def embedding_size(self) -> int:
        """The size of the vectors it returns: a Dense module's output, else the hidden state's."""
        project = self.runner.project
        return project.out_features if project is not None else self.model_config.hidden_size

    @property
    def num_labels(self) -> int:
        return self.model_config.num_labels

    def check_length(self, num_tokens: int) -> None:
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the input has "
                f"{num_tokens} tokens. Please reduce the length of the input prompt, or set "
                "truncate_prompt_tokens."
            )

    def truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        """vLLM's `truncate_prompt_tokens` as a token count: -1 is max_model_len; beyond it a ValueError."""
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return self.max_model_len
        if truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {truncate_prompt_tokens}")
        if truncate_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens ({truncate_prompt_tokens}) is greater than max_model_len "
                f"({self.max_model_len}). Please request a smaller truncation size."
            )
        return truncate_prompt_tokens

    def encode(self, inputs: list[PoolingInput]) -> list[list[float]]:
        """Per input, in order: its embedding (EMBED), or its classifier's scores (CLASSIFY)."""
        out: list[list[float]] = [[] for _ in inputs]
        # shortest first: a batch's sequences are alike in length, so an encoder pads them little
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].token_ids))
        lengths = [len(inputs[i].token_ids) for i in order]
        for batch in token_batches(lengths, self.max_num_batched_tokens, self.max_num_seqs):
            chosen = [order[j] for j in batch]
            for i, result in zip(chosen, self.runner.run([inputs[i] for i in chosen]), strict=True):
                out[i] = result
        return out
