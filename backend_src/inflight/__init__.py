"""inflight: an in-flight (continuous) batching LLM engine over a paged KV cache."""
from .config import EngineConfig
from .fields import InvalidRequestError
from .sequence import FinishReason, RequestOutput, SamplingParams

__all__ = ["EngineConfig", "FinishReason", "InvalidRequestError", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from .llm import LLM
        return LLM
    raise AttributeError(name)
