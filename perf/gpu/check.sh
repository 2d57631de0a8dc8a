#!/usr/bin/env bash
# The one prepared GPU check: the triton cache warmed in parallel, the kernel and CUDA-runner tests compiled
# on the GPU (no TRITON_INTERPRET), then perf/gpu/bench.py on the 0.5B Qwen2-shaped load. Each step has its
# own `timeout`; the whole script stays under 9.5 minutes (warm-up 1.5, tests 3, bench 4.7, setup seconds),
# inside the device tool's limit of 10 minutes for one command.
#
# From a session with the device tool (repo root; tiny-llama is git-ignored, so it must be carried):
#   run(command="bash perf/gpu/check.sh", carry=["models/tiny-llama"], timeout_s=600)
# Anywhere else with one CUDA GPU:  OUT=/some/dir bash perf/gpu/check.sh
#
# Writes into $OUT (default ./gpu_check_out): env.txt, kernel_variants.json, pytest.log, gpu_bench.log and
# gpu_bench-<gpu>.json / .md (6 files; the device tool brings back at most 8). Copy the .json/.md into
# perf/results/ to commit them.
#
# Packages: the nvidia-h200 image has python3 3.12 with torch, triton, transformers, safetensors,
# tokenizers, tqdm and pytest. A missing one travels as a wheel in .whl/ (see the device README), carried
# with carry=[..., ".whl"]; this script installs .whl/*.whl into /tmp/site when that folder exists.
set -u
set -o pipefail
cd "$(dirname "$0")/../.."  # the repository root: perf/gpu/ is two levels down
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET INFLIGHT_ATTENTION INFLIGHT_FUSED_OPS
# The project is not installed on a GPU host: its packages are imported from the checkout.
export PYTHONPATH="$PWD/backend_src"

# The CUDA runner tests need the tiny model, which is git-ignored: without it they would skip, and the check
# would pass having tested nothing of the runner. Refuse instead.
if [ ! -f models/tiny-llama/config.json ]; then
    echo "gpu_check: models/tiny-llama is missing: carry it (run(..., carry=[\"models/tiny-llama\"]))" | tee "$OUT/env.txt"
    exit 2
fi

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
    "$PY" - <<'EOF'
import importlib
for name in ("torch", "triton", "transformers", "safetensors", "tokenizers", "pytest", "tqdm"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001
        print(name, "MISSING", e)
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
# A cold triton cache compiles every kernel variant once; one process compiling ~70 of them serially takes
# ~100-150 s of CPU (tests/kernels/gpu_variants.py measured it on the dev CPU). Compile them first with a
# process per core; the tests then find them in the cache (anything it misses, they compile as before).
if grep -q "^cuda True" "$OUT/env.txt"; then
    echo "== warm the triton cache (tests/kernels/gpu_variants.py, $(nproc) processes)"
    timeout 90 "$PY" tests/kernels/gpu_variants.py --jobs "$(nproc)" --json "$OUT/kernel_variants.json" 2>&1 \
        | tail -n 12 || echo "warm-up failed or timed out: the tests compile what they need"
fi

echo "== pytest tests/kernels (compiled Triton on the GPU)"
timeout "${PYTEST_TIMEOUT:-180}" "$PY" -m pytest -q -rfEs -p no:cacheprovider --durations=8 tests/kernels 2>&1 \
    | tee "$OUT/pytest.log" || { rc=${PIPESTATUS[0]}; status=1; echo "pytest failed or timed out (exit $rc)"; }
# On a GPU, a test that skipped tested nothing, and that fails the check too. The only skips allowed are
# the CPU-only compile-to-sm_90 tests, which say that the GPU compiles and runs those kernels anyway.
if grep -q "^cuda True" "$OUT/env.txt" \
        && grep "^SKIPPED" "$OUT/pytest.log" | grep -v "compiles and runs these kernels in the other kernel tests"; then
    status=1; echo "GPU tests were skipped: see above"
fi

echo "== python -m perf.gpu.bench"
# --time-limit caps the timed run; setup (model write, checks, engine start, graph capture) is extra.
# BENCH_ARGS=--smoke makes a dry run of this script on a CPU host (tiny model; the tests run interpreted).
timeout 280 "$PY" -m perf.gpu.bench --out "$OUT" --time-limit 100 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu_bench.log" \
    || { rc=${PIPESTATUS[0]}; status=1; echo "gpu_bench failed or timed out (exit $rc)"; }

echo "== summary"
tail -n 4 "$OUT/pytest.log" 2>/dev/null
cat "$OUT"/gpu_bench-*.md 2>/dev/null
exit $status
