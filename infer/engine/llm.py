"""Offline batch generation: `LLM(model=...).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.config import EngineConfig
from infer.core.request import Request
from infer.engine.llm_engine import LLMEngine
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


class LLM:
    """`with LLM(trace_path="trace.json") as llm:` writes the trace on leaving (or call `close()`), and
    stops the other tensor-parallel ranks (with tensor_parallel_size > 1)."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def close(self) -> None:
        """Write the engine trace, if tracing; the LLM stays usable."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.engine.shutdown()  # the other tensor-parallel ranks, if any

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        priorities: list[int] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion; results in the order of `prompts`."""
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
