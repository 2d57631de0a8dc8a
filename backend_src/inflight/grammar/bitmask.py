"""One token bitmask per step for the rows that carry a grammar, applied to their logits in one batched call;
unconstrained rows beside them are not touched. On CPU most constrained rows skip the mask: their sampled token is
checked against the grammar first, and only a refused one pays for its row's mask.

The mask is filled on the host from each row's matcher (its state after the tokens accepted so far), then
applied where the logits are: on CUDA by xgrammar's kernel, on CPU by its C++ loop.

Checking first (CPU only; the `checked` rows of apply and settle): applying the mask costs about 0.13 ms per row
of 49152 logits on a CPU core (4.3 ms a step at 32 constrained rows), more than the rest of the step's host work
together, while a matcher's accept of one token costs about a microsecond. So a row whose choice does not need
the whole masked distribution samples from its unmasked logits, and its matcher is asked whether it accepts the
token: accepted (the common case for a model that follows the format), the row is done; refused, its row of the
mask is filled and it chooses again from its masked logits. What each kind of row gets:

- greedy: the argmax of the logits is allowed, so it is also the argmax of the masked logits (masking only lowers
  other tokens to -inf; ties keep the lowest id either way). The same token as the full mask, always. A refused
  row's masked argmax is found from its allowed ids alone when they are few (one gather, no [vocab] pass).
- sampled with temperature only (no top-k, top-p or min-p): with p the row's distribution (penalties and bans
  commute with the mask, both only set -inf or shift finite logits) and Z the mass of the allowed set A, the
  masked distribution is p(t) / Z on A. Drawing t ~ p, keeping it if t is in A and else drawing again from the
  masked distribution with an independent number, gives t in A with probability p(t) + (1 - Z) p(t) / Z = p(t) / Z:
  exactly the masked distribution (the second draw must not reuse the first's number; the sampler's redraw gives
  seeded rows a second stream of their seed). The draws differ from the full mask's for the same seed; their law
  does not.
- everything else is masked before sampling as before: top-k/top-p/min-p cut the masked distribution, which is not
  the unmasked cut conditioned on A; logprobs (and cumulative_logprob, which asks for them) are of the masked
  distribution; min_tokens reads the mask (may the grammar only end?); an unforked request with n > 1 forks its
  samples from this row's logits; a step that verifies drafts samples its rows once; on CUDA the mask is applied
  while the forward runs, and a check after sampling would wait for it.
A checked row's logprob is not of the masked distribution; such rows report none (see above).
"""
from __future__ import annotations

import numpy as np
import torch

from ..sampler import Sampler, is_unprocessed



class StepMask:
    """The bitmask buffer, kept between steps and grown to the most rows one step sampled."""

    def __init__(self, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self._bitmask: torch.Tensor | None = None
        # Rows checked after sampling, and how many of them the grammar refused (benchmarks read these).
        self.num_checked = 0
        self.num_refused = 0

    def _buffer(self, rows: int, device: torch.device) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            import xgrammar as xgr
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 8), self.vocab_size)
            if device.type == "cuda":
                # Pinned: the copy to the device is then asynchronous and does not wait for the forward. The
                # buffer is written again only next step, after the sampler read this step's tokens.
                self._bitmask = self._bitmask.pin_memory()
        return self._bitmask

    def apply(self, logits: torch.Tensor, seqs: list, check_first: bool = True) -> list[int]:
        """Mask, in place, the logits rows of `seqs` that have a matcher (seq.grammar_matcher), except those that
        may be checked after sampling instead (CPU, check_first, see the module docstring): their indices are
        returned, for settle(). Also sets each masked row's seq.grammar_must_end while min_tokens holds: the
        grammar allows nothing but a stop token now (min_tokens then yields)."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar_matcher is not None]
        if not rows:
            return []
        checkable = check_first and logits.device.type == "cpu"
        checked: list[int] = []
        masked: list[int] = []
        for i in rows:
            (checked if checkable and _may_check_after_sampling(seqs[i], logits.shape[1]) else masked).append(i)
        if masked:
            self._mask(logits, seqs, masked)
        return checked

    def settle(self, logits: torch.Tensor, seqs: list, checked: list[int], tokens: list[int], logprobs: list[float],
               sampler: Sampler, eos_token_ids: set[int]) -> None:
        """After sampling: each checked row keeps a token its grammar accepts; a refused one is chosen again under
        its mask (sampled rows with the sampler's redraw numbers). tokens and logprobs are updated in place."""
        refused = []
        for i in checked:
            matcher = seqs[i].grammar_matcher
            if matcher.accept_token(tokens[i]):
                matcher.rollback(1)  # the engine accepts it with the step's other tokens
            else:
                refused.append(i)
        self.num_checked += len(checked)
        self.num_refused += len(refused)
        if not refused:
            return
        bitmask = self._buffer(logits.shape[0], logits.device)
        for i in refused:
            seqs[i].grammar_matcher.fill_next_token_bitmask(bitmask, i)
        rest = self._choose_from_allowed(logits, seqs, refused, bitmask, sampler, tokens, logprobs)
        if rest:  # penalised or banned rows: the whole mask, then the sampler as in the first draw
            self._apply(logits, bitmask, rest)
            again = sampler(logits.index_select(0, torch.tensor(rest, device=logits.device)), [seqs[i] for i in rest],
                            eos_token_ids, redraw=True)
            for i, token, logprob in zip(rest, again.token_ids, again.logprobs):
                tokens[i], logprobs[i] = token, logprob

    def _mask(self, logits: torch.Tensor, seqs: list, rows: list[int]) -> None:
        bitmask = self._buffer(logits.shape[0], logits.device)
        need = []
        for i in rows:
            seq = seqs[i]
            if seq.grammar_matcher.fill_next_token_bitmask(bitmask, i):
                need.append(i)
            if seq.params.min_tokens and seq.num_output_tokens < seq.params.min_tokens:
                seq.grammar_must_end = self._only_stop_tokens(bitmask[i].numpy())
        if need:  # a row whose grammar allows every token needs no mask
            self._apply(logits, bitmask, need)

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        import xgrammar as xgr
        mask = bitmask[:logits.shape[0]]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab_size, logits.shape[1]), indices=rows)

    def _choose_from_allowed(self, logits: torch.Tensor, seqs: list, refused: list[int], bitmask: torch.Tensor,
                             sampler: Sampler, tokens: list[int], logprobs: list[float]) -> list[int]:
        """Refused rows whose logits need no processing choose among their allowed tokens' logits, read through
        the mask row, without writing the logits: the greedy ones their argmax, the sampled ones a draw from them
        (the masked distribution, in vocabulary order as the sampler draws). Returns the rows left to the whole
        mask and the sampler."""
        if logits.shape[1] > self.vocab_size:  # xgrammar leaves logits past its vocabulary unmasked
            return refused
        values = logits.float().numpy()  # views, no copies (float32 on CPU)
        words = bitmask.numpy().view(np.uint32)
        rest = []
        for i in refused:
            seq = seqs[i]
            block = _allowed_block(values[i], words[i]) if is_unprocessed(seq) else None
            if block is None:  # penalised or banned, or a row that allows nothing: as before
                rest.append(i)
            elif seq.params.is_greedy:
                tokens[i] = _argmax(*block)
                logprobs[i] = 0.0  # as the sampler's greedy fast path: nobody asked (logprobs rows are not checked)
            else:
                tokens[i], logprobs[i] = _draw(*block, seq.params.temperature, sampler.uniform(seq, redraw=True))
        return rest

    def _only_stop_tokens(self, words: np.ndarray) -> bool:
        words = words.view(np.uint32).copy()
        for t in self.stop_token_ids:
            words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        return not words.any()


def _may_check_after_sampling(seq, width: int) -> bool:
    """Whether the row's token may be drawn unmasked and checked after (the module docstring says why not)."""
    p = seq.params
    if p.logprobs is not None or (p.min_tokens and seq.num_output_tokens < p.min_tokens):
        return False
    if not seq.forked:  # n > 1, first token: the other samples draw from this row's logits
        return False
    return p.is_greedy or (not 0 < p.top_k < width and p.top_p >= 1.0 and p.min_p == 0.0)


def _allowed_block(values: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The logits of a mask row's allowed tokens: (word indices [k] ascending, their logits [k * 32] with -inf where
    a token is refused), from values ([width] float32) and the mask row `words` (bit b of word w is token 32 w + b).
    When few words hold allowed tokens (a JSON key, a comma, a digit), only those words' logits are read; when
    most do (inside a string), all. None when no token of finite logit is allowed."""
    words = words[:-(-len(values) // 32)]  # the words of tokens the logits have
    which = np.flatnonzero(words)
    if 2 * len(which) > len(words):
        which = np.arange(len(words))
    if len(values) % 32:  # a vocabulary that ends inside a word: its tail reads as refused
        values = np.concatenate([values, np.full(32 - len(values) % 32, -np.inf, dtype=values.dtype)])
    allowed = np.unpackbits(words[which].view(np.uint8), bitorder="little").view(bool)  # little-endian words
    block = np.where(allowed, values.reshape(-1, 32)[which].ravel(), -np.inf)
    return (which, block) if len(block) and block.max() > -np.inf else None


def _token_of(which: np.ndarray, position: int) -> int:
    return int(which[position >> 5]) * 32 + (position & 31)


def _argmax(which: np.ndarray, block: np.ndarray) -> int:
    """The lowest id of the largest logit, as torch's argmax over the masked row."""
    return _token_of(which, int(np.argmax(block)))


def _draw(which: np.ndarray, block: np.ndarray, temperature: float, uniform: float) -> tuple[int, float]:
    """The sampler's inverse transform over the allowed tokens: the first whose cumulative probability reaches
    uniform x total (refused tokens add nothing, uniform > 0: never one of them). Returns (token, logprob)."""
    scaled = block / temperature
    probs = np.exp(scaled - scaled.max())
    cdf = np.cumsum(probs, dtype=np.float64)
    position = min(int(np.searchsorted(cdf, uniform * cdf[-1])), len(cdf) - 1)
    return _token_of(which, position), float(np.log(probs[position] / cdf[-1]))
