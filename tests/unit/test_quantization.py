"""Weight-only int8 / int4 and GGUF loading (model/quant.py, native/quant_rows.c, model/gguf_loader.py): the native
product against the dequantized float32 weight, the block layouts against the gguf package's own dequantization,
GGUF files of every kept type loaded and served, the accuracy cost measured as perplexity, bad options refused."""
from __future__ import annotations

import math
import os

import pytest
import torch

from engine_helpers import ROOT, SMOLLM2, TINY, TINY_GEMMA3, assert_pool_whole
from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.model.linear import Linear
from inflight.model.native_decode import quant_product
from inflight.model.quant import (BF16, BLOCK, INT4, INT8, QuantizedWeight, from_gguf_blocks, quantize_int4,
                                  quantize_int8, quantized_bytes, to_bf16)
from inflight.sequence import TokenLogprobs

SMOL_Q4_1 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def product():
    return quant_product()


def _weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("make", [quantize_int8, lambda w: quantize_int8(w, 32), quantize_int4],
                         ids=["int8-channel", "int8-32", "int4"])
def test_quantization_error_is_within_half_a_step(make):
    w = _weight(64, 256)
    q = make(w)
    err = (q.dequantize() - w).abs()
    steps = q.plain()[1].repeat_interleave(q.group, dim=1)[:, :256]
    assert bool((err <= steps / 2 + 1e-6).all()), "a weight rounded to a farther step than the nearest"


@pytest.mark.parametrize("kind", ["int8-channel", "int8-32", "int4", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9])
def test_native_product_equals_the_dequantized_weights_product(product, kind, rows):
    """Against float64 over the dequantized weight, at the precision of a float32 dot product; rows 5-9 cross the
    4-row blocks, and 200 inputs (int8 per channel) leave a tail past the last 16."""
    inp = 200 if kind == "int8-channel" else 256
    w = _weight(96, inp, seed=rows)
    q = {"int8-channel": quantize_int8, "int8-32": lambda x: quantize_int8(x, 32), "int4": quantize_int4,
         "bf16": to_bf16}[kind](w)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(96)
    got = product(x, q, bias)
    exact = (x.double() @ q.dequantize().double().T + bias.double()).float()
    torch.testing.assert_close(got, exact, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("make", [quantize_int8, lambda w: quantize_int8(w, 32), quantize_int4, to_bf16])
@pytest.mark.parametrize("batch", [2, 3, 5, 7])
def test_a_rows_result_does_not_depend_on_its_batch(product, make, batch):
    """Every row sums in the same lanes and order whatever shares the call: bit for bit alone and among others,
    whether the batch takes a group of four tiles at a time (up to six rows) or one tile (more)."""
    q = make(_weight(64, 256))
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(3))
    together = product(x, q, None)
    for r in range(batch):
        torch.testing.assert_close(product(x[r:r + 1], q, None)[0], together[r], atol=0, rtol=0)


@pytest.mark.parametrize("make", [quantize_int8, lambda w: quantize_int8(w, 32), quantize_int4, to_bf16],
                         ids=["int8-channel", "int8-32", "int4", "bf16"])
def test_tiles_round_trip_and_many_rows(product, make):
    """The tiled layout gives the plain one back; 40 rows (several row blocks of 6 / 3) and 300 outputs (a last
    tile of 12) multiply right."""
    w, x = _weight(300, 128), torch.randn(40, 128)
    q = make(w)
    rebuilt = QuantizedWeight(q.kind, *q.plain(), q.group, q.in_features)
    torch.testing.assert_close(rebuilt.dequantize(), q.dequantize(), atol=0, rtol=0)
    torch.testing.assert_close(q.dequantize(torch.tensor([299, 0, 17])), q.dequantize()[[299, 0, 17]], atol=0, rtol=0)
    exact = (x.double() @ q.dequantize().double().T).float()
    torch.testing.assert_close(product(x, q, None), exact, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_as_the_gguf_package_does(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    w = _weight(24, 96).numpy()
    blocks = quantize(w, GGMLQuantizationType[qtype])
    q = from_gguf_blocks(qtype, blocks, 24, 96)
    assert q.kind == (INT8 if qtype == "Q8_0" else INT4) and q.group == BLOCK
    theirs = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[qtype]))
    # Q4_0's w = d (q - 8) is stored as d q + (-8 d): two roundings where gguf has one, at most an ulp apart.
    tol = dict(atol=0, rtol=0) if qtype != "Q4_0" else dict(atol=1e-7, rtol=2 ** -22)
    torch.testing.assert_close(q.dequantize(), theirs, **tol)


def test_bad_quantization_options_are_refused():
    with pytest.raises(ValueError, match="quantization='int3' is out of range: allowed none, int8, int4"):
        EngineConfig.from_options(quantization="int3")
    with pytest.raises(ValueError, match="quantization='int8' is CPU float32 only"):
        EngineConfig.from_options(quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="int8 group=20 must be the row \\(64\\) or a multiple of 32 that divides it"):
        QuantizedWeight(INT8, torch.zeros(2, 64, dtype=torch.int8), torch.ones(2, 4), None, 20, 64)


# ---- the engine -------------------------------------------------------------------------------------------------

def test_the_wheels_q4_1_gguf_serves_exactly_what_the_float32_folder_does():
    """models/SmolLM2-135M-Instruct was dequantized from this very file, and the product rounds each weight as that
    dequantization did: loaded directly, quantized, the file gives the float32 model's greedy tokens."""
    gguf = LLM(SMOL_Q4_1, num_kv_blocks=128, max_num_seqs=4)
    dense = LLM(SMOLLM2, num_kv_blocks=128, max_num_seqs=4)
    ids = dense.tokenizer.encode(open(os.path.join(ROOT, "docs", "engine.md")).read())
    assert gguf.tokenizer.encode("The capital of France is") == dense.tokenizer.encode("The capital of France is")
    prompts = [ids[i * 60:i * 60 + 40] for i in range(4)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in gguf.generate(prompts, greedy, use_tqdm=False)]
    assert got == [o.token_ids for o in dense.generate(prompts, greedy, use_tqdm=False)]
    runner = gguf.engine.runner
    assert runner.model.is_quantized and runner.forward.steps > 0, "decode steps did not run natively"
    # 4-bit linears (scale and min as float32: 0.75 bytes a weight) and the Q8_0 embedding: 115 MB, where float32
    # would be 540 MB.
    weights = quantized_bytes(runner.model)
    assert weights < 120 * 2**20, f"{weights / 2**20:.0f} MB: the GGUF was not kept in its 4-bit blocks"
    assert_pool_whole(gguf.engine)


# Checkpoint projections the engine holds fused (model/loader.py), split back for the transformers reference.
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# Log-probabilities of the quantized engine against the float32 reference over the same (dequantized) weights:
# measured at most 3e-6 apart (summation order only); a wrong product moves them by far more.
LOGPROB_TOLERANCE = 5e-5


def dequantized_reference(path: str, model: torch.nn.Module) -> torch.nn.Module:
    """transformers' float32 model of `path`, every weight the engine quantized replaced by its dequantization:
    the torch forward that every quantized step shape must reproduce."""
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            quant = getattr(module, "quant", None)
            if quant is None:
                continue
            weight = quant.dequantize()
            if name in ("lm_head", "embed_tokens"):  # tied: one quant, and one tensor in the reference too
                reference.get_submodule(name if name == "lm_head" else "model.embed_tokens").weight.copy_(weight)
                continue
            _, layer, projection = name.split(".", 2)  # layers.<i>.<projection>
            parts = [reference.get_submodule(f"model.layers.{layer}.{theirs}")
                     for theirs in _FUSED.get(projection, (projection,))]
            for part, rows in zip(parts, weight.split([p.weight.shape[0] for p in parts])):
                part.weight.copy_(rows)
    return reference


class StepShapes:
    """Passes each forward on to the runner's own and notes its shape: (decode-only, rows)."""

    def __init__(self, forward):
        self.forward = forward
        self.seen: list[tuple[bool, int]] = []

    def __call__(self, input_ids, positions, meta, kv_caches):
        self.seen.append((meta.max_query_len == 1, meta.num_seqs))
        return self.forward(input_ids, positions, meta, kv_caches)


def generate_with_logprobs(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[TokenLogprobs]]:
    """Each request's per-token log-probabilities, as the engine computes them off each step's logits."""
    engine = llm.engine
    got: dict[str, list[TokenLogprobs]] = {f"q{i}": [] for i in range(len(prompts))}
    for rid, prompt in zip(got, prompts):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id] += out.logprobs
    return list(got.values())


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("model", [TINY, TINY_GEMMA3], ids=["llama", "gemma3"])
def test_quantized_at_load_serves_every_step_shape(quantization, model):
    """Prefill chunks, few-row and many-row decode steps of a model quantized at load (the Llama family's decode
    steps through the whole native step, Gemma 3 through its torch forward): each token's top log-probabilities
    equal those of transformers' float32 forward over the dequantized weights (teacher-forced on the engine's own
    tokens), and each greedy token is the reference's most likely one; the pool is whole."""
    llm = LLM(model, quantization=quantization, num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=24)
    runner = llm.engine.runner
    quantized = runner.model
    linears = [m for m in quantized.modules() if isinstance(m, Linear)]
    assert linears and all(m.quant is not None and m.quant_product is not None for m in linears), \
        "a linear is not quantized, or dequantizes at every call instead of taking the native product"
    native_step = runner.forward is not quantized
    assert native_step == (model == TINY), "the Llama family takes the native step, Gemma 3 its torch forward"
    runner.forward = shapes = StepShapes(runner.forward)
    ids = llm.tokenizer.encode(open(os.path.join(ROOT, "docs", "engine.md")).read())
    prompts = [ids[i * 7:i * 7 + 5 + i] for i in range(20)]
    max_tokens = 12
    outs = generate_with_logprobs(llm, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True, logprobs=5))
    # 24 tokens a step over 290 prompt tokens: chunked prefills, then decode-only steps (a row per request and per
    # n-gram draft token verified) of many rows (the native product's tile-at-a-time path past six) and of a few.
    decode_rows = {rows for decode_only, rows in shapes.seen if decode_only}
    assert any(not decode_only for decode_only, _ in shapes.seen), shapes.seen
    assert max(decode_rows) > 6 and min(decode_rows) <= 3, shapes.seen
    reference = dequantized_reference(model, quantized)
    for prompt, tokens in zip(prompts, outs):
        assert len(tokens) == max_tokens
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + [t.token_id for t in tokens[:-1]]])).logits[0]
        want = torch.log_softmax(logits[len(prompt) - 1:].float(), dim=-1)
        for step, (token, row) in enumerate(zip(tokens, want)):
            where = f"{len(prompt)}-token prompt, output token {step}"
            ours = torch.tensor([lp for lp, _, _ in token.top.values()])
            torch.testing.assert_close(ours, row[list(token.top)], atol=LOGPROB_TOLERANCE, rtol=0,
                                       msg=lambda m, where=where: f"{where}: {m}")
            assert row[token.token_id] >= row.max() - LOGPROB_TOLERANCE, \
                f"{where}: greedy took a token the reference ranks lower"
    if native_step:
        assert shapes.forward.steps > 0, "no decode step ran natively"
    assert_pool_whole(llm.engine)


def test_perplexity_of_int8_within_one_percent_of_float32():
    """The accuracy the quantization costs, on this repository's docs (perf.probes.perplexity measures more)."""
    from perf.probes.perplexity import corpus, window_nll

    def perplexity(quantization: str) -> float:
        llm = LLM(SMOLLM2, quantization=quantization, num_kv_blocks=40, max_model_len=512,
                  max_num_batched_tokens=512, enable_prefix_caching=False)
        ids = llm.tokenizer.encode(corpus())[:512 * 4]
        parts = [window_nll(llm, ids[i:i + 512]) for i in range(0, len(ids), 512)]
        return math.exp(sum(n for n, _ in parts) / sum(c for _, c in parts))
    base, int8 = perplexity("none"), perplexity("int8")
    assert abs(int8 / base - 1) < 0.01, f"int8 perplexity {int8:.3f} vs float32 {base:.3f}"


def test_gguf_of_every_kept_type_loads_and_matches_its_dequantized_weights(tmp_path):
    """tiny-llama written as GGUF (gguf's own writer, q/k permuted as llama.cpp's converter does) in Q8_0, Q4_0
    and Q4_1: the engine's logits equal those of the float32 model with the dequantized weights."""
    from gguf_files import write_llama_gguf
    dense = LLM(TINY, num_kv_blocks=32)
    ids = dense.tokenizer.encode("The capital of France is a city of museums and parks")
    for qtype in ("Q8_0", "Q4_0", "Q4_1"):
        path, dequantized = write_llama_gguf(TINY, tmp_path / qtype, qtype)
        q = LLM(str(path), num_kv_blocks=32)
        ref = LLM(str(dequantized), num_kv_blocks=32)
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        assert q.generate([ids], greedy, use_tqdm=False)[0].token_ids == \
            ref.generate([ids], greedy, use_tqdm=False)[0].token_ids, qtype
        assert q.engine.runner.model.is_quantized


def test_bfloat16_on_cpu_stores_bf16_weights_and_computes_in_float32(tmp_path):
    """dtype=bfloat16 on CPU: every weight in bf16 (half the bytes), activations and KV in float32; the greedy
    output is that of a float32 engine over the same weights rounded to bf16."""
    from safetensors.torch import load_file, save_file
    import shutil
    rounded = tmp_path / "bf16-rounded"
    shutil.copytree(TINY, rounded)
    state = load_file(str(rounded / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).float() for k, v in state.items()}, str(rounded / "model.safetensors"),
              metadata={"format": "pt"})
    bf16 = LLM(TINY, dtype="bfloat16", num_kv_blocks=64)
    runner = bf16.engine.runner
    assert runner.dtype == torch.float32 and runner.kv_caches[0][0].dtype == torch.float32
    assert {m.quant.kind for m in runner.model.modules() if getattr(m, "quant", None) is not None} == {BF16}
    ids = bf16.tokenizer.encode("The capital of France is a city of museums and parks, and of")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = LLM(str(rounded), num_kv_blocks=64).generate([ids, ids[:5]], greedy, use_tqdm=False)
    assert [o.token_ids for o in bf16.generate([ids, ids[:5]], greedy, use_tqdm=False)] == [o.token_ids for o in want]
