"""Top log-probabilities per sampled token, for requests that ask for them (SamplingParams.logprobs = k).

As vLLM reports them: from the model's own distribution (log_softmax of the raw logits, before penalties,
temperature or cuts), the sampled token always included with its rank (1 = the most likely token), plus the
k most likely tokens with ranks 1..k.
"""
from __future__ import annotations

import torch


def top_logprobs(logits: torch.Tensor, rows: list[int], chosen: list[int],
                 ks: list[int]) -> list[dict[int, tuple[float, int]]]:
    """For each row of `rows` (indices into logits): {token id: (logprob, rank)} of its chosen token and its
    top ks[i] tokens. One log_softmax and one topk for all rows together."""
    logp = torch.log_softmax(logits.index_select(0, torch.tensor(rows, device=logits.device)).float(), dim=-1)
    chosen_t = torch.tensor(chosen, device=logits.device)
    chosen_lp = logp.gather(1, chosen_t[:, None]).squeeze(1)
    ranks = ((logp > chosen_lp[:, None]).sum(dim=1) + 1).tolist()
    k_max = max(ks)
    top_lp, top_ids = logp.topk(k_max, dim=-1) if k_max else (None, None)
    out = []
    for i, (token, k) in enumerate(zip(chosen, ks)):
        entry = {token: (float(chosen_lp[i]), ranks[i])}
        if k:
            for rank, (tid, lp) in enumerate(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist()), start=1):
                entry.setdefault(tid, (lp, rank))
        out.append(entry)
    return out
