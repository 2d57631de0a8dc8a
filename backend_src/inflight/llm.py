"""Offline API shaped like vLLM's: LLM(model, **options).generate(prompts, params)."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from .config import EngineConfig
from .engine import LLMEngine
from .sequence import FinishReason, SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0
    index: int = 0  # which of the request's n samples
    samples: list["CompletionOutput"] = field(default_factory=list)  # all n of them, this one first
    error: str | None = None  # why it ended with FinishReason.ERROR (e.g. a grammar that does not compile)


class LLM:
    def __init__(self, model: str, **options):
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priorities: list[int] | None = None) -> list[CompletionOutput]:
        """Run every prompt to completion with in-flight batching; results in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts: give one or one each")
        results: dict[tuple[str, int], CompletionOutput] = {}
        order = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = f"offline-{next(self._ids)}"
            p = p or SamplingParams()
            seq = self.engine.add_request(rid, prompt, p, priorities[i] if priorities else 0)
            samples = [CompletionOutput(rid, list(seq.prompt_token_ids), index=k) for k in range(p.n)]
            for k, sample in enumerate(samples):
                sample.samples = samples
                results[rid, k] = sample
            order.append(rid)
        with tqdm(total=len(results), desc="generate", unit="sample", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                if self.engine.waits_only_for_grammars():
                    time.sleep(0.001)  # a worker compiles a grammar; nothing can run before it is done
                for out in self.engine.step():
                    res = results[out.request_id, out.index]
                    res.token_ids.extend(out.new_token_ids)
                    res.text += out.text_delta
                    if out.finished:
                        res.finish_reason = out.finish_reason
                        res.cumulative_logprob = out.cumulative_logprob
                        res.error = out.error
                        bar.update(1)
        return [results[rid, 0] for rid in order]
