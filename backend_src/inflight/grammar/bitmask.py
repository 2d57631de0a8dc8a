"""One token bitmask per step for the rows that carry a grammar, applied to their logits in one batched call;
unconstrained rows beside them are not touched.

The mask is filled on the host from each row's matcher (its state after the tokens accepted so far), then
applied where the logits are: on CUDA by xgrammar's kernel, on CPU by its C++ loop.
"""
from __future__ import annotations

import numpy as np
import torch


class StepMask:
    """The bitmask buffer, kept between steps and grown to the most rows one step sampled."""

    def __init__(self, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self._bitmask: torch.Tensor | None = None

    def _buffer(self, rows: int, device: torch.device) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            import xgrammar as xgr
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 8), self.vocab_size)
            if device.type == "cuda":
                # Pinned: the copy to the device is then asynchronous and does not wait for the forward. The
                # buffer is written again only next step, after the sampler read this step's tokens.
                self._bitmask = self._bitmask.pin_memory()
        return self._bitmask

    def apply(self, logits: torch.Tensor, seqs: list) -> None:
        """Mask, in place, the logits rows of `seqs` that have a matcher (seq.grammar_matcher). Also sets each such
        row's seq.grammar_must_end: the grammar allows nothing but a stop token now (min_tokens then yields)."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar_matcher is not None]
        if not rows:
            return
        import xgrammar as xgr
        bitmask = self._buffer(logits.shape[0], logits.device)
        need = []
        for i in rows:
            seq = seqs[i]
            if seq.grammar_matcher.fill_next_token_bitmask(bitmask, i):
                need.append(i)
            if seq.params.min_tokens and seq.num_output_tokens < seq.params.min_tokens:
                seq.grammar_must_end = self._only_stop_tokens(bitmask[i].numpy())
        if need:  # a row whose grammar allows every token needs no mask
            mask = bitmask[:logits.shape[0]]
            if logits.device.type != "cpu":
                mask = mask.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab_size, logits.shape[1]),
                                            indices=need)

    def _only_stop_tokens(self, words: np.ndarray) -> bool:
        words = words.view(np.uint32).copy()
        for t in self.stop_token_ids:
            words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        return not words.any()
