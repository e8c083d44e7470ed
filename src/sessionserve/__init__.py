"""sessionserve: an LLM inference server built for AI agents."""

from sessionserve.obs.native_memory import cap_primitive_cache

cap_primitive_cache()  # before torch runs a oneDNN kernel

from sessionserve.core.sampling_params import SamplingParams
from sessionserve.llm import LLM
from sessionserve.llm_engine import CompletionOutput, LLMEngine, RequestOutput

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
