"""StaticDecode.prepare keeps block tables per sequence between steps and writes only what changed: the
buffers it fills must still equal a from-scratch build at every step, whatever happens to the tables."""
from __future__ import annotations

import random

import torch

from inflight.cuda_graphs import StaticDecode
from inflight.sequence import SamplingParams, Sequence

BLOCK = 4
MAX_SEQS = 8
MAX_LEN = 64


def _static() -> StaticDecode:
    return StaticDecode(lambda *a: None, [], max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN, block_size=BLOCK,
                        hidden_size=2, dtype=torch.float32, device=torch.device("cpu"))


class Pool:
    """Hands out distinct block ids, as the block manager would."""

    def __init__(self):
        self.next_id = 1  # block 0 is what padding points at

    def take(self) -> int:
        self.next_id += 1
        return self.next_id


def _new_seq(rng: random.Random, pool: Pool, name: str) -> Sequence:
    seq = Sequence(name, [rng.randrange(100) for _ in range(rng.randint(1, 20))], SamplingParams(), 1000)
    seq.block_table = [pool.take() for _ in range((len(seq) + BLOCK - 1) // BLOCK)]
    seq.num_computed_tokens = len(seq) - 1  # the newest token is the one this step computes
    return seq


def _advance(seq: Sequence, rng: random.Random, pool: Pool) -> None:
    """After a step: its token is computed, a new one is sampled, and a block is added when it is needed."""
    seq.num_computed_tokens = len(seq)
    seq.append_token(rng.randrange(100))
    if len(seq.block_table) * BLOCK < len(seq):
        seq.block_table.append(pool.take())


def _check(static: StaticDecode, scheduled, out) -> None:
    ids, pos, meta, sample_idx, sample_seqs = out
    bucket = ids.shape[0]
    num = len(scheduled)
    assert bucket >= num and meta.block_tables.shape[0] == bucket
    for i, (seq, _) in enumerate(scheduled):
        p = seq.num_computed_tokens
        table = seq.block_table
        assert ids[i].item() == seq.token_ids[p] and pos[i].item() == p
        assert meta.slot_mapping[i].item() == table[p // BLOCK] * BLOCK + p % BLOCK
        assert meta.seq_lens[i].item() == p + 1 == meta.seq_lens_host[i]
        assert meta.block_tables[i, :len(table)].tolist() == table, f"row {i}"
    for i in range(num, bucket):  # padding: writes nothing, reads one key of block 0
        assert meta.slot_mapping[i].item() == -1 and meta.seq_lens[i].item() == 1
        assert meta.block_tables[i, 0].item() == 0
    assert sample_seqs == [seq for seq, _ in scheduled] and sample_idx == list(range(num))


def test_tables_stay_exact_through_growth_reordering_replacement_and_turnover():
    rng = random.Random(0)
    pool = Pool()
    static = _static()
    live = [_new_seq(rng, pool, f"s{i}") for i in range(5)]
    for step in range(300):
        event = rng.random()
        if event < 0.1 and len(live) > 1:
            live.pop(rng.randrange(len(live)))  # finished
        elif event < 0.25 and len(live) < MAX_SEQS:
            live.append(_new_seq(rng, pool, f"n{step}"))  # admitted
        elif event < 0.3:
            seq = rng.choice(live)  # preempted and re-admitted: a new table list, other blocks but the last
            seq.block_table = [pool.take() for _ in seq.block_table[:-1]] + seq.block_table[-1:]
        elif event < 0.35:
            seq = rng.choice(live)  # its last block replaced in place (copy-on-write)
            seq.block_table[-1] = pool.take()
        batch = rng.sample(live, rng.randint(1, len(live)))  # any subset, any order
        scheduled = [(seq, 1) for seq in batch]
        _check(static, scheduled, static.prepare(scheduled))
        for seq in batch:
            _advance(seq, rng, pool)
        live = [seq for seq in live if len(seq) < MAX_LEN] or [_new_seq(rng, pool, f"r{step}")]  # at max_model_len


def test_a_step_writes_only_new_block_ids():
    rng = random.Random(1)
    pool = Pool()
    static = _static()
    seqs = [_new_seq(rng, pool, f"s{i}") for i in range(4)]
    static.prepare([(s, 1) for s in seqs])
    writes = []
    table = static._tables_np

    class Spy:
        def __setitem__(self, key, value):
            writes.append(key)
            table[key] = value

        def __getattr__(self, name):
            return getattr(table, name)
    static._tables_np = Spy()
    for _ in range(2 * BLOCK):
        for seq in seqs:
            _advance(seq, rng, pool)
        static.prepare([(s, 1) for s in seqs])
    # Each sequence crossed into new blocks twice in 2 x BLOCK tokens: one one-id write each time.
    assert len(writes) == 2 * len(seqs)
    assert all(key[1].stop - key[1].start == 1 for key in writes)
