"""Probe: xgrammar or llguidance for structured output? (the library inflight/grammar uses)

For SmolLM2's 49152-token vocabulary and one JSON schema (nested object, enum, array, required fields): the
one-time read of the tokenizer's vocabulary, the schema's compile, the mask fill of 32 and 64 matchers standing
at varied positions of a valid answer (one thread, and each library's own batch/parallel call), and the accept of
one token (per row, on the step's critical path). Medians of 20 fills. llguidance is not a project dependency:
`pip install llguidance` to compare (without it only xgrammar is measured).

    .venv/bin/python -m perf.probes.grammar_libraries
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from transformers import AutoTokenizer

from perf.bench.structured import SCHEMA  # the benchmark's schema: a nested object, an enum, an array, required fields

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 49152
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry", "engines"],
                     "address": {"city": "London", "zip": "W1"}})


def _median_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def xgrammar_figures(tok, ids: list[int], batch: int) -> dict:
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[tok.eos_token_id])
    vocab_ms = 1000 * (time.perf_counter() - t0)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_ms = 1000 * (time.perf_counter() - t0)
    matchers = []
    for i in range(batch):
        m = xgr.GrammarMatcher(compiled)
        for t in ids[:(i * 3) % (len(ids) - 1)]:
            assert m.accept_token(t)
        matchers.append(m)
    bitmask = xgr.allocate_token_bitmask(batch, VOCAB)
    batched = xgr.BatchGrammarMatcher(max_threads=2)
    fresh = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    t0 = time.perf_counter()
    for m in fresh:
        m.accept_token(ids[0])
    return {"library": f"xgrammar {xgr.__version__}", "vocabulary_ms": vocab_ms, "compile_ms": compile_ms,
            "fill_ms": _median_ms(lambda: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(matchers)]),
            "fill_batched_ms": _median_ms(lambda: batched.batch_fill_next_token_bitmask(matchers, bitmask)),
            "accept_us": 1e6 * (time.perf_counter() - t0) / batch}


def llguidance_figures(tok, ids: list[int], batch: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    vocab_ms = 1000 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": True})
    first = llguidance.LLMatcher(lltok, grammar)
    compile_ms = 1000 * (time.perf_counter() - t0)
    assert not first.get_error(), first.get_error()
    matchers = []
    for i in range(batch):
        m = llguidance.LLMatcher(lltok, grammar)
        for t in ids[:(i * 3) % (len(ids) - 1)]:
            assert m.consume_token(t), m.get_error()
        matchers.append(m)
    bitmask = llguidance.torch.allocate_token_bitmask(batch, VOCAB)
    executor = llguidance.LLExecutor(num_threads=2)
    fresh = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    t0 = time.perf_counter()
    for m in fresh:
        m.consume_token(ids[0])
    accept_us = 1e6 * (time.perf_counter() - t0) / batch
    return {"library": "llguidance", "vocabulary_ms": vocab_ms, "compile_ms": compile_ms,
            "fill_ms": _median_ms(lambda: [llguidance.torch.fill_next_token_bitmask(m, bitmask, i)
                                           for i, m in enumerate(matchers)]),
            "fill_batched_ms": _median_ms(lambda: llguidance.torch.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(matchers)], bitmask)),
            "accept_us": accept_us}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct"))
    ap.add_argument("--batches", default="32,64")
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok.encode(ANSWER)
    for batch in (int(b) for b in args.batches.split(",")):
        for figures in (xgrammar_figures, llguidance_figures):
            try:
                row = figures(tok, ids, batch)
            except ImportError as e:
                print(f"{figures.__name__}: skipped ({e})")
                continue
            print(json.dumps({"rows": batch, **{k: round(v, 3) if isinstance(v, float) else v
                                                for k, v in row.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
