"""The native CPU decode step (model/native_decode.py, model/native/decode_step.c) against llama.py's forward:
same hidden states within float32 rounding, the same K/V written to the same slots and nothing else, greedy
tokens unchanged through the engine, and a clean fallback where it does not apply or cannot be built."""
import logging
import os
import subprocess
import sys
import shutil

import pytest
import torch

from engine_helpers import TINY
from inflight import LLM, SamplingParams
from inflight.attention import AttentionMetadata
from inflight.config import EngineConfig
from inflight.cpu_defaults import resolve_cpu_defaults
from inflight.env_overrides import NATIVE_CACHE_ENV
from inflight.model import ModelConfig, LlamaForCausalLM, native_decode
from inflight.model import linear as linear_mod

needs_native = pytest.mark.skipif(
    linear_mod.ONEDNN_LINEAR is None or not native_decode._torch_sgemm() or shutil.which("cc") is None,
    reason="needs torch's oneDNN linear, an exported sgemm and a C compiler (cc)")


def _random_model(qkv_bias: bool, head_dim: int) -> LlamaForCausalLM:
    cfg = ModelConfig(model_type="qwen2" if qkv_bias else "llama", vocab_size=300, hidden_size=96,
                      intermediate_size=160, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=head_dim,
                      rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
                      qkv_bias=qkv_bias, rope_theta=10000.0)
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def native_cache(tmp_path_factory):
    """One build directory for the tests that only need the library: a build takes seconds (quant_rows.c's kernels
    for three instruction sets), so each test building its own would repeat it. The build itself is tested with a
    directory of its own (test_the_build_is_cached_per_source_and_flags)."""
    return tmp_path_factory.mktemp("native-cache")


def _native(model, monkeypatch, cache, rows=3, blas=True):
    """The native forward with whole steps up to `rows` rows (0: every decode step layer by layer), their linears
    through torch's sgemm (blas) or decode_step.c's own few-row product."""
    switches = resolve_cpu_defaults(EngineConfig(cpu_gemv_rows=rows), vendor="GenuineIntel" if blas else "AuthenticAMD")
    monkeypatch.setenv(NATIVE_CACHE_ENV, str(cache))
    linear_mod.select_cpu_gemm(model, torch.device("cpu"), torch.float32, switches)
    forward = native_decode.native_forward(model, torch.device("cpu"), torch.float32, switches)
    assert isinstance(forward, native_decode.NativeDecodeForward) and forward.max_rows == rows
    assert bool(forward.spec.gemm) == (blas and rows > 0)
    return forward


def _decode_step(lens, block_size, num_blocks):
    """Metadata for one decode token per row, each row's blocks scattered (taken from the end of the pool) and
    the last row a padding row (slot -1, as the static decode pads)."""
    tables = torch.zeros(len(lens), (max(lens) + block_size - 1) // block_size + 1, dtype=torch.int32)
    free = list(range(num_blocks - 1, -1, -1))
    for i, length in enumerate(lens):
        for b in range((length + block_size - 1) // block_size):
            tables[i, b] = free.pop(0)
    slots = [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
    slots[-1] = -1
    n = len(lens)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables,
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32), query_lens=[1] * n,
                             seq_lens_host=list(lens), max_query_len=1, max_seq_len=max(lens))
    return meta, torch.tensor([n - 1 for n in lens])


@needs_native
# 3: one native call, its linears through BLAS or (3, False: AMD's default) its own product; 0: layer by layer
@pytest.mark.parametrize("rows,blas", [(3, True), (3, False), (0, True)])
# 16: scores eight positions at a time; 24: a dot product with a tail; 64: values 64 dimensions at a time too
@pytest.mark.parametrize("qkv_bias,head_dim", [(False, 16), (True, 24), (False, 64)])
def test_native_step_matches_the_torch_forward(monkeypatch, native_cache, qkv_bias, head_dim, rows, blas):
    model = _random_model(qkv_bias, head_dim)
    native = _native(model, monkeypatch, native_cache, rows, blas)
    block_size, num_blocks = 4, 16
    meta, positions = _decode_step([1, 11, 7], block_size, num_blocks)
    shape = (num_blocks, block_size, 2, head_dim)
    torch.manual_seed(2)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(3)]
    ids = torch.tensor([5, 17, 250])
    want_caches = [(k.clone(), v.clone()) for k, v in caches]
    # Past a row's length (here: block 0, which the tables pad with) the cache may hold anything, NaN in a
    # never-written block: the native step reads no slot past a row's length. (The torch reference masks such
    # keys after the dot product, so it gets finite values there.)
    for k, v in caches:
        k[0], v[0] = float("nan"), float("nan")
    before = [k.clone() for k, _ in caches]
    with torch.inference_mode():
        want = model(ids, positions, meta, want_caches)
        got = native(ids, positions, meta, caches)
    assert (native.steps, native.layered_steps) == ((1, 0) if rows else (0, 1))
    # The padding row attends to whatever its table names; only the real rows are compared.
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-5, atol=1e-5)
    for (k, v), (wk, wv) in zip(caches, want_caches):
        torch.testing.assert_close(k[1:], wk[1:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[1:], wv[1:], rtol=1e-5, atol=1e-5)
    # Only the two real rows' slots were written, in every layer.
    for (k, _), old in zip(caches, before):
        changed = (~torch.isclose(k, old, equal_nan=True)).flatten(2).any(-1).flatten().nonzero().flatten()
        assert changed.tolist() == sorted(meta.slot_mapping[:2].tolist())


@needs_native
def test_which_steps_run_how(monkeypatch, native_cache):
    native = _native(_random_model(False, 16), monkeypatch, native_cache)
    assert native.covers(_decode_step([3, 5], 4, 16)[0]) == "step"
    assert native.covers(_decode_step([3, 5, 6, 2], 4, 16)[0]) == "layers"  # 4 rows: past INFLIGHT_CPU_GEMV_ROWS
    prefill = AttentionMetadata(slot_mapping=torch.arange(3), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                                seq_lens=torch.tensor([3], dtype=torch.int32),
                                cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32), query_lens=[3],
                                seq_lens_host=[3], max_query_len=3, max_seq_len=3)
    assert native.covers(prefill) is None


@needs_native
@pytest.mark.parametrize("rows,blas", [(3, False), (3, True), (0, False)])
def test_the_lm_head_takes_the_native_product_where_linear_takes_no_blas(monkeypatch, native_cache, rows, blas):
    """Where the step runs its own product (AMD), the logits of up to max_rows rows do too; more rows, and CPUs
    whose Linear takes BLAS there, keep oneDNN or BLAS."""
    model = _random_model(False, 16)
    weight = model.lm_head.weight.detach().clone()  # untied: at rows 0 the dense copy is released
    native = _native(model, monkeypatch, native_cache, rows, blas)
    head = model.lm_head
    assert (head.few_row_product is not None) == (rows > 0 and not blas)
    calls = []
    if head.few_row_product is not None:
        product = head.few_row_product
        head.few_row_product = lambda *args: calls.append(args[0].shape[0]) or product(*args)
    torch.manual_seed(4)
    with torch.inference_mode():
        for n in (1, 3, 4):
            hidden = torch.randn(n, 96)
            torch.testing.assert_close(model.compute_logits(hidden), hidden @ weight.T, rtol=1e-5, atol=1e-5)
    assert calls == ([1, 3] if head.few_row_product is not None else [])
    assert native.steps == 0


@needs_native
@pytest.mark.parametrize("width", [96, 40])  # 40: each dot product ends in a tail of 8
def test_the_native_product_gives_each_row_the_bits_it_gets_alone(monkeypatch, native_cache, width):
    """decode_step.c's product runs up to four rows per pass over a weight row (blocks of 4, then 3, 2 or 1): each
    row's sums still run in one order, so a row's result does not depend on what else shares the step, and
    equals torch's within float32 rounding."""
    native = _native(_random_model(False, 16), monkeypatch, native_cache, rows=4, blas=False)
    torch.manual_seed(5)
    weight, bias = torch.randn(70, width), torch.randn(70)
    rows = torch.randn(7, width)
    for b in (bias, None):
        alone = torch.cat([native.linear(rows[i:i + 1], weight, b) for i in range(7)])
        want = rows @ weight.T if b is None else torch.addmm(b, rows, weight.T)
        torch.testing.assert_close(alone, want, rtol=1e-5, atol=1e-5)
        for n in range(2, 8):
            assert torch.equal(native.linear(rows[:n], weight, b), alone[:n]), n


def _generate(llm, prompts, max_tokens):
    logits = []
    execute = llm.engine.runner.execute

    def recording(*args, **kwargs):
        out, seqs = execute(*args, **kwargs)
        logits.append(out.clone())
        return out, seqs

    llm.engine.runner.execute = recording
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.token_ids for o in outs], logits


@needs_native
@pytest.mark.parametrize("rows", ["3", "1"])  # 1: the two-row decode steps run layer by layer
def test_engine_tokens_and_logits_unchanged(monkeypatch, native_cache, rows):
    """Two prompts through prefill and decode, then the longer one alone."""
    monkeypatch.setenv(NATIVE_CACHE_ENV, str(native_cache))
    prompts = [list(range(100, 109)), list(range(300, 340))]
    # One token per request and step (no drafts), so the row counts are the ones the parameter names.
    plain = LLM(TINY, num_kv_blocks=64, max_num_batched_tokens=32, cpu_gemv_rows=rows, cpu_native_decode=False,
                speculative_method="off")
    assert plain.engine.runner.forward is plain.engine.runner.model
    want_tokens, want_logits = _generate(plain, prompts, 12)
    native = LLM(TINY, num_kv_blocks=64, max_num_batched_tokens=32, cpu_gemv_rows=rows, cpu_native_decode=True,
                 speculative_method="off")
    forward = native.engine.runner.forward
    assert isinstance(forward, native_decode.NativeDecodeForward)
    got_tokens, got_logits = _generate(native, prompts, 12)
    assert got_tokens == want_tokens
    assert forward.steps + forward.layered_steps >= 10
    assert (forward.layered_steps > 0) == (rows == "1")
    assert len(got_logits) == len(want_logits)
    for g, w in zip(got_logits, want_logits):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)


def test_switch_is_validated_and_the_variable_overrides_it(monkeypatch):
    with pytest.raises(ValueError, match="cpu_native_decode='maybe' is malformed: expected true or false"):
        EngineConfig.from_options(cpu_native_decode="maybe")
    monkeypatch.setenv("INFLIGHT_CPU_NATIVE", "maybe")
    with pytest.raises(ValueError, match="INFLIGHT_CPU_NATIVE='maybe' is out of range: allowed true or false"):
        EngineConfig.from_options()
    monkeypatch.setenv("INFLIGHT_CPU_NATIVE", "0")
    assert EngineConfig.from_options(cpu_native_decode="true").cpu_native_decode is False


def test_not_for_bfloat16():
    model = _random_model(False, 16)
    assert native_decode.native_forward(model, torch.device("cpu"), torch.bfloat16) is None


@needs_native
def test_without_dense_weights_every_decode_step_runs_layer_by_layer(monkeypatch, native_cache):
    model = _random_model(False, 16)
    native = _native(model, monkeypatch, native_cache, rows=0)
    assert model.layers[0].mlp.down_proj.weight.numel() == 0  # released: oneDNN's packed copy only
    assert native.covers(_decode_step([3], 4, 16)[0]) == "layers"


@needs_native
def test_without_a_compiler_the_forward_stays_in_torch(monkeypatch, tmp_path, caplog):
    model = _random_model(False, 16)
    switches = resolve_cpu_defaults(EngineConfig(cpu_gemv_rows=3))
    linear_mod.select_cpu_gemm(model, torch.device("cpu"), torch.float32, switches)
    monkeypatch.setenv(NATIVE_CACHE_ENV, str(tmp_path / "empty"))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level(logging.WARNING):
        assert native_decode.native_forward(model, torch.device("cpu"), torch.float32, switches) is None
    assert "no C compiler (no-such-compiler-here)" in caplog.text and "INFLIGHT_CPU_NATIVE=0" in caplog.text


@needs_native
def test_a_library_that_does_not_load_leaves_the_forward_in_torch(monkeypatch, tmp_path, caplog):
    model = _random_model(False, 16)
    switches = resolve_cpu_defaults(EngineConfig(cpu_gemv_rows=3))
    linear_mod.select_cpu_gemm(model, torch.device("cpu"), torch.float32, switches)
    broken = tmp_path / "decode_step-broken.so"
    broken.write_text("not a shared library")
    monkeypatch.setattr(native_decode, "build_library", lambda: str(broken))
    with caplog.at_level(logging.WARNING):
        assert native_decode.native_forward(model, torch.device("cpu"), torch.float32, switches) is None
    assert "native CPU decode step unavailable" in caplog.text and str(broken) in caplog.text


def test_the_build_is_cached_per_source_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv(NATIVE_CACHE_ENV, str(tmp_path))  # the cache directory is an environment-only setting
    first = native_decode.build_library()
    assert first.startswith(str(tmp_path)) and first.endswith(".so")
    monkeypatch.setenv("CC", "no-such-compiler-here")  # the compiler is part of the key: a new build
    with pytest.raises(RuntimeError, match="no C compiler"):
        native_decode.build_library()
    monkeypatch.delenv("CC")
    assert native_decode.build_library() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.rsplit("/", 1)[1]]  # no temporary left


@needs_native
@pytest.mark.parametrize("head_dim", [24, 64])
def test_long_contexts_split_across_threads_match_and_do_not_depend_on_the_width(monkeypatch, native_cache, head_dim):
    """Past 256 positions attention splits into 128-position chunks shared by the OpenMP team and merged after:
    the same result as the torch forward, and bit for bit the same at one thread and at two."""
    model = _random_model(True, head_dim)
    native = _native(model, monkeypatch, native_cache)
    block_size, num_blocks = 16, 80
    meta, positions = _decode_step([700, 300, 1], block_size, num_blocks)
    shape = (num_blocks, block_size, 2, head_dim)
    torch.manual_seed(3)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(3)]
    ids = torch.tensor([7, 8, 9])
    threads = torch.get_num_threads()
    results = []
    try:
        for width in (1, 2, 1):
            torch.set_num_threads(width)
            copies = [(k.clone(), v.clone()) for k, v in caches]
            with torch.inference_mode():
                results.append(native(ids, positions, meta, copies))
        with torch.inference_mode():
            want = model(ids, positions, meta, [(k.clone(), v.clone()) for k, v in caches])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(results[0][:2], want[:2], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@needs_native
@pytest.mark.parametrize("blas", [False, True])
def test_dense_copies_are_released_where_nothing_reads_them(monkeypatch, blas):
    # Where Linear takes no BLAS (AMD), the dense copies serve the native step alone: with it off they go.
    monkeypatch.setattr("inflight.cpu_defaults.cpu_vendor", lambda: "GenuineIntel" if blas else "AuthenticAMD")
    down = LLM(TINY, num_kv_blocks=16, cpu_native_decode=False).engine.runner.model.layers[0].mlp.down_proj
    assert down.packed_weight is not None and (down.weight.numel() > 0) == blas


def test_a_failing_compiler_with_utf8_messages_is_reported_in_an_ascii_locale(tmp_path):
    """gcc quotes with ‘’ whatever the locale, and the python-backend stub runs with an ASCII one: its messages must
    reach the error, not break the model's load with a UnicodeDecodeError."""
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\nprintf 'warning: \\342\\200\\230x\\342\\200\\231 changes the ABI\\n' >&2\nexit 1\n")
    compiler.chmod(0o755)
    code = ("import locale; assert locale.getpreferredencoding(False).lower() in ('ascii', 'ansi_x3.4-1968'); "
            "import sys; from inflight.model import native_decode\n"
            "try:\n    native_decode.build_library()\n"
            "except RuntimeError as e:\n    sys.stdout.buffer.write(str(e).encode())")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "CC": str(compiler), NATIVE_CACHE_ENV: str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert "‘x’ changes the ABI" in done.stdout.decode()
