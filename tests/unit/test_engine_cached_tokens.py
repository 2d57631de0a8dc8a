"""RequestOutput.num_cached_tokens: the prompt tokens the prefix cache held when the request was admitted (what
the `num_cached_tokens` output and OpenAI's usage.prompt_tokens_details.cached_tokens report)."""
from engine_helpers import TINY
from inflight import LLM, SamplingParams

TEXT = ("A lighthouse keeper wrote in his log every evening: the weather, the ships that passed, the birds on the "
        "rocks and the state of the lamp. ") * 4


def run(engine, request_id, ids, n=1, max_tokens=3):
    engine.add_request(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_outputs_report_prefix_cache_hits_at_admission():
    llm = LLM(TINY, block_size=16, num_kv_blocks=64)
    ids = llm.tokenizer.encode(TEXT)[:70]
    first = run(llm.engine, "a", ids)
    second = run(llm.engine, "b", ids)
    assert first and {o.num_cached_tokens for o in first} == {0}
    assert second and {o.num_cached_tokens for o in second} == {64}  # the prompt's whole blocks (70 // 16 = 4)
    one = run(llm.engine, "d", ids[:40] + ids[:30], max_tokens=1)  # its only output is its final one
    assert [o.num_cached_tokens for o in one] == [32]
    samples = run(llm.engine, "c", ids, n=2)  # a request's other samples share its count
    assert {o.index for o in samples} == {0, 1} and {o.num_cached_tokens for o in samples} == {64}
