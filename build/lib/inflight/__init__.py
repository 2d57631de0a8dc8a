"""inflight: an in-flight (continuous) batching LLM engine over a paged KV cache."""
import os

# How OpenMP's threads wait between the ~150 parallel regions of a step. libgomp's default spins for about
# 3 ms, and on 2 cores with one busy (another process) a step then took 5-6x longer than with sleeping threads.
# Sleeping threads pay a wake-up per region instead: a third of an idle machine's step, and the second core
# bought 1.06x. A short spin (30,000 rounds, a fraction of a millisecond) keeps the threads awake within a
# step and lets them sleep between steps: 1.6x over one thread on an idle machine (at 10,000 rounds the
# workers fell asleep in the Python between a layer's linears: 35.2 vs 32.8 ms a one-row step, 68.5 vs 61.8
# at 16 rows). The collapse under contention it would still risk is what cpu_threads.ThreadGovernor
# prevents, by running one thread while other processes hold a core.
# libgomp reads these once, when torch loads it, so they are set here, before anything of ours imports torch;
# an operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins (docs/cpu.md).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["GOMP_SPINCOUNT"] = "30000"

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
