"""The CPU GEMM backend choice of model.linear: oneDNN by default, BLAS on request, same numbers."""
import pytest
import torch

from inflight.config import EngineConfig
from inflight.cpu_defaults import resolve_cpu_defaults
from inflight.model import linear as linear_mod
from inflight.model.linear import Linear, select_cpu_gemm


def switches(vendor=None, **options):
    """The resolved switches select_cpu_gemm takes, for these engine options (and this CPU vendor)."""
    return resolve_cpu_defaults(EngineConfig(**options), vendor=vendor)

needs_onednn = pytest.mark.skipif(linear_mod.ONEDNN_LINEAR is None, reason="this torch build has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_matches_blas(monkeypatch, rows, bias):
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        assert select_cpu_gemm(layer, torch.device("cpu"), torch.float32) == "onednn"
        fast = layer(x)
        assert select_cpu_gemm(layer, torch.device("cpu"), torch.float32, switches(cpu_gemm="blas")) == "blas"
        plain = layer(x)
    assert layer.packed_weight is None and layer.weight.shape == (200, 96)  # unpacked again for BLAS
    assert fast.shape == plain.shape == (rows, 200)
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_three_dim_input_keeps_its_shape():
    layer = Linear(8, 4)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    select_cpu_gemm(layer, torch.device("cpu"), torch.float32)
    x = torch.randn(2, 3, 8)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packing_releases_the_dense_weight_but_not_a_shared_one():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(50, 8)
    model.head = Linear(8, 50, bias=False)
    model.head.weight = model.embed.weight  # tied, as SmolLM2's lm_head
    model.proj = Linear(8, 6, bias=False)
    dense = model.proj.weight.detach().clone()
    # cpu_gemv_rows=0: no few-row BLAS path, so nothing needs the dense weight
    select_cpu_gemm(model, torch.device("cpu"), torch.float32, switches(cpu_gemv_rows=0))
    assert model.proj.weight.numel() == 0 and model.proj.packed_weight is not None
    assert model.head.weight is model.embed.weight and model.head.weight.numel() == 400
    x = torch.randn(3, 8)
    with torch.inference_mode():
        torch.testing.assert_close(model.proj(x), x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_unknown_choice_names_the_option_or_the_variable(monkeypatch):
    with pytest.raises(ValueError, match="cpu_gemm='openblas' is out of range: allowed auto, onednn, blas"):
        EngineConfig(cpu_gemm="openblas")
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", "openblas")
    with pytest.raises(ValueError, match="INFLIGHT_CPU_GEMM='openblas' is out of range: allowed auto, onednn, blas"):
        EngineConfig.from_options()
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", "blas")  # the operator's override wins over the option
    assert EngineConfig.from_options(cpu_gemm="onednn").cpu_gemm == "blas"
    assert linear_mod.cpu_gemm_choice() == "blas"  # what perf/bench/offline.py reports


def test_float16_on_cpu_stays_on_blas():
    layer = Linear(8, 4).half()
    assert select_cpu_gemm(layer, torch.device("cpu"), torch.float16) == "blas"
    assert layer.packed_weight is None


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 16])
def test_few_rows_take_blas_on_the_kept_dense_weight_and_more_rows_onednn(monkeypatch, rows):
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=True)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    select_cpu_gemm(layer, torch.device("cpu"), torch.float32, switches(vendor="GenuineIntel"))
    assert layer.gemv_rows == 3 and torch.equal(layer.weight, weight)  # kept beside the packed copy
    x = torch.randn(rows, 96)
    called = []
    real = linear_mod.ONEDNN_LINEAR
    monkeypatch.setattr(linear_mod, "ONEDNN_LINEAR", lambda *a: called.append(1) or real(*a))
    with torch.inference_mode():
        out = layer(x)
    assert bool(called) == (rows > 3)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_dense_weights_are_released_when_they_would_not_fit_the_memory_budget(monkeypatch, caplog):
    monkeypatch.setattr(linear_mod, "_available_memory_bytes", lambda: 4 * 200 * 96 * 4 - 4)  # a quarter < 1 weight
    layer = Linear(96, 200, bias=False)
    select_cpu_gemm(layer, torch.device("cpu"), torch.float32, switches(cpu_gemv_rows=3))
    assert layer.gemv_rows == 0 and layer.weight.numel() == 0 and layer.packed_weight is not None
    assert "cpu_gemv_rows=0" in caplog.text and "quarter of the memory available" in caplog.text


def test_bfloat16_keeps_no_dense_copy_and_computes_the_same(monkeypatch):
    # On a CPU whose oneDNN packs bf16 the layer is packed; on one that cannot (AVX2-only, e.g. AMD Zen 2) it
    # stays on BLAS with its dense weight. Either way there is no second copy and the numbers are F.linear's.
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=True).to(torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    choice = select_cpu_gemm(layer, torch.device("cpu"), torch.bfloat16, switches(cpu_gemv_rows=3))
    assert choice == ("onednn" if linear_mod.onednn_packs(torch.bfloat16) else "blas")
    assert layer.gemv_rows == 0
    assert (layer.packed_weight is None) == (choice == "blas")
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, bias), rtol=2e-2, atol=2e-2)


def test_a_dtype_onednn_cannot_pack_here_takes_blas(monkeypatch):
    # What an AVX2-only CPU does with bf16 (the reorder raises there), shown for float32 on any CPU.
    monkeypatch.setitem(linear_mod._PACKS, torch.float32, False)
    layer = Linear(16, 8)
    assert select_cpu_gemm(layer, torch.device("cpu"), torch.float32) == "blas"
    assert layer.packed_weight is None and layer.weight.shape == (8, 16) and layer.gemv_rows == 0


@needs_onednn
def test_the_pack_probe_remembers_a_refusal(monkeypatch):
    calls = []

    def refuse(weight, rows):
        calls.append(weight.dtype)
        raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq")

    monkeypatch.setattr(linear_mod, "_PACKS", {})
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    assert not linear_mod.onednn_packs(torch.float16) and not linear_mod.onednn_packs(torch.float16)
    assert calls == [torch.float16]


@pytest.mark.parametrize("raw", ["-1", "65", "two"])
def test_gemv_rows_out_of_range_names_the_option_or_variable_and_range(monkeypatch, raw):
    with pytest.raises(ValueError, match=r"cpu_gemv_rows='?[-\w]+'? is out of range: allowed auto or integers in "
                                         r"\[0, 64\]"):
        EngineConfig.from_options(cpu_gemv_rows=raw)
    monkeypatch.setenv("INFLIGHT_CPU_GEMV_ROWS", raw)
    with pytest.raises(ValueError, match=f"INFLIGHT_CPU_GEMV_ROWS='{raw}' is out of range: allowed auto or "
                                         r"integers in \[0, 64\]"):
        EngineConfig.from_options()


@pytest.mark.parametrize("vendor, blas", [("GenuineIntel", True), ("AuthenticAMD", False), ("", False)])
def test_dense_weights_are_kept_everywhere_but_linear_takes_blas_on_intel_only(monkeypatch, vendor, blas):
    # BLAS's measured limit on Intel, the native product's elsewhere
    assert switches(vendor=vendor).cpu_gemv_rows == (3 if blas else 4)
    monkeypatch.setenv("INFLIGHT_CPU_GEMV_ROWS", "2")
    chosen = resolve_cpu_defaults(EngineConfig.from_options(), vendor=vendor)
    assert chosen.cpu_gemv_rows == 2
    layer = Linear(16, 8)
    select_cpu_gemm(layer, torch.device("cpu"), torch.float32, chosen)
    assert layer.weight.shape == (8, 16) and layer.gemv_rows == (2 if blas else 0)
    linear_mod.release_dense_weights(layer)
    assert layer.weight.numel() == (8 * 16 if blas else 0)  # released only where Linear does not read it
