"""Requests of a pooling model as PoolingInputs, and their outputs as what the API returns: the shared
part of `LLM.embed` / `LLM.score` and the server's /v1/embeddings, /score and /rerank.

    embedding_inputs(engine, prompts, ...)   texts or token ids -> PoolingInputs (checked, truncated)
    ScoreJob.build(engine, text_1, text_2)   vLLM's pairing: 1 x 1, 1 x N, or N x N pairwise
      .inputs                                  a cross-encoder: one input per pair (its token types);
                                               an embedding model: one per distinct text
      .scores(outputs)                         the classifier's score, or the pair's cosine similarity
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infer.models.pooler_config import CLASSIFY
from infer.runner.pooling_runner import PoolingInput


def _check_ids(engine, ids: list[int]) -> None:
    vocab = engine.model_config.vocab_size
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise ValueError(f"token ids must be in [0, {vocab}); got {bad[:5]}")


def embedding_inputs(
    engine,
    prompts: list[str | list[int]],
    truncate_prompt_tokens: int | None = None,
    dimensions: int | None = None,
    add_special_tokens: bool = True,
) -> list[PoolingInput]:
    """One PoolingInput per prompt (a text, or token ids used as they are). `truncate_prompt_tokens`
    keeps a text's first N tokens, its special tokens included (transformers' truncation), and token
    ids' last N (as vLLM). ValueError for what the model cannot take."""
    limit = engine.truncation(truncate_prompt_tokens)
    engine.pooler.check_dimensions(dimensions, engine.embedding_size)
    inputs = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if limit is None or not add_special_tokens:
                ids = engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)[: limit or None]
            else:
                ids, _ = engine.tokenizer.encode_pair(prompt, None, max_length=limit)
        else:
            _check_ids(engine, prompt)
            ids = list(prompt[-limit:] if limit else prompt)
        if not ids:
            raise ValueError("an input is empty: it has no tokens to embed")
        engine.check_length(len(ids))
        inputs.append(PoolingInput(ids, dimensions=dimensions))
    return inputs


def pair_up(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against each text_2, or text_1[i] with text_2[i]."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: send one text_1, or as many as text_2"
        )
    return list(zip(first, second, strict=True))


@dataclass
class ScoreJob:
    inputs: list[PoolingInput]
    # an embedding model's pairs: the indices of the two texts' inputs; None for a cross-encoder
    pair_indices: list[tuple[int, int]] | None = None

    @classmethod
    def build(
        cls,
        engine,
        pairs: list[tuple[str, str]],
        truncate_prompt_tokens: int | None = None,
        use_activation: bool | None = None,
    ) -> ScoreJob:
        limit = engine.truncation(truncate_prompt_tokens)
        if engine.pooler.task == CLASSIFY:
            if engine.num_labels != 1:
                raise ValueError(
                    f"this cross-encoder has {engine.num_labels} labels; scoring needs a model with one"
                )
            inputs = []
            for a, b in pairs:
                ids, types = engine.tokenizer.encode_pair(a, b, max_length=limit)
                engine.check_length(len(ids))
                inputs.append(PoolingInput(ids, types, use_activation=use_activation is not False))
            return cls(inputs)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
        index = {t: i for i, t in enumerate(texts)}
        inputs = embedding_inputs(engine, texts, truncate_prompt_tokens)
        return cls(inputs, [(index[a], index[b]) for a, b in pairs])

    def scores(self, outputs: list[list[float]]) -> list[float]:
        if self.pair_indices is None:
            return [out[0] for out in outputs]
        return [_cosine(outputs[i], outputs[j]) for i, j in self.pair_indices]

    def num_prompt_tokens(self) -> int:
        return sum(len(x.token_ids) for x in self.inputs)

    def pair_num_tokens(self) -> list[int]:
        """Tokens per pair (as the response's usage counts them)."""
        if self.pair_indices is None:
            return [len(x.token_ids) for x in self.inputs]
        return [len(self.inputs[i].token_ids) + len(self.inputs[j].token_ids) for i, j in self.pair_indices]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
