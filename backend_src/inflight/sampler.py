"""Token sampling for one engine step: penalties, bans, temperature, top-k/top-p/min-p and per-request
seeds, applied to a heterogeneous batch in one pass.

Host work is kept off the device's way: everything a step needs from the host (per-row parameters, new
tokens for the penalty counts, banned ids, one random number per sampled row) goes to the device in one
copy, the penalty counts stay on the device between steps, and no kernel is launched per row.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from .sequence import Sequence

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1
# Seeded rows drawing a second time at one output position (redraw=True) use the stream of seed ^ this key.
_REDRAW_KEY = 0x5DEECE66DA3B1F27
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}


@dataclass
class SamplerOutput:
    """One entry per input row.

    logprobs[i] is 0.0 on the plain-greedy fast path when no row asked for logprobs; otherwise it is
    the log-probability of token_ids[i] under the distribution row i was drawn from:
    the model's logits after penalties and bans, divided by the temperature, cut by min-p, top-k and
    top-p, renormalised. A greedy row is drawn from a point mass, whose log-probability would always
    be 0, so for greedy rows we report log_softmax of the penalised logits (temperature 1, no cuts):
    the model's own confidence in the chosen token.
    """
    token_ids: list[int]
    logprobs: list[float]


def is_unprocessed(seq: Sequence) -> bool:
    """True when the row's logits go to temperature and sampling as they are: no penalty, no ban."""
    p = seq.params
    return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and not seq.bad_word_ids
            and (p.min_tokens == 0 or seq.num_output_tokens >= p.min_tokens or seq.grammar_must_end))


def _is_plain_greedy(seq: Sequence) -> bool:
    """True when the row's choice is the argmax of the raw logits: nothing to process."""
    return seq.params.is_greedy and is_unprocessed(seq)


def _has_penalty(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _chosen_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    # logit - logsumexp avoids materialising a second [rows, vocab] tensor for log_softmax.
    return logits.gather(1, token_ids[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform number in (0, 1] a request with `seed` draws its index-th output token with.

    A pure function of (seed, index), so a seeded request's tokens depend on nothing else in its batch,
    and it survives preemption (the index is the output position). 24 bits: exact in float32.
    """
    return ((_splitmix64(seed ^ _splitmix64(index)) >> 40) + 1) / (1 << 24)


class _Upload:
    """Host values a step needs on the device, sent as one copy.

    On CUDA the buffer is pinned and the copy asynchronous, so the host goes on while the forward still runs;
    torch.tensor(values, device="cuda") would wait for the forward at each call. The pinned allocator does
    not hand the buffer out again before the copy is done.
    """

    def __init__(self):
        self._parts: list[np.ndarray] = []

    def add(self, values, dtype) -> int:
        """Queue a 1-D sequence of values; returns its index in send()'s result."""
        self._parts.append(np.asarray(values, dtype=dtype).reshape(-1))
        return len(self._parts) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        offsets, end = [], 0
        for part in self._parts:
            offsets.append(end)
            end += -(-part.nbytes // 8) * 8  # 8-byte aligned, so each part can be viewed as its dtype
        host = torch.empty(end, dtype=torch.uint8, pin_memory=device.type == "cuda")
        buf = host.numpy()
        for part, off in zip(self._parts, offsets):
            buf[off:off + part.nbytes] = part.view(np.uint8)
        dev = host.to(device, non_blocking=True)
        return [dev[off:off + part.nbytes].view(_TORCH_DTYPES[part.dtype]) for part, off in zip(self._parts, offsets)]


class TokenCounts:
    """Per-sequence token counts kept on the device between steps, for the penalties.

    A sequence gets a row the first time a penalty needs it, and its prompt and outputs so far are scattered
    in once; afterwards a step adds only the tokens appended since (one per decode step) instead of rebuilding
    [rows, vocab] counts from every token. Rows are keyed by the Sequence object, and those of sequences
    absent from a step are reused when rows run out, so the table grows to the most rows one step penalised.
    Memory: rows x vocab x 5 bytes (256 x 151936: 195 MB).
    """

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.output: torch.Tensor | None = None  # [rows, vocab] int32: occurrences in the output
        self.prompt: torch.Tensor | None = None  # [rows, vocab] bool: present in the prompt
        self._row_of: dict[Sequence, int] = {}
        self._num_counted: list[int] = []  # tokens of the row's sequence already counted
        self._free: list[int] = []

    def plan(self, seqs: list[Sequence], vocab: int, device: torch.device, up: _Upload) -> tuple[int, ...]:
        """Host side: the rows of seqs and the tokens to add, queued on `up`; apply() does the device side."""
        if self.output is None or self.output.shape[1] != vocab or self.output.device != device:
            self._reset()
            self._grow(len(seqs), vocab, device)
        rows, fresh, p_rows, p_cols, o_rows, o_cols = [], [], [], [], [], []
        for seq in seqs:
            row = self._row_of.get(seq)
            if row is None:
                row = self._row_of[seq] = self._take_row(seqs, vocab, device)
                fresh.append(row)
                p_rows += [row] * seq.num_prompt_tokens
                p_cols += seq.prompt_token_ids
                self._num_counted[row] = seq.num_prompt_tokens
            new = seq.token_ids[self._num_counted[row]:]
            if new:
                o_rows += [row] * len(new)
                o_cols += new
                self._num_counted[row] = len(seq)
            rows.append(row)
        return tuple(up.add(v, np.int64) for v in (rows, fresh, p_rows, p_cols, o_rows, o_cols))

    def apply(self, dev: list[torch.Tensor], plan: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Device side: add the planned tokens; returns the planned rows' output counts [rows, vocab] int32
        and prompt presence [rows, vocab] bool."""
        rows, fresh, p_rows, p_cols, o_rows, o_cols = (dev[i] for i in plan)
        if fresh.numel():  # a reused row starts from zero
            self.output.index_fill_(0, fresh, 0)
            self.prompt.index_fill_(0, fresh, False)
            if p_rows.numel():
                # Values made on the device: a host scalar tensor would be one more copy.
                self.prompt.index_put_((p_rows, p_cols), torch.ones((), dtype=torch.bool, device=fresh.device))
        if o_rows.numel():
            self.output.index_put_((o_rows, o_cols), torch.ones((), dtype=torch.int32, device=rows.device),
                                   accumulate=True)
        return self.output.index_select(0, rows), self.prompt.index_select(0, rows)

    def _take_row(self, live: list[Sequence], vocab: int, device: torch.device) -> int:
        if not self._free:
            keep = set(live)
            for seq in [s for s in self._row_of if s not in keep]:
                self._free.append(self._row_of.pop(seq))
        if not self._free:
            self._grow(2 * self.output.shape[0], vocab, device)
        return self._free.pop()

    def _grow(self, rows: int, vocab: int, device: torch.device) -> None:
        old = 0 if self.output is None else self.output.shape[0]
        rows = max(rows, 8)
        output = torch.zeros((rows, vocab), dtype=torch.int32, device=device)
        prompt = torch.zeros((rows, vocab), dtype=torch.bool, device=device)
        if old:
            output[:old] = self.output
            prompt[:old] = self.prompt
        self.output, self.prompt = output, prompt
        self._num_counted += [0] * (rows - old)
        self._free += range(rows - 1, old - 1, -1)


class Sampler:
    """Chooses the next token of every row. Call from the engine thread only (it keeps per-sequence state).

    Sampled rows are drawn by inverse transform: one uniform number per row, against the cumulative
    probabilities in vocabulary order. `seed` seeds the numbers of unseeded rows (None: a nondeterministic
    seed); a request with params.seed draws seeded_uniform(seed, output index), so its tokens do not
    depend on its batch.
    """

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self._rng = random.Random(seed)
        self.counts = TokenCounts()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int],
                 redraw: bool = False) -> SamplerOutput:
        """redraw: the rows already drew a token at this position (which the caller refused); sampled rows draw
        again with numbers independent of the first ones (a seeded row from a second stream of its seed)."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(seqs)} sequences: "
                             f"allowed [{len(seqs)}, vocab]")
        if logits.dtype != torch.float32:
            logits = logits.float()
        if all(_is_plain_greedy(seq) for seq in seqs):
            token_ids = logits.argmax(dim=-1)
            if all(seq.params.logprobs is None for seq in seqs):
                # The hot path: a logsumexp over the vocabulary per row costs as much as the argmax,
                # so it is paid only when some request asked for logprobs (others report 0.0).
                return SamplerOutput(token_ids.tolist(), [0.0] * len(seqs))
            return SamplerOutput(token_ids.tolist(), _chosen_logprobs(logits, token_ids).tolist())

        # Host side first, all of it, then one copy; the device work follows.
        up = _Upload()
        process = self._plan_process(logits, seqs, eos_token_ids, up)
        greedy = [i for i, seq in enumerate(seqs) if seq.params.is_greedy]
        sampled = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
        sample = self._plan_sample([seqs[i] for i in sampled], logits.shape[1], up, redraw)
        split = bool(greedy) and bool(sampled)
        if split:
            greedy_rows, sampled_rows = up.add(greedy, np.int64), up.add(sampled, np.int64)
        dev = up.send(logits.device)

        logits = self._process(logits, dev, process)
        if not sampled:
            token_ids = logits.argmax(dim=-1)
            return SamplerOutput(token_ids.tolist(), _chosen_logprobs(logits, token_ids).tolist())
        if not greedy:
            token_ids, logprobs = self._sample(logits, dev, sample)
            return SamplerOutput(token_ids.tolist(), logprobs.tolist())
        token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        logprobs = torch.empty(len(seqs), dtype=torch.float32, device=logits.device)
        rows = dev[greedy_rows]
        sub = logits.index_select(0, rows)
        ids = sub.argmax(dim=-1)
        token_ids[rows] = ids
        logprobs[rows] = _chosen_logprobs(sub, ids)
        rows = dev[sampled_rows]
        ids, lps = self._sample(logits.index_select(0, rows), dev, sample)
        token_ids[rows] = ids
        logprobs[rows] = lps
        return SamplerOutput(token_ids.tolist(), logprobs.tolist())

    def uniform(self, seq: Sequence, redraw: bool = False) -> float:
        """The number in (0, 1] the row draws its token with (see __call__ for redraw)."""
        if seq.params.seed is not None:
            return seeded_uniform(seq.params.seed ^ (_REDRAW_KEY if redraw else 0), seq.num_output_tokens)
        return (self._rng.getrandbits(24) + 1) / (1 << 24)

    # ---- logits processing (before temperature) -------------------------------------------------
    def process(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor:
        """A new tensor: repetition/presence/frequency penalties, then min_tokens and bad-word bans (-inf)."""
        up = _Upload()
        plan = self._plan_process(logits, seqs, eos_token_ids, up)
        return self._process(logits, up.send(logits.device), plan)

    def _plan_process(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int],
                      up: _Upload) -> dict:
        vocab = logits.shape[1]
        plan: dict = {}
        penalised = [i for i, seq in enumerate(seqs) if _has_penalty(seq)]
        if penalised:
            pseqs = [seqs[i] for i in penalised]
            plan["rows"] = up.add(penalised, np.int64)
            plan["counts"] = self.counts.plan(pseqs, vocab, logits.device, up)
            plan["params"] = up.add([[s.params.repetition_penalty for s in pseqs],
                                     [s.params.frequency_penalty for s in pseqs],
                                     [s.params.presence_penalty for s in pseqs]], np.float32)
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for i, seq in enumerate(seqs):
            for tok in _banned_tokens(seq, eos_token_ids):
                if 0 <= tok < vocab:  # an id the model cannot emit needs no mask
                    ban_rows.append(i)
                    ban_cols.append(tok)
        if ban_rows:
            plan["bans"] = (up.add(ban_rows, np.int64), up.add(ban_cols, np.int64))
        return plan

    def _process(self, logits: torch.Tensor, dev: list[torch.Tensor], plan: dict) -> torch.Tensor:
        """Only penalised rows get [rows, vocab] helper tensors; the caller's logits are untouched."""
        logits = logits.clone()
        if "rows" in plan:
            rows = dev[plan["rows"]]
            counts, in_prompt = self.counts.apply(dev, plan["counts"])
            in_output = counts > 0
            rep, freq, pres = dev[plan["params"]].view(3, -1, 1)
            sub = logits.index_select(0, rows)
            # Repetition (vLLM): every token seen in prompt or output; shrink positive logits, grow negative.
            sub = torch.where(in_output | in_prompt, torch.where(sub > 0, sub / rep, sub * rep), sub)
            # Presence and frequency (OpenAI): output tokens only; frequency scales with the count.
            sub = sub - freq * counts - pres * in_output
            logits.index_copy_(0, rows, sub)
        if "bans" in plan:
            rows, cols = (dev[i] for i in plan["bans"])
            logits.index_put_((rows, cols), torch.full((), _NEG_INF, device=logits.device))
        return logits

    # ---- random sampling -------------------------------------------------------------------------
    def _plan_sample(self, seqs: list[Sequence], vocab: int, up: _Upload, redraw: bool = False) -> dict:
        params = [seq.params for seq in seqs]
        uniforms = [self.uniform(seq, redraw) for seq in seqs]
        plan = {"min_p": any(p.min_p > 0.0 for p in params),
                "top_k": any(0 < p.top_k < vocab for p in params),
                "top_p": any(p.top_p < 1.0 for p in params)}
        plan["floats"] = up.add([
            [p.temperature for p in params],
            [p.min_p for p in params],
            # top_p == 1 rows get +inf so float rounding in the cumsum never cuts their tail.
            [p.top_p if p.top_p < 1.0 else float("inf") for p in params],
            uniforms], np.float32)
        if plan["top_k"]:
            plan["ks"] = up.add([p.top_k if 0 < p.top_k < vocab else vocab for p in params], np.int64)
        return plan

    def _sample(self, logits: torch.Tensor, dev: list[torch.Tensor], plan: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows all have temperature > 0. Returns (token ids, log-probs under the truncated distribution)."""
        vocab = logits.shape[1]
        temps, min_p, top_p, uniforms = dev[plan["floats"]].view(4, -1, 1)
        logits = logits / temps

        # Order as vLLM v1: min-p on the temperature-scaled distribution, then top-k, then top-p.
        if plan["min_p"]:
            probs = torch.softmax(logits, dim=-1)
            logits.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, _NEG_INF)
        if plan["top_k"] or plan["top_p"]:
            # stable sort: tied logits keep index order, so a row's cut does not depend on its batch.
            sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
            if plan["top_k"]:
                ranks = torch.arange(vocab, device=logits.device)[None, :]
                sorted_logits.masked_fill_(ranks >= dev[plan["ks"]][:, None], _NEG_INF)
            if plan["top_p"]:
                sorted_probs = torch.softmax(sorted_logits, dim=-1)
                mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
                # Keep the smallest prefix whose mass reaches top_p: drop a token once the ones
                # before it already hold top_p. The first token always stays (mass_before = 0).
                sorted_logits.masked_fill_(mass_before >= top_p, _NEG_INF)
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)

        log_probs = torch.log_softmax(logits, dim=-1)
        # Inverse transform in vocabulary order (the same for every row, whatever else is in the batch): the
        # first token whose cumulative probability reaches u x total. u > 0, so a token of probability 0
        # (banned, cut) is never chosen: the cumulative sum does not rise there.
        cdf = log_probs.exp().cumsum(dim=-1)
        token_ids = torch.searchsorted(cdf, uniforms * cdf[:, -1:]).clamp_max_(vocab - 1)
        return token_ids.squeeze(1), log_probs.gather(1, token_ids).squeeze(1)


def _banned_tokens(seq: Sequence, eos_token_ids: set[int]) -> list[int]:
    """Token ids this row may not produce at this step."""
    banned: list[int] = []
    p = seq.params
    if p.min_tokens and seq.num_output_tokens < p.min_tokens and not seq.grammar_must_end:
        # ignore_eos plays no part here: it only tells the engine not to stop on eos. A grammar that allows only
        # its stop token now wins over min_tokens: banning that token would leave the row nothing to sample.
        banned.extend(eos_token_ids if p.end_id is None else (p.end_id,))
        banned.extend(p.stop_token_ids)
    if seq.bad_word_ids:
        num_out = seq.num_output_tokens
        tokens = seq.token_ids
        for word in seq.bad_word_ids:
            if not word:
                continue
            n = len(word) - 1
            # The word's last token is banned once its other tokens end the output (not the prompt).
            if n == 0 or (num_out >= n and tokens[-n:] == word[:-1]):
                banned.append(word[-1])
    return banned
