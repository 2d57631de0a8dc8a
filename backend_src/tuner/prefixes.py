"""Prefix-cache report: replay a prompt log's block-hash chain through the real BlockManager per block size and
pool size, and say whether prefix caching pays and which block size to use.

Each prompt is admitted (cached prefix looked up and shared), its remaining blocks allocated and filled, its
full blocks published, and it is released `in_flight` prompts later, so that many requests hold blocks at
once as under load; released blocks stay findable until the LRU evicts them, as in the engine.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inflight.block_manager import BlockManager
from inflight.sequence import SamplingParams, Sequence

MiB = 1 << 20


@dataclass
class PrefixRow:
    block_size: int
    pool_mib: float
    num_blocks: int
    prompt_tokens: int
    hit_tokens: int
    skipped: int  # prompts longer than the pool could ever hold

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay(prompts: list[list[int]], block_size: int, num_blocks: int, in_flight: int) -> tuple[int, int, int]:
    """(prompt tokens, tokens served from the cache, prompts skipped) for one block size and pool."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=1)
    live: deque[Sequence] = deque()
    total = skipped = 0
    for i, ids in enumerate(prompts):
        seq = Sequence(str(i), ids, params, 1)
        if bm.blocks_needed(len(ids)) > num_blocks:
            skipped += 1
            continue
        while live and (len(live) >= in_flight or bm.num_free_blocks < bm.blocks_needed(len(ids))):
            bm.free(live.popleft())  # the oldest request finishes: its blocks become evictable cache
        total += len(ids)
        bm.admit(seq)
        bm.allocate(seq, len(ids) - seq.num_computed_tokens)
        seq.num_computed_tokens = len(ids)
        bm.register_full_blocks(seq)
        live.append(seq)
    return total, bm.prefix_hits, skipped


def table(prompts: list[list[int]], block_sizes: list[int], pools_mib: list[float], kv_bytes_per_token: int,
          in_flight: int, progress=print) -> list[PrefixRow]:
    rows = []
    for bs in block_sizes:
        for mib in pools_mib:
            num_blocks = max(1, int(mib * MiB // (kv_bytes_per_token * bs)))
            total, hits, skipped = replay(prompts, bs, num_blocks, in_flight)
            rows.append(PrefixRow(bs, mib, num_blocks, total, hits, skipped))
            progress(f"[prefixes] block {bs}, pool {mib:g} MiB ({num_blocks} blocks): hit rate "
                     f"{rows[-1].hit_rate:.1%}")
    return rows


def recommend(rows: list[PrefixRow], pool_mib: float, min_hit_rate: float = 0.02,
              tolerance: float = 0.05) -> tuple[dict, list[str]]:
    """Options and the reasons. Prefix caching costs a hash per full block (microseconds), so it is worth
    keeping on when it saves any real prefill. Among block sizes, the largest whose prefill work (prompt tokens
    NOT served from the cache) is within `tolerance` of the least wins: larger blocks mean shorter block tables
    and less bookkeeping per step, but they miss the ragged end of every shared prefix."""
    rows = [r for r in rows if not r.skipped]  # a pool that cannot hold some prompt at all is no candidate
    at_pool = [r for r in rows if r.pool_mib == pool_mib] or rows
    best = max(at_pool, key=lambda r: (r.hit_tokens, -r.block_size))
    reasons = []
    enable = best.hit_rate >= min_hit_rate
    if enable:
        reasons.append(f"at a {pool_mib:g} MiB pool, up to {best.hit_rate:.1%} of prompt tokens come from the cache "
                       f"({best.hit_tokens} prefill tokens saved): keep enable_prefix_caching=true")
    else:
        reasons.append(f"at most {best.hit_rate:.1%} of prompt tokens repeat a cached prefix: prefix caching "
                       "saves nothing measurable here (it costs little either way)")

    def computed(r: PrefixRow) -> int:
        return r.prompt_tokens - r.hit_tokens

    least = computed(best)
    good = [r for r in at_pool if computed(r) <= (1 + tolerance) * least]
    pick = max(good, key=lambda r: r.block_size)
    if not enable:
        pick = next((r for r in at_pool if r.block_size == 16), pick)
        reasons.append(f"block_size={pick.block_size}: the default; without reuse the block size only sets the "
                       "last block's waste")
        return {"enable_prefix_caching": False, "block_size": pick.block_size}, reasons
    reasons.append(f"block_size={pick.block_size}: {computed(pick)} prompt tokens left to prefill, within "
                   f"{tolerance:.0%} of the least ({least}, block {best.block_size})")
    worse = [r for r in at_pool if r.block_size > pick.block_size]
    if worse:
        w = min(worse, key=lambda r: r.block_size)
        reasons.append(f"block_size={w.block_size} would prefill {computed(w) / least - 1:+.0%} more prompt tokens "
                       "(it misses the ragged end of shared prefixes)")
    small = [r for r in rows if r.block_size == pick.block_size]
    if len({r.pool_mib for r in small}) > 1:
        enough = min((r for r in small if computed(r) <= (1 + tolerance) * least), key=lambda r: r.pool_mib,
                     default=None)
        if enough is not None:
            reasons.append(f"a pool of {enough.pool_mib:g} MiB already keeps the hits (cached blocks are evicted "
                           "least recently used first)")
    return {"enable_prefix_caching": True, "block_size": pick.block_size}, reasons
