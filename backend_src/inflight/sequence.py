"""The one mutable record per request (Sequence), its sampling parameters and finish reasons."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass

from .fields import SAMPLING_FIELDS, InvalidRequestError, sampling_dataclass
from .grammar.spec import GrammarSpec, spec_of


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


@sampling_dataclass
class SamplingParams:
    """How one request samples. Its fields, their defaults and allowed ranges are the sampling rows of
    inflight.fields.FIELDS (max_tokens None: the engine's default_max_tokens; seed None: unseeded)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Check every field against the table, normalising as clients send values (a lone stop string
        becomes a list, numeric strings become numbers)."""
        for f in SAMPLING_FIELDS:
            setattr(self, f.name, f.parse(getattr(self, f.name)))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens={self.min_tokens} is out of range: "
                                      f"allowed [0, max_tokens={self.max_tokens}]")
        # The output constraint, checked here (in the caller's thread); not a dataclass field, so it is
        # derived again wherever the fields are (dataclasses.replace, the dynamic arm's JSON).
        self.grammar: GrammarSpec | None = spec_of(self)


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
        self.num_registered_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        # Draft tokens to verify in the next step (speculation/): set before scheduling, trimmed by the scheduler
        # to what it grants, cleared once verified. Never part of token_ids until accepted.
        self.spec_token_ids: list[int] = []
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
        self.detok_stream = None  # the tokenizers DecodeStream rendering this request (False: not used)
        self.detok_num_fed = 0  # output tokens fed to it
        # Banned token sequences: the engine tokenizes params.bad_words into these for the sampler.
        self.bad_word_ids: list[list[int]] = []
        # Samples of one request (SamplingParams.n): the first sequence carries the request's id; once its prompt
        # is computed it forks the others, which share its KV blocks (block_manager.fork) and its group_id.
        self.group_id = request_id
        self.sample_index = 0
        self.forked = params.n == 1
        # Structured output (inflight/grammar): the compiled grammar's handle while it compiles or once ready, and
        # this sample's own matcher (None: unconstrained, or the grammar is not ready yet).
        self.grammar = None  # grammar.compiler.GrammarHandle
        self.grammar_matcher = None  # xgrammar.GrammarMatcher
        self.grammar_must_end = False  # this step the grammar allows only a stop token (min_tokens yields)

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

    @property
    def waits_for_grammar(self) -> bool:
        """Not admitted until its grammar is compiled (it holds no KV block meanwhile)."""
        return self.grammar is not None and self.grammar_matcher is None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass
class TokenLogprobs:
    """One output token's log-probabilities, for requests with SamplingParams.logprobs set.

    logprob: under the distribution the token was drawn from (what cumulative_logprob sums); top: token id ->
    (logprob under the model's raw distribution, rank, its text), the sampled token and the top k (vLLM)."""
    token_id: int
    logprob: float
    top: dict[int, tuple[float, int, str]]


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
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    index: int = 0  # which of the request's n samples (request_id names the request, not the sample)
    refused: bool = False  # an ERROR that is the client's input (a grammar that cannot be compiled), not a fault
    num_cached_tokens: int = 0  # of the prompt's tokens, how many the prefix cache held at admission
