"""Greedy outputs equal Hugging Face generate (fp32) whatever shares the batch: chunked prefill, preemption,
prefix-cache hits; plus the mixed-batch logits regression, seeded sampling and input validation."""
import pytest
import torch

from engine_helpers import SMOLLM2, TINY, assert_pool_whole, hf_greedy
from inflight import LLM, InvalidRequestError, SamplingParams
from inflight.sequence import Sequence

TEXT = ("The history of the city begins with a small fishing village on the river. Over the centuries it grew "
        "into a trading port, then an industrial center, and finally a modern capital known for its museums, "
        "parks and universities. Visitors today walk along the old harbour, where merchants once unloaded "
        "spices, silk and tea from distant lands. ") * 6
PROMPT_LENS = [1, 7, 33, 150, 320]
MAX_TOKENS = [6, 12, 20, 9, 14]

CONFIGS = {
    "ample": dict(num_kv_blocks=256, max_num_batched_tokens=2048),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=48),
    # Without drafts: with them requests finish in fewer steps and this pool never runs short (drafts under
    # preemption: test_speculative_engine.py).
    "preempting": dict(num_kv_blocks=34, max_num_batched_tokens=512, watermark=0.0, speculative_method="off"),
}


def prompts_for(llm):
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) >= max(PROMPT_LENS)
    return [ids[:n] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=[TINY, SMOLLM2], ids=["tiny", "smollm2"])
def model_path(request):
    return request.param


@pytest.fixture(scope="module")
def expected(model_path):
    llm = LLM(model_path, num_kv_blocks=64)
    return [hf_greedy(model_path, p, n) for p, n in zip(prompts_for(llm), MAX_TOKENS)]


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_hf_generate(model_path, expected, config):
    llm = LLM(model_path, block_size=16, max_num_seqs=16, enable_prefix_caching=False, **CONFIGS[config])
    chunk_sizes = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule(members=None):
        out = schedule(members)
        chunk_sizes.extend(n for s, n in out.scheduled if s.num_computed_tokens + n < len(s))
        return out

    llm.engine.scheduler.schedule = recording_schedule
    outs = llm.generate(prompts_for(llm), [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.token_ids == want, f"prompt {i} ({PROMPT_LENS[i]} tokens) diverged from HF"
    if config == "chunked":
        assert chunk_sizes, "no prefill was split into chunks"
    if config == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool never preempted"
    assert_pool_whole(llm.engine)


def test_shared_system_prompt_hits_prefix_cache_and_stays_exact(model_path):
    llm = LLM(model_path, block_size=16, num_kv_blocks=256, max_num_batched_tokens=256)
    ids = llm.tokenizer.encode(TEXT)
    system = ids[:100]
    prompts = [system + ids[200 + 10 * i: 200 + 10 * i + 5 + i] for i in range(4)]
    first = llm.generate(prompts[:1], greedy(8), use_tqdm=False)  # fills the cache
    rest = llm.generate(prompts[1:], greedy(8), use_tqdm=False)
    assert llm.engine.block_manager.prefix_hits >= 3 * 96, "later requests did not reuse the system prompt"
    for p, out in zip(prompts, first + rest):
        assert out.token_ids == hf_greedy(model_path, p, 8)
    assert_pool_whole(llm.engine)


def test_mixed_batch_logits_equal_each_alone():
    """The seeds' regression: a 100-token and a 5-token request in one batch, each as if alone (fp32)."""
    llm = LLM(TINY, num_kv_blocks=64, block_size=16)
    engine = llm.engine
    ids = llm.tokenizer.encode(TEXT)
    long_ids, short_ids = ids[:100], ids[300:305]

    def logits_for(batch):
        seqs = []
        for i, p in enumerate(batch):
            seq = Sequence(f"r{i}", p, greedy(1), 1)
            engine.block_manager.admit(seq)
            engine.block_manager.allocate(seq, len(seq))
            seqs.append(seq)
        logits, _ = engine.runner.execute([(s, len(s)) for s in seqs])
        for s in seqs:
            engine.block_manager.free(s)
        return logits

    together = logits_for([long_ids, short_ids])
    alone = torch.cat([logits_for([long_ids]), logits_for([short_ids])])
    assert torch.allclose(together, alone, atol=1e-4, rtol=0)
    assert engine.block_manager.is_whole()


def test_seeded_sample_is_the_same_alone_and_in_a_busy_batch():
    llm = LLM(TINY, num_kv_blocks=128, max_num_batched_tokens=64)
    ids = llm.tokenizer.encode(TEXT)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([ids[:20]], seeded, use_tqdm=False)[0].token_ids
    noise = [SamplingParams(max_tokens=10 + i, temperature=1.0, ignore_eos=True) for i in range(6)]
    busy = llm.generate([ids[50 + i: 90 + 7 * i] for i in range(6)] + [ids[:20]], noise + [seeded],
                        use_tqdm=False)[-1].token_ids
    assert alone == busy
    other_seed = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert llm.generate([ids[:20]], other_seed, use_tqdm=False)[0].token_ids != alone
    assert_pool_whole(llm.engine)


@pytest.mark.parametrize("field,value,allowed", [
    ("temperature", -0.5, "[0, 100]"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("max_tokens", 0, ">= 1"),
    ("top_k", -2, ">= -1"),
])
def test_invalid_sampling_values_name_field_value_and_range(field, value, allowed):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert field in msg and repr(value) in msg and allowed in msg


def test_empty_prompt_and_overlong_request_are_rejected_with_limits():
    llm = LLM(TINY, num_kv_blocks=8, block_size=16, max_model_len=512)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.engine.add_request("e", "", SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="max_model_len=512"):
        llm.engine.add_request("l", list(range(500)), SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequestError, match="whole pool of 8"):
        llm.engine.add_request("p", list(range(200)), SamplingParams(max_tokens=20))
    assert_pool_whole(llm.engine)
