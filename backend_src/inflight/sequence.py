"""The one mutable record per request (Sequence), its sampling parameters and finish reasons."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the field, the value and the allowed range."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, at the front of the queue, to be recomputed
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"
    ERROR = "error"

    @property
    def openai(self) -> str:
        """The OpenAI/vLLM spelling: 'length' when the limit was hit, 'stop' for eos and stop strings."""
        return {"eos": "stop", "stop": "stop", "length": "length"}.get(self.value, self.value)


@dataclass
class SamplingParams:
    max_tokens: int | None = None  # None: the engine's default_max_tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def check(name, value, ok, allowed):
            if not ok:
                raise InvalidRequestError(f"{name}={value!r} is out of range: allowed {allowed}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # rejects NaN

        mt = self.max_tokens
        check("max_tokens", mt, mt is None or (is_int(mt) and mt >= 1), "an integer >= 1")
        t = self.temperature
        check("temperature", t, is_num(t) and 0.0 <= t <= 100.0, "a number in [0, 100]")
        p = self.top_p
        check("top_p", p, is_num(p) and 0.0 < p <= 1.0, "a number in (0, 1]")
        k = self.top_k
        check("top_k", k, is_int(k) and k >= -1, "an integer >= -1 (-1 or 0: no limit)")
        mp = self.min_p
        check("min_p", mp, is_num(mp) and 0.0 <= mp <= 1.0, "a number in [0, 1]")
        rp = self.repetition_penalty
        check("repetition_penalty", rp, is_num(rp) and 0.0 < rp <= 10.0, "a number in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(name, v, is_num(v) and -2.0 <= v <= 2.0, "a number in [-2, 2]")
        mn = self.min_tokens
        check("min_tokens", mn, is_int(mn) and mn >= 0, "an integer >= 0")
        if mt is not None and mn > mt:
            raise InvalidRequestError(f"min_tokens={mn} is out of range: allowed [0, max_tokens={mt}]")
        s = self.seed
        check("seed", s, s is None or (is_int(s) and 0 <= s < 2**64), "an integer in [0, 2^64)")
        check("stop", self.stop, all(isinstance(x, str) and x for x in self.stop), "a list of non-empty strings")
        check("bad_words", self.bad_words, all(isinstance(x, str) and x for x in self.bad_words),
              "a list of non-empty strings")
        check("stop_token_ids", self.stop_token_ids, all(is_int(x) and x >= 0 for x in self.stop_token_ids),
              "a list of integers >= 0")


_arrival_counter = itertools.count()


class Sequence:
    """One request: its tokens, KV block table, progress and timing. Owned by the engine thread."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, priority: int = 0, arrival_time: float | None = None,
                 prompt: str | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt followed by outputs
        self.params = params
        self.max_tokens = max_tokens
        self.priority = priority  # lower value is served first (vLLM's convention); default 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, memoized by the block manager
        self.is_fast_lane = False
        self.num_preemptions = 0
        self.arrival_index = next(_arrival_counter)
        self.admit_index = -1  # order of (last) admission; the most recent is preempted first
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.cumulative_logprob = 0.0
        # Detokenizer state lives with the sequence so preemption keeps it.
        self.output_text = ""
        self.num_text_sent = 0  # characters of output_text already handed out as deltas
        self.detok_prefix_offset = 0
        self.detok_read_offset = 0
        # Sampling state: banned token sequences (the engine tokenizes params.bad_words into these) and the
        # per-request torch.Generator for seeded sampling, created lazily by the sampler so a seeded request
        # draws the same noise whatever shares its batch.
        self.bad_word_ids: list[list[int]] = []
        self.generator = None  # torch.Generator | None; kept untyped so this module needs no torch import

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the one newest token still lacks KV (prompt or recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass
class RequestOutput:
    """What one step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    cumulative_logprob: float = 0.0
    error: str | None = None
