"""Token sampling for one engine step: penalties, bans, temperature, top-k/top-p/min-p and per-request
seeds, applied to a heterogeneous batch in one pass."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .sequence import Sequence

_NEG_INF = float("-inf")


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


def _is_plain_greedy(seq: Sequence) -> bool:
    """True when the row's choice is the argmax of the raw logits: nothing to process."""
    p = seq.params
    return (p.is_greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0 and not seq.bad_word_ids
            and (p.min_tokens == 0 or seq.num_output_tokens >= p.min_tokens))


def _chosen_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    # logit - logsumexp avoids materialising a second [rows, vocab] tensor for log_softmax.
    return logits.gather(1, token_ids[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


class Sampler:
    """Chooses the next token of every row. Call from the engine thread only (it owns generators).

    `seed` seeds the generator shared by the unseeded sampled rows (None: a nondeterministic seed).
    A request with params.seed gets its own torch.Generator on `seq.generator` and draws exactly one
    vocab-sized noise vector from it per sampled step, so its tokens do not depend on its batch.
    """

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> SamplerOutput:
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

        logits = self.process(logits, seqs, eos_token_ids)
        greedy = [i for i, seq in enumerate(seqs) if seq.params.is_greedy]
        if len(greedy) == len(seqs):
            token_ids = logits.argmax(dim=-1)
            return SamplerOutput(token_ids.tolist(), _chosen_logprobs(logits, token_ids).tolist())

        device = logits.device
        token_ids = torch.empty(len(seqs), dtype=torch.long, device=device)
        logprobs = torch.empty(len(seqs), dtype=torch.float32, device=device)
        if greedy:
            rows = torch.tensor(greedy, device=device)
            sub = logits.index_select(0, rows)
            ids = sub.argmax(dim=-1)
            token_ids[rows] = ids
            logprobs[rows] = _chosen_logprobs(sub, ids)
            sampled = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
            rows = torch.tensor(sampled, device=device)
            ids, lps = self._sample(logits.index_select(0, rows), [seqs[i] for i in sampled])
            token_ids[rows] = ids
            logprobs[rows] = lps
        else:
            token_ids, logprobs = self._sample(logits, seqs)
        return SamplerOutput(token_ids.tolist(), logprobs.tolist())

    # ---- logits processing (before temperature) -------------------------------------------------
    def process(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor:
        """A new tensor: repetition/presence/frequency penalties, then min_tokens and bad-word bans (-inf).

        Only rows that need a penalty get a [rows, vocab] helper tensor; the caller's logits are untouched.
        """
        logits = logits.clone()
        vocab = logits.shape[1]
        device = logits.device

        rep = [i for i, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
        if rep:
            # vLLM semantics: every token seen in prompt or output; shrink positive logits, grow negative.
            rows = torch.tensor(rep, device=device)
            seen = _token_counts([seqs[i].token_ids for i in rep], vocab, device) > 0
            pen = torch.tensor([seqs[i].params.repetition_penalty for i in rep], device=device)[:, None]
            sub = logits.index_select(0, rows)
            penalised = torch.where(sub > 0, sub / pen, sub * pen)
            logits[rows] = torch.where(seen, penalised, sub)

        pf = [i for i, seq in enumerate(seqs)
              if seq.params.presence_penalty != 0.0 or seq.params.frequency_penalty != 0.0]
        if pf:
            # OpenAI semantics: output tokens only; frequency scales with the count, presence is flat.
            rows = torch.tensor(pf, device=device)
            counts = _token_counts([seqs[i].token_ids[seqs[i].num_prompt_tokens:] for i in pf], vocab, device)
            freq = torch.tensor([seqs[i].params.frequency_penalty for i in pf], device=device)[:, None]
            pres = torch.tensor([seqs[i].params.presence_penalty for i in pf], device=device)[:, None]
            logits[rows] = logits.index_select(0, rows) - freq * counts - pres * (counts > 0)

        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for i, seq in enumerate(seqs):
            banned = _banned_tokens(seq, eos_token_ids)
            for tok in banned:
                if 0 <= tok < vocab:  # an id the model cannot emit needs no mask
                    ban_rows.append(i)
                    ban_cols.append(tok)
        if ban_rows:
            logits[torch.tensor(ban_rows, device=device), torch.tensor(ban_cols, device=device)] = _NEG_INF
        return logits

    # ---- random sampling -------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows all have temperature > 0. Returns (token ids, log-probs under the truncated distribution)."""
        device = logits.device
        vocab = logits.shape[1]
        params = [seq.params for seq in seqs]
        temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
        logits = logits / temps

        # Order as vLLM v1: min-p on the temperature-scaled distribution, then top-k, then top-p.
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
            probs = torch.softmax(logits, dim=-1)
            cutoff = probs.amax(dim=-1, keepdim=True) * min_p
            logits.masked_fill_(probs < cutoff, _NEG_INF)

        use_k = any(0 < p.top_k < vocab for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        if use_k or use_p:
            # stable sort: tied logits keep index order, so a row's cut does not depend on its batch.
            sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
            if use_k:
                ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
                ranks = torch.arange(vocab, device=device)[None, :]
                sorted_logits.masked_fill_(ranks >= ks[:, None], _NEG_INF)
            if use_p:
                # top_p == 1 rows get +inf so float rounding in the cumsum never cuts their tail.
                ps = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params],
                                  device=device)[:, None]
                sorted_probs = torch.softmax(sorted_logits, dim=-1)
                mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
                # Keep the smallest prefix whose mass reaches top_p: drop a token once the ones
                # before it already hold top_p. The first token always stays (mass_before = 0).
                sorted_logits.masked_fill_(mass_before >= ps, _NEG_INF)
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)

        log_probs = torch.log_softmax(logits, dim=-1)
        noise = self._exponential_noise(seqs, logits.shape, device)
        # Exponential race (Gumbel-max in disguise): argmax p_i / E_i draws i with probability p_i.
        token_ids = (log_probs.exp() / noise).argmax(dim=-1)
        return token_ids, log_probs.gather(1, token_ids[:, None]).squeeze(1)

    def _exponential_noise(self, seqs: list[Sequence], shape: torch.Size, device: torch.device) -> torch.Tensor:
        noise = torch.empty(shape, device=device)
        seeded = [i for i, seq in enumerate(seqs) if seq.params.seed is not None]
        if len(seeded) < len(seqs):
            shared = self._shared_generator(device)
            if not seeded:
                noise.exponential_(generator=shared)
            else:
                rows = torch.tensor([i for i, seq in enumerate(seqs) if seq.params.seed is None], device=device)
                block = torch.empty((len(rows), shape[1]), device=device).exponential_(generator=shared)
                noise[rows] = block
        for i in seeded:
            noise[i].exponential_(generator=_seq_generator(seqs[i], device))
        # exponential_ can return exactly 0; a 0/0 would be NaN, which argmax would pick.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen


def _seq_generator(seq: Sequence, device: torch.device) -> torch.Generator:
    gen = seq.generator
    if gen is None or gen.device != device:
        gen = torch.Generator(device=device)
        gen.manual_seed(seq.params.seed)
        seq.generator = gen
    return gen


def _banned_tokens(seq: Sequence, eos_token_ids: set[int]) -> list[int]:
    """Token ids this row may not produce at this step."""
    banned: list[int] = []
    p = seq.params
    if p.min_tokens and seq.num_output_tokens < p.min_tokens:
        # ignore_eos plays no part here: it only tells the engine not to stop on eos.
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


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32 occurrence counts, built with one scatter."""
    counts = torch.zeros((len(token_lists), vocab), dtype=torch.float32, device=device)
    lengths = [len(t) for t in token_lists]
    if sum(lengths) == 0:
        return counts
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor(lengths)).to(device)
    cols = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    counts.index_put_((rows, cols), torch.ones(len(cols), device=device), accumulate=True)
    return counts
