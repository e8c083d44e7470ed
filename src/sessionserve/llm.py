"""Offline batched generation: `LLM(model=PATH).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sessionserve.config import Config
from sessionserve.llm_engine import LLMEngine, RequestOutput
from sessionserve.types.sampling_params import SamplingParams


def resolve_model_path(model: str | None) -> str:
    """A model folder path; None means the embedded default, created on first use."""
    if model is not None:
        return model
    from sessionserve.modelgen.make_model import ensure_model

    return str(ensure_model())


class LLM:
    """vLLM-style offline API over one engine.

    >>> llm = LLM(model="path/to/hf-folder", kv_cache_bytes=1 << 30)
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0]
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        config = Config.from_kwargs(model=model, **kwargs)
        self.engine = LLMEngine(config, resolve_model_path(model))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) in one continuous batch; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompts))
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, params))  # type: ignore[arg-type]
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[rid] for rid in ids]

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None,
             tools: list[dict[str, Any]] | None = None) -> RequestOutput:
        """Render one conversation with the chat template and generate its reply."""
        prompt = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(prompt, add_special_tokens=False)], sampling_params)[0]


def _broadcast(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
