"""Offline batches, as in vLLM: `LLM(model=...).generate(prompts, sampling_params)`, and for a pooling
model (an embedding model or a cross-encoder: infer.engine.pooling) `LLM.embed(texts)` and
`LLM.score(text_1, text_2)`."""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.config import EngineConfig
from infer.core.request import Request
from infer.engine.llm_engine import LLMEngine
from infer.engine.pooling import PoolingEngine, model_task
from infer.engine.pooling_inputs import ScoreJob, embedding_inputs, pair_up
from infer.sampling_params import SamplingParams


@dataclass
class GenerationResult:
    prompt: str | list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    request: Request | None = None  # the finished request: timestamps, preemptions, prefill computed
    error: str | None = None  # with finish_reason "error": what failed
    prompt_logprobs: list | None = None  # with SamplingParams.prompt_logprobs: see StepOutput


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """vLLM's EmbeddingRequestOutput / ScoringRequestOutput: `.outputs.embedding` or `.outputs.score`."""

    request_id: str
    outputs: EmbeddingOutput | ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


class LLM:
    """`with LLM(trace_path="trace.json") as llm:` writes the trace on leaving (or call `close()`), and
    stops the other tensor-parallel ranks (with tensor_parallel_size > 1). A pooling model (`runner`
    "pooling", or an encoder's architecture) serves `embed` and `score` instead of `generate`."""

    def __init__(self, model: str | None = None, **engine_args):
        config = EngineConfig(model=model, **engine_args)
        self.engine: LLMEngine | None = None
        self.pooling: PoolingEngine | None = None
        if model_task(config) is not None:
            self.pooling = PoolingEngine(config)
        else:
            self.engine = LLMEngine(config)

    def close(self) -> None:
        """Write the engine trace, if tracing; the LLM stays usable."""
        if self.engine is not None:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.engine is not None:
            self.engine.shutdown()  # the other tensor-parallel ranks, if any

    def _pooling_engine(self, what: str) -> PoolingEngine:
        if self.pooling is None:
            raise ValueError(
                f"LLM.{what} needs a pooling model (an embedding model or a cross-encoder); this one "
                "generates text: use LLM.generate, or load a decoder embedder with runner='pooling'"
            )
        return self.pooling

    def embed(
        self,
        prompts: str | list[int] | list[str | list[int]],
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's (a text's, or token ids') embedding, in order."""
        engine = self._pooling_engine("embed")
        if engine.task != "embed":
            raise ValueError("this model is a cross-encoder: it scores pairs (LLM.score), it does not embed")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        inputs = embedding_inputs(engine, prompts, truncate_prompt_tokens, dimensions)
        outputs = engine.encode(inputs)
        return [
            PoolingRequestOutput(str(i), EmbeddingOutput(out), x.token_ids)
            for i, (x, out) in enumerate(zip(inputs, outputs, strict=True))
        ]

    def score(
        self,
        text_1: str | list[str],
        text_2: str | list[str],
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """A score per pair (one text_1 against each text_2, or text_1[i] with text_2[i]): a reranker's
        (a cross-encoder, or a decoder classifier such as Qwen3-Reranker, loaded with `hf_overrides`),
        or the cosine similarity of an embedding model's two vectors."""
        engine = self._pooling_engine("score")
        job = ScoreJob.build(engine, pair_up(text_1, text_2), truncate_prompt_tokens)
        scores = job.scores(engine.encode(job.inputs))
        ids = [x.token_ids for x in job.inputs] if job.pair_indices is None else None
        return [
            PoolingRequestOutput(str(i), ScoringOutput(s), ids[i] if ids else [])
            for i, s in enumerate(scores)
        ]

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        priorities: list[int] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion; results in the order of `prompts`."""
        if self.engine is None:
            raise ValueError(
                "this model is a pooling model (embeddings, scores): it does not generate text; "
                "use LLM.embed or LLM.score"
            )
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        results = {}
        for i, prompt in enumerate(prompts):
            req = self.engine.add_request(prompt, params[i], priority=priorities[i] if priorities else 0)
            results[req.req_id] = GenerationResult(prompt, num_prompt_tokens=req.num_prompt_tokens)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                result = results[out.req_id]
                result.text += out.text
                result.token_ids += out.token_ids
                result.num_cached_tokens = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    result.finish_reason = out.finish_reason
                    result.request = out.request
                    result.error = out.error
        return list(results.values())
