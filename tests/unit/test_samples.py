"""n samples of one prompt (vLLM's `n`): they share the prompt's KV blocks by reference count, a shared partly
filled block is copied when a sample first writes to it, and each sample generates as if alone."""
import pytest

from engine_helpers import TINY, assert_pool_whole
from inflight import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, num_kv_blocks=64, block_size=16, max_model_len=256)


PROMPT = "The quick brown fox jumps over the lazy dog, and then it"  # not a multiple of 16 tokens


def test_greedy_samples_are_identical_and_equal_a_single_request(llm):
    (alone,) = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    (first,) = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=12, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    assert [s.index for s in first.samples] == [0, 1, 2]
    assert all(s.token_ids == alone.token_ids and s.text == alone.text for s in first.samples)
    assert_pool_whole(llm.engine)


def test_seeded_samples_differ_and_each_is_reproducible(llm):
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate([PROMPT], params, use_tqdm=False)[0].samples
    b = llm.generate([PROMPT], params, use_tqdm=False)[0].samples
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert len({tuple(s.token_ids) for s in a}) == 3
    assert_pool_whole(llm.engine)


def test_samples_share_the_prompts_blocks_until_they_write(llm):
    engine = llm.engine
    prompt_ids = llm.tokenizer.encode(PROMPT)
    assert len(prompt_ids) % 16 != 0  # so the last prompt block is shared partly filled, then copied
    engine.add_request("r", prompt_ids, SamplingParams(n=3, max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt, and every sample's first token
    samples = [engine.seqs[i] for i in engine.groups["r"]]
    assert len(samples) == 3
    full = len(prompt_ids) // 16
    shared = samples[0].block_table[:full]
    assert all(s.block_table[:full] == shared for s in samples)
    assert all(engine.block_manager.blocks[b].ref_count == 3 for b in shared)
    engine.step()  # each writes its second token into its own copy of the partly filled block
    lasts = {s.block_table[full] for s in samples}
    assert len(lasts) == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_whole(engine)


def test_aborting_a_request_ends_every_sample(llm):
    engine = llm.engine
    engine.add_request("a", PROMPT, SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    engine.step()
    outs = engine.abort_request("a")
    assert sorted(o.index for o in outs) == [0, 1] and all(o.request_id == "a" and o.finished for o in outs)
    assert not engine.has_unfinished_requests()
    assert_pool_whole(engine)
