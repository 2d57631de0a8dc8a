"""Text rendered one step late (LLMEngine.defer_detokenize, on by default on CUDA, where it runs while the next
forward does): every request gets the same tokens, the same streamed text byte for byte, the same finish and
one output per step, as with text rendered in the step that made each token."""
from __future__ import annotations

from collections import Counter

import pytest

from engine_helpers import TINY, assert_pool_whole
from inflight import LLM, SamplingParams

TEXT = "Streaming text: naïve café, 中文字符, emoji 🙂🎉 and more words to fill a prompt. " * 8


def _requests(llm):
    ids = llm.tokenizer.encode(TEXT)
    ws = llm.tokenizer.encode(" ")  # a token tiny-llama's random weights do produce now and then
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, stop=["a", "e"], ignore_eos=True),  # text stop
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, stop_token_ids=ws, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),  # finishes on its first token
        SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.3, seed=11, skip_special_tokens=False,
                       ignore_eos=True),
    ]
    return [ids[i * 9: i * 9 + 20 + 3 * i] for i in range(len(params))], params


@pytest.fixture(scope="module")
def llm():
    # Chunked prefill, some requests waiting; no prefix cache and drafts that do not follow measured step times
    # (the default draft policy does), so every run schedules alike.
    return LLM(TINY, num_kv_blocks=128, max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=False,
               speculative_draft_policy="always")


def _stream(llm, defer: bool, abort_after_steps: int | None = None):
    engine = llm.engine
    engine.defer_detokenize = defer
    prompts, params = _requests(llm)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    got = {str(i): {"tokens": [], "text": "", "final": None} for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        per_request = Counter(o.request_id for o in outs)
        assert max(per_request.values(), default=1) == 1, "a request got two outputs in one step"
        for o in outs:
            r = got[o.request_id]
            assert r["final"] is None, "output after the final"
            r["tokens"] += o.new_token_ids
            r["text"] += o.text_delta
            if o.finished:
                r["final"] = o
        if steps == abort_after_steps:
            for rid in list(engine.groups):
                for o in engine.abort_request(rid):
                    got[rid]["tokens"] += o.new_token_ids
                    got[rid]["text"] += o.text_delta
                    got[rid]["final"] = o
    assert_pool_whole(engine)
    return got


@pytest.mark.parametrize("abort_after_steps", [None, 6], ids=["to_the_end", "aborted"])
def test_deferred_text_streams_what_immediate_text_does(llm, abort_after_steps):
    now, late = _stream(llm, False, abort_after_steps), _stream(llm, True, abort_after_steps)
    for rid in now:
        a, b = now[rid], late[rid]
        assert b["tokens"] == a["tokens"], rid
        assert b["text"] == a["text"], rid
        assert (b["final"].finish_reason, b["final"].num_output_tokens) == \
            (a["final"].finish_reason, a["final"].num_output_tokens), rid
        assert len(b["tokens"]) == b["final"].num_output_tokens, rid
    reasons = {r["final"].finish_reason.value for r in now.values()}
    assert ({"stop", "length"} <= reasons) if abort_after_steps is None else ("cancelled" in reasons)
