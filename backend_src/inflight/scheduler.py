"""One scheduling decision per step: running requests first, then prefill chunks under the token budget."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Collection

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens to compute now)
    preempted: list[Sequence] = field(default_factory=list)
    drafted: list[Sequence] = field(default_factory=list)  # scheduled with draft tokens (Sequence.spec_token_ids)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the queues and the block manager: every block is allocated, shared and freed through here."""

    def __init__(self, config: EngineConfig, num_blocks: int):
        self.config = config
        self.bm = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in admission order
        self._admit_counter = itertools.count()
        self.num_preemptions = 0
        self.watermark_blocks = int(config.watermark * num_blocks)
        self.speculating = False  # some running request has drafts (Sequence.spec_token_ids) to schedule

    # ---- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        cfg = self.config
        seq.is_fast_lane = seq.priority < 0 or (
            seq.num_prompt_tokens <= cfg.fast_lane_max_prompt_tokens and seq.max_tokens <= cfg.fast_lane_max_tokens)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.bm.free(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start another sample of the parent's request beside it, sharing its computed prompt."""
        self.bm.fork(parent, child)
        child.is_fast_lane = parent.is_fast_lane
        child.status = SequenceStatus.RUNNING
        child.admit_index = next(self._admit_counter)
        self.running.append(child)

    def advance(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """After the forward: the scheduled tokens' KV is in the cache, and blocks it filled become shareable.
        Draft tokens are not counted yet: their KV holds only once verification accepts them (commit_drafts)."""
        for seq, num_new in scheduled:
            seq.num_computed_tokens += num_new - len(seq.spec_token_ids)
            self.bm.register_full_blocks(seq)

    def commit_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification, the sequence's tokens now include its first num_accepted drafts: their KV is kept
        (and full blocks published), the rejected drafts' slots are rolled back, blocks past them given back."""
        seq.spec_token_ids = []
        seq.num_computed_tokens += num_accepted
        self.bm.register_full_blocks(seq)
        self.bm.trim(seq)

    # ---- the decision -----------------------------------------------------------------------
    def schedule(self, members: Collection[Sequence] | None = None) -> SchedulerOutput:
        """One step's decision. `members`: someone else (Triton's iterative sequence batcher) decided who is in
        this step; only they are scheduled, new ones among them admitted in arrival order (no fast lane, no
        priorities), and everyone else keeps its KV untouched until it is handed in again. The token budget,
        chunked prefill, prefix hits and preemption work as always: they decide how much of each member runs."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        running = self.running if members is None else [s for s in self.running if s in members]

        # 1. Running requests: decodes first (they are latency-bound), then unfinished prefill chunks.
        for seq in sorted(running, key=lambda s: s.is_prefilling):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                continue
            while not self.bm.can_allocate(seq, num_new):
                victim = max(self.running, key=lambda s: (s.priority, s.admit_index))
                self._preempt(victim, out)
                if id(victim) in scheduled_ids:
                    scheduled_ids.discard(id(victim))
                    refund = next(n for s, n in out.scheduled if s is victim)
                    out.scheduled = [(s, n) for s, n in out.scheduled if s is not victim]
                    budget += refund
                if victim is seq:
                    break
            else:
                self.bm.allocate(seq, num_new)
                out.scheduled.append((seq, num_new))
                scheduled_ids.add(id(seq))
                budget -= num_new

        # 2. Draft tokens of the decodes, with what the decodes left, and never at the price of a preemption.
        if self.speculating:
            budget -= self._grant_drafts(out, budget, scheduled_ids)

        # 3. Admissions, none in a step that preempted (the pool is already too tight).
        if out.preempted:
            return out
        if members is None:
            self._admit(out, budget)
        else:  # preempted members first (they held KV before), then by arrival
            queue = sorted((s for s in self.waiting if s in members),
                           key=lambda s: (s.status != SequenceStatus.PREEMPTED, s.arrival_index))
            self._admit_from(queue, budget, out)
        return out

    def _grant_drafts(self, out: SchedulerOutput, budget: int, scheduled_ids: set[int]) -> int:
        """Extend each scheduled decode that has drafts (Sequence.spec_token_ids) by as many as the token budget and
        the free blocks above the watermark allow, in running order; other drafts are dropped. In a step that
        preempted no drafts run: the pool is short already. Returns the budget used."""
        self.speculating = False
        used = 0
        bs = self.bm.block_size
        for i, (seq, num_new) in enumerate(out.scheduled):
            drafts = seq.spec_token_ids
            if not drafts:
                continue
            k = 0 if out.preempted or num_new != seq.num_uncomputed_tokens else min(len(drafts), budget - used)
            if k and not self.bm.can_allocate(seq, num_new + k, reserve=self.watermark_blocks):
                k = min(k, len(seq.block_table) * bs - seq.num_computed_tokens - num_new)  # the room its blocks have
            seq.spec_token_ids = drafts[:k]
            if k:
                self.bm.allocate(seq, num_new + k)
                out.scheduled[i] = (seq, num_new + k)
                out.drafted.append(seq)
                used += k
        for seq in self.running:  # not scheduled this step (budget), or preempted and back: no drafts
            if seq.spec_token_ids and id(seq) not in scheduled_ids:
                seq.spec_token_ids = []
        for seq in out.preempted:
            seq.spec_token_ids = []
        return used

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        if self.config.static_batching:
            if not self.running:  # the whole batch joins at once; prefill chunks beyond the budget follow
                self._admit_from(sorted(self.waiting, key=lambda s: (s.priority, s.arrival_index)), budget, out,
                                 admit_past_budget=True)
            return
        # Preempted requests come back first, then by priority (lower first), then by arrival.
        queue = sorted(self.waiting, key=lambda s: (s.status != SequenceStatus.PREEMPTED, s.priority,
                                                    s.arrival_index))
        fast = [s for s in queue if s.is_fast_lane]
        normal = [s for s in queue if not s.is_fast_lane]
        # The fast lane goes first but, while normal requests wait, may take only its share of the budget;
        # the normal lane then gets the rest, and the fast lane anything still left.
        fast_cap = int(self.config.fast_lane_share * self.config.max_num_batched_tokens) if normal else budget
        used = self._admit_from(fast, min(budget, fast_cap), out)
        budget -= used
        budget -= self._admit_from(normal, budget, out)
        self._admit_from([s for s in fast if s.status != SequenceStatus.RUNNING], budget, out)

    def _admit_from(self, queue: list[Sequence], budget: int, out: SchedulerOutput,
                    admit_past_budget: bool = False) -> int:
        used = 0
        for seq in queue:
            if len(self.running) >= self.config.max_num_seqs or (budget - used <= 0 and not admit_past_budget):
                break
            if not seq.forked and len(self.running) + seq.params.n > self.config.max_num_seqs:
                continue  # its samples will fork into running slots: they must all fit
            if seq.waits_for_grammar:
                continue  # its grammar is still compiling (off the engine thread); it takes no block until then
            hit_ids = self.bm.lookup_prefix(seq)
            num_hit_blocks = len(hit_ids)
            num_cached = num_hit_blocks * self.bm.block_size
            num_new = min(len(seq) - num_cached, budget - used)
            if num_new < len(seq) - num_cached and not self.config.enable_chunked_prefill:
                continue
            # Hit blocks nobody references are counted as free now, so taking them costs free blocks too.
            revived = sum(1 for b in hit_ids if self.bm.blocks[b].ref_count == 0)
            needed = self.bm.blocks_needed(num_cached + num_new) - num_hit_blocks + revived
            if self.bm.num_free_blocks - needed < self.watermark_blocks:
                continue  # does not fit now; later, smaller requests may (no head-of-line blocking)
            self.waiting.remove(seq)
            self.bm.admit(seq)
            self.bm.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            seq.admit_index = next(self._admit_counter)
            self.running.append(seq)
            if num_new:
                out.scheduled.append((seq, num_new))
            used += num_new
        return used

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        """Recompute-style preemption: drop the victim's KV and put it back at the front of the queue."""
        self.running.remove(victim)
        self.bm.free(victim)
        victim.status = SequenceStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, victim)
        out.preempted.append(victim)
