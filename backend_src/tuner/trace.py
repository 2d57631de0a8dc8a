"""Workload traces for the tuner: one JSON request a line, checked line by line, and the synthetic mixes.

A line: {"arrival_s": 0.25, "prompt": "text...", "output_tokens": 50, "priority": 0}
(`prompt_tokens: N` may replace `prompt`: a synthetic prompt of N tokens, made the same way every time it is
read, so the simulator and the server see the same text). Arrivals are seconds from the start, non-decreasing.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

KEYS = {"arrival_s", "prompt", "prompt_tokens", "output_tokens", "priority"}
_WORDS = ("river mountain quiet signal garden copper lantern harbor meadow engine window thunder pocket violet "
          "marble candle orbit canyon pepper ladder silver forest rhythm anchor puzzle ember velvet compass falcon "
          "glacier timber beacon saddle oyster prairie quartz").split()


class TraceError(ValueError):
    """A bad trace line; the message starts with FILE:LINE."""


@dataclass
class TraceRequest:
    arrival_s: float
    output_tokens: int
    prompt: str | None = None
    prompt_tokens: int | None = None  # synthetic prompt of this many tokens (when prompt is None)
    priority: int = 0
    line: int = 0  # where it was read from, for messages

    def to_json(self) -> dict:
        out: dict = {"arrival_s": round(self.arrival_s, 6)}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        else:
            out["prompt_tokens"] = self.prompt_tokens
        out["output_tokens"] = self.output_tokens
        if self.priority:
            out["priority"] = self.priority
        return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_line(text: str, path: str, lineno: int, previous_arrival: float = 0.0) -> TraceRequest:
    """One line -> TraceRequest, or TraceError naming FILE:LINE, the field, the value and what is allowed."""
    def bad(msg: str) -> TraceError:
        return TraceError(f"{path}:{lineno}: {msg}")

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise bad(f"{type(obj).__name__} is not allowed: a JSON object per line")
    unknown = sorted(set(obj) - KEYS)
    if unknown:
        raise bad(f"unknown key(s) {', '.join(unknown)}: allowed {', '.join(sorted(KEYS))}")
    arrival = obj.get("arrival_s")
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not math.isfinite(arrival) or arrival < 0:
        raise bad(f"arrival_s={arrival!r} is out of range: allowed a number >= 0")
    if arrival < previous_arrival:
        raise bad(f"arrival_s={arrival} is out of range: allowed >= the previous line's {previous_arrival} "
                  "(arrivals in order)")
    has_prompt, has_tokens = "prompt" in obj, "prompt_tokens" in obj
    if has_prompt == has_tokens:
        raise bad("give exactly one of prompt (text) or prompt_tokens (a synthetic prompt's length)")
    prompt, prompt_tokens = obj.get("prompt"), obj.get("prompt_tokens")
    if has_prompt and not (isinstance(prompt, str) and prompt):
        raise bad(f"prompt={prompt!r} is not allowed: a non-empty string")
    if has_tokens and not (_is_int(prompt_tokens) and prompt_tokens >= 1):
        raise bad(f"prompt_tokens={prompt_tokens!r} is out of range: allowed an integer >= 1")
    out_tokens = obj.get("output_tokens")
    if not (_is_int(out_tokens) and out_tokens >= 1):
        raise bad(f"output_tokens={out_tokens!r} is out of range: allowed an integer >= 1")
    priority = obj.get("priority", 0)
    if not (_is_int(priority) and -(2**31) <= priority < 2**31):
        raise bad(f"priority={priority!r} is out of range: allowed a 32-bit integer")
    return TraceRequest(float(arrival), out_tokens, prompt, prompt_tokens, priority, lineno)


def load(path: Path) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    previous = 0.0
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue  # blank lines (a trailing newline) are not requests
            req = parse_line(text, str(path), lineno, previous)
            previous = req.arrival_s
            requests.append(req)
    if not requests:
        raise TraceError(f"{path}: no requests")
    return requests


def write(path: Path, requests: list[TraceRequest]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json()) + "\n")


def offered_rate(requests: list[TraceRequest]) -> float:
    """Requests per second over the arrival span (one request, or all at once: infinite)."""
    span = requests[-1].arrival_s - requests[0].arrival_s
    return (len(requests) - 1) / span if span > 0 else math.inf


def synthetic_text(tokenizer, num_tokens: int, seed: int) -> str:
    """Random words cut to num_tokens tokens; the same (seed, length) gives the same text on every read.

    Decoding a cut and re-encoding it can differ by a token; the tuner always counts the re-encoded ids."""
    rng = random.Random(f"synthetic/{seed}/{num_tokens}")
    words = " ".join(rng.choice(_WORDS) for _ in range(num_tokens + 8))
    ids = tokenizer.encode(words, add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def prompt_text(req: TraceRequest, tokenizer) -> str:
    return req.prompt if req.prompt is not None else synthetic_text(tokenizer, req.prompt_tokens, req.line)


# ---- synthetic mixes ------------------------------------------------------------------------------------------
def _seed_mix(rng: random.Random, i: int, scale: float) -> tuple[int, int]:
    """The seeds' mix: 32-token prompts, outputs 20/50/200/800 in equal shares (times scale)."""
    return 32, max(1, round((20, 50, 200, 800)[i % 4] * scale))


def _long_tail(rng: random.Random, i: int, scale: float) -> tuple[int, int]:
    """Log-normal prompts (median ~100 tokens) and outputs (median ~60 x scale), capped: a few very long."""
    prompt = min(1500, max(4, round(rng.lognormvariate(math.log(100), 1.0))))
    output = min(1000, max(1, round(rng.lognormvariate(math.log(60), 1.0) * scale)))
    return prompt, output


MIXES = {
    "seed": "32-token prompts, outputs 20/50/200/800 in equal shares (times --scale)",
    "long_tail": "log-normal prompts (median 100) and outputs (median 60 x --scale), a long tail of each",
    "chat": "one of 3 shared system prompts (~400 tokens) + a short user turn, outputs ~100 x --scale",
}


def make_mix(mix: str, rate: float, num_requests: int, tokenizer, scale: float = 1.0, burstiness: float = 1.0,
             seed: int = 0) -> list[TraceRequest]:
    """num_requests requests at `rate` per second. burstiness is the gamma shape of the gaps: 1 = Poisson,
    below 1 bursty (the same mean rate, arrivals bunched), above 1 more regular."""
    if mix not in MIXES:
        raise ValueError(f"mix {mix!r} is unknown: allowed {', '.join(MIXES)}")
    if not (rate > 0 and num_requests >= 1 and scale > 0 and burstiness > 0):
        raise ValueError(f"rate={rate}, requests={num_requests}, scale={scale}, burstiness={burstiness}: "
                         "allowed rate > 0, requests >= 1, scale > 0, burstiness > 0")
    rng = random.Random(f"{mix}/{seed}")
    t = 0.0
    out = []
    systems = [synthetic_text(tokenizer, 400, 10_000 + k) for k in range(3)] if mix == "chat" else []
    order = list(range(num_requests))
    rng.shuffle(order)  # the seed mix's lengths in a shuffled order, so every stretch sees all four
    for i in range(num_requests):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        if mix == "chat":
            turn = synthetic_text(tokenizer, rng.randint(10, 60), 20_000 + seed * 100_000 + i)
            text = f"{systems[rng.randrange(3)]}\n\nUser: {turn}\nAssistant:"
            output = max(1, round(rng.randint(50, 150) * scale))
            out.append(TraceRequest(t, output, prompt=text, line=i + 1))
            continue
        prompt, output = (_seed_mix if mix == "seed" else _long_tail)(rng, order[i], scale)
        out.append(TraceRequest(t, output, prompt_tokens=prompt, line=i + 1))
    return out


def from_log(path: Path, rate: float, output_tokens: int, burstiness: float = 1.0, seed: int = 0,
             limit: int | None = None) -> list[TraceRequest]:
    """A real prompt log (JSONL with `prompt`, optionally `output_tokens`, `priority`; or plain text, one prompt a
    line) with fresh arrivals at `rate`."""
    rng = random.Random(f"log/{seed}")
    out: list[TraceRequest] = []
    t = 0.0
    for where, prompt, extra in read_prompt_log(path):
        if limit is not None and len(out) >= limit:
            break
        if out:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        n = extra.get("output_tokens", output_tokens)
        if not (_is_int(n) and n >= 1):
            raise TraceError(f"{where}: output_tokens={n!r} is out of range: allowed an integer >= 1")
        out.append(TraceRequest(t, n, prompt=prompt, priority=int(extra.get("priority", 0)), line=len(out) + 1))
    if not out:
        raise TraceError(f"{path}: no prompts")
    return out


def read_prompt_log(path: Path):
    """(FILE:LINE, prompt, other fields) per prompt: JSONL lines with a `prompt` (or `text`) field, or plain text."""
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}:{lineno}"
            if text.lstrip().startswith("{"):
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
                prompt = obj.get("prompt", obj.get("text"))
                if not (isinstance(prompt, str) and prompt):
                    raise TraceError(f"{where}: prompt={prompt!r} is not allowed: a non-empty string")
                yield where, prompt, obj
            else:
                yield where, text.rstrip("\n"), {}
