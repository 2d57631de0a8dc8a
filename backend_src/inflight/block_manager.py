"""Paged KV-cache bookkeeping: block pool, per-sequence block tables, ref counts, prefix cache with LRU."""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] = field(default=())  # kept to rule out hash collisions


def chain_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Hash of a full block given the hash of the block before it, so equal hashes mean equal prefixes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class BlockManager:
    """Owns every KV block. A block is in exactly one of: free list, evictable (cached, ref 0), in use."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref-0 cached blocks, oldest first
        self.hash_to_block: dict[bytes, int] = {}
        # (source, destination) block copies the runner must make before the next forward: copy-on-write of
        # a partly filled block that forked samples share.
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found

    # ---- pool state -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: truly free plus cached blocks nobody references."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache -----------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Chained hashes of (at least) the sequence's first full blocks, memoized on it (tokens only grow).

        Returns the memo list itself, not a copy: callers read its first num_full_blocks entries.
        """
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            chunk = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(chain_hash(hashes[-1] if hashes else None, chunk))
        return hashes

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering a prefix of the sequence. The last token is never served from the cache,
        since its logits are needed to sample, so at most (len - 1) // block_size blocks can hit."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        max_blocks = (len(seq) - 1) // self.block_size
        hashes = self._block_hashes(seq, max_blocks)
        for i in range(max_blocks):
            block_id = self.hash_to_block.get(hashes[i])
            chunk = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly filled blocks (KV computed) so later requests can share them.

        Runs after every forward for every scheduled sequence, so it starts where the last call stopped
        (seq.num_registered_blocks) instead of walking the whole table: a decode step costs O(1) per sequence.
        A block left private because an identical one was already published stays private.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = seq.num_registered_blocks
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None or hashes[i] in self.hash_to_block:
                continue  # already published, or an identical block is: keep this one private
            block.block_hash = hashes[i]
            block.token_ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            self.hash_to_block[hashes[i]] = block.block_id
        seq.num_registered_blocks = num_full

    # ---- allocation verbs -------------------------------------------------------------------
    def _take_block(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)  # least recently freed cached block
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} taken while referenced"
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.evictable.pop(block_id, None)
        block.ref_count += 1

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """Could the sequence's table cover num_computed + num_new_tokens, leaving `reserve` blocks free?"""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed <= 0 and reserve <= 0 and not self._needs_copy(seq):
            return True  # most decode steps: the last block has room, and it is this sequence's own
        return self.num_free_blocks - max(needed, 0) - self._needs_copy(seq) >= reserve

    def _needs_copy(self, seq: Sequence) -> bool:
        """The next token lands in a partly filled last block that another sequence still shares."""
        return (bool(seq.block_table) and seq.num_computed_tokens % self.block_size != 0
                and self.blocks[seq.block_table[-1]].ref_count > 1)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child (another sample of the parent's request) shares every block of the parent's computed prompt;
        a shared, partly filled last block is copied when either first writes to it (allocate)."""
        for block_id in parent.block_table:
            self._ref(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    def admit(self, seq: Sequence) -> int:
        """First allocation of a waiting sequence: share cached prefix blocks. Returns tokens served from cache."""
        assert not seq.block_table, f"{seq} admitted with a block table"
        hits = self.lookup_prefix(seq)
        self.prefix_queries += len(seq)
        self.prefix_hits += len(hits) * self.block_size
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = list(hits)
        seq.num_registered_blocks = len(hits)  # published already: that is how they were found
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the table so num_computed + num_new_tokens tokens have slots: a new block only when needed."""
        if self._needs_copy(seq):  # copy-on-write: this sequence gets its own copy of the shared last block
            shared = seq.block_table[-1]
            seq.block_table[-1] = self._take_block()
            self.blocks[shared].ref_count -= 1  # still >= 1: the other sample keeps it
            self.pending_copies.append((shared, seq.block_table[-1]))
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed <= 0:
            return
        if needed > self.num_free_blocks:
            raise RuntimeError(f"allocate: need {needed} blocks, {self.num_free_blocks} free")
        for _ in range(needed):
            seq.block_table.append(self._take_block())

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's computed tokens: the rollback of rejected draft tokens, whose
        slots held KV that no token of the sequence has. Such blocks were allocated for the drafts alone, so
        they are this sequence's only and never published (register_full_blocks stops at computed tokens)."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.block_hash is None, f"block {block.block_id} trimmed while shared"
            block.ref_count = 0
            self.free_ids.append(block.block_id)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay findable until evicted (LRU)."""
        for block_id in reversed(seq.block_table):  # tail first, so a prefix outlives its extensions in LRU
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    # ---- checks -----------------------------------------------------------------------------
    def is_whole(self) -> bool:
        """True when nothing holds a block: every block free or evictable, all ref counts zero."""
        return self.num_free_blocks == self.num_blocks and all(b.ref_count == 0 for b in self.blocks)

    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Raise AssertionError if ref counts disagree with the live block tables or a block is lost."""
        owners = [0] * self.num_blocks
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a block twice"
            for block_id in seq.block_table:
                owners[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != owners {owners[block.block_id]}")
        free = set(self.free_ids)
        evictable = set(self.evictable)
        assert len(free) == len(self.free_ids) and not (free & evictable), "a block is listed twice"
        in_use = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert not (in_use & (free | evictable)), "a referenced block is on a free list"
        assert len(in_use) + len(free) + len(evictable) == self.num_blocks, "a block is lost"

    def internal_waste(self, live_seqs: list[Sequence]) -> float:
        """Fraction of allocated slots that hold no token (the tail of each sequence's last block)."""
        allocated = sum(len(s.block_table) for s in live_seqs) * self.block_size
        if not allocated:
            return 0.0
        used = sum(min(len(s), len(s.block_table) * self.block_size) for s in live_seqs)
        return 1.0 - used / allocated
