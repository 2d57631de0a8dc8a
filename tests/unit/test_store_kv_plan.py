"""The torch reference's store_kv decides once per step (through the step's plan) whether any token lacks a
slot, and every layer then writes the same tokens as the plan-less call does."""
import torch

from inflight.attention import reference


def test_layers_sharing_a_plan_write_what_separate_calls_write_and_skip_minus_one():
    blocks, block_size, heads, d = 4, 4, 2, 8
    slots = torch.tensor([3, -1, 9, 14])
    plan: dict = {}
    for _ in range(3):  # one step, three layers, one plan
        key, value = torch.randn(4, heads, d), torch.randn(4, heads, d)
        want_k, want_v = torch.zeros(blocks, block_size, heads, d), torch.zeros(blocks, block_size, heads, d)
        got_k, got_v = want_k.clone(), want_v.clone()
        reference.store_kv(key, value, want_k, want_v, slots)
        reference.store_kv(key, value, got_k, got_v, slots, plan)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        flat = got_k.view(-1, heads, d)
        assert torch.equal(flat[9], key[2]) and not flat[[0, 1, 2]].any()  # slot -1 wrote nowhere
    assert plan["valid_slots"].tolist() == [True, False, True, True]


def test_a_step_where_every_token_has_a_slot_keeps_no_mask():
    plan: dict = {}
    cache = torch.zeros(2, 4, 1, 2)
    reference.store_kv(torch.ones(2, 1, 2), torch.ones(2, 1, 2), cache, cache.clone(), torch.tensor([0, 5]), plan)
    assert plan["valid_slots"] is None and cache.view(-1, 1, 2)[5].eq(1).all()
