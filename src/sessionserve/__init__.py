"""sessionserve: an LLM inference server built for AI agents."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sessionserve.obs.native_memory import cap_primitive_cache

cap_primitive_cache()  # before torch runs a oneDNN kernel

if TYPE_CHECKING:
    from sessionserve.llm import LLM
    from sessionserve.llm_engine import CompletionOutput, LLMEngine, RequestOutput
    from sessionserve.types.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# Imported on first use: the engine pulls in torch (~1 s), which the simulator, the planner and the
# trace tools never need.
_LAZY = {"LLM": "sessionserve.llm", "LLMEngine": "sessionserve.llm_engine",
         "SamplingParams": "sessionserve.types.sampling_params", "RequestOutput": "sessionserve.llm_engine",
         "CompletionOutput": "sessionserve.llm_engine"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sessionserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
