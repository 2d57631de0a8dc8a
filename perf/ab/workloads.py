"""The A/B workloads: prompts of known token length and exact output lengths (ignore_eos), written as
perf_analyzer --input-data JSON. Lengths are the seeds' figures times a scale that fits this CPU."""
from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

# name -> (prompt tokens, output tokens per share, shared prefix tokens, description); tokens at scale 1.
SPECS: dict[str, tuple[int, tuple[int, ...], int, str]] = {
    "short_short": (32, (32,), 0, "short prompt, short output"),
    "short_long": (32, (256,), 0, "short prompt, long output"),
    "long_short": (512, (32,), 0, "long prompt, short output"),
    "mixed": (32, (20, 50, 200, 800), 0, "the seeds' output mix: 20/50/200/800 in equal shares"),
    "shared_prefix": (32, (64,), 512, "a long system prompt shared by every request, short user turn"),
}
SHORT_PROMPT_FLOOR = 8  # short prompts stay at least this long whatever the scale
_WORDS = ("river mountain quiet signal garden copper lantern harbor meadow engine window thunder pocket "
          "violet marble candle orbit canyon pepper ladder silver forest rhythm anchor puzzle ember velvet "
          "compass falcon glacier meadowlark timber beacon saddle oyster prairie quartz").split()


@dataclass
class Request:
    prompt: str
    max_tokens: int


@dataclass
class Workload:
    name: str
    description: str
    requests: list[Request]
    prompt_tokens: int
    prefix_tokens: int

    @property
    def output_lengths(self) -> list[int]:
        return [r.max_tokens for r in self.requests]

    @property
    def ceiling(self) -> float:
        """Static batching holds every slot until the batch's longest request ends, so in-flight batching can
        at most gain max-length / mean-length in decode throughput (for full batches of this mix)."""
        lengths = self.output_lengths
        return max(lengths) / statistics.fmean(lengths)

    def write_input_data(self, path: Path) -> Path:
        """perf_analyzer --input-data: one entry per request, sent in this order (then it wraps)."""
        data = [{"text_input": [r.prompt], "max_tokens": [r.max_tokens], "stream": [True], "ignore_eos": [True],
                 "temperature": [0.0], "return_num_output_tokens": [True]} for r in self.requests]
        path.write_text(json.dumps({"data": data}))
        return path


def _text_of(tokenizer, rng: random.Random, num_tokens: int) -> str:
    """Random words cut to num_tokens tokens of this tokenizer (re-encoding may differ by a token)."""
    words = " ".join(rng.choice(_WORDS) for _ in range(num_tokens * 2))
    ids = tokenizer.encode(words, add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def build(name: str, tokenizer, scale: float, num_requests: int, seed: int = 0) -> Workload:
    if name not in SPECS:
        raise ValueError(f"workload {name!r} is unknown: allowed {', '.join(SPECS)}")
    if scale <= 0 or num_requests < 1:
        raise ValueError(f"scale={scale} and num_requests={num_requests}: allowed scale > 0, num_requests >= 1")
    prompt_len, outputs, prefix_len, description = SPECS[name]
    rng = random.Random(f"{name}/{seed}")
    prompt_tokens = max(SHORT_PROMPT_FLOOR, round(prompt_len * scale)) if prompt_len > 32 else prompt_len
    prefix_tokens = round(prefix_len * scale)
    prefix = _text_of(tokenizer, rng, prefix_tokens) + "\n\n" if prefix_tokens else ""
    # Equal shares, interleaved in a shuffled order so every stretch of the run sees the whole mix.
    lengths = [max(1, round(outputs[i % len(outputs)] * scale)) for i in range(num_requests)]
    rng.shuffle(lengths)
    requests = [Request(f"{prefix}{i}: {_text_of(tokenizer, rng, prompt_tokens)}", n) for i, n in enumerate(lengths)]
    return Workload(name, description, requests, prompt_tokens, prefix_tokens)
