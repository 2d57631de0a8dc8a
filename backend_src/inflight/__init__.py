"""inflight: an in-flight (continuous) batching LLM engine over a paged KV cache."""
import os

# OpenMP threads that spin while they wait collapse when anything else wants a core: on 2 cores with one busy
# (tritonserver's threads, the response sender, another process) a decode step took 5-6x longer with 2 threads
# than passive waiting (505 vs 88 ms/token, SmolLM2). The runtime reads this once, when torch loads it, so it
# is set here, before anything of ours imports torch; a value set by the operator wins (docs/cpu.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .config import EngineConfig  # noqa: E402 - after the OpenMP setting above
from .fields import InvalidRequestError  # noqa: E402
from .sequence import FinishReason, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["EngineConfig", "FinishReason", "InvalidRequestError", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from .llm import LLM
        return LLM
    raise AttributeError(name)
