"""inflight: an in-flight (continuous) batching LLM engine over a paged KV cache."""
from .config import EngineConfig
from .sequence import FinishReason, InvalidRequestError, RequestOutput, SamplingParams

__all__ = ["EngineConfig", "FinishReason", "InvalidRequestError", "RequestOutput", "SamplingParams"]
