"""What can be checked of the GPU image (docker/Dockerfile.gpu) without NVIDIA's registry or a GPU: its pins
install on the base image's Python 3.10 (pip resolves them for CPython 3.10 on manylinux x86_64, against
PyPI), and docker/gpu_config.py turns the real repository's engines to the GPU. (hadolint: test_deploy_files;
the code's Python 3.10 syntax and library use: tests/unit/test_python310.py.)"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

ROOT = Path(__file__).resolve().parents[2]
GPU_REQUIREMENTS = ROOT / "docker" / "requirements-gpu.txt"
# tritonserver:24.10-py3 is Ubuntu 22.04 (glibc 2.35); pip takes explicit platform tags one by one.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]


def test_gpu_requirements_resolve_for_python_310(tmp_path):
    report = tmp_path / "report.json"
    args = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
            "--only-binary", ":all:", "--python-version", "3.10", "--implementation", "cp",
            "--target", str(tmp_path / "target"), "--report", str(report), "-r", str(GPU_REQUIREMENTS)]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(report.read_text())["install"]
    installed = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in plan}
    assert installed["torch"] == "2.13.0" and installed["transformers"] == "5.20.2", installed
    assert "nvidia-pytriton" not in installed  # NVIDIA's image brings its own tritonserver


def test_serving_pins_differ_from_the_gpu_pins_only_where_python_310_needs_it():
    def pins(path: Path) -> dict[str, str]:
        out = {}
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if "==" in line:
                name, version = line.split("==")
                out[name.split("[")[0].lower()] = version.strip()
        return out

    serve, gpu = pins(ROOT / "requirements-serve.txt"), pins(GPU_REQUIREMENTS)
    # triton: the CPU image pins the one xgrammar asks for; torch's CUDA build brings its own to the GPU image.
    assert set(serve) - set(gpu) == {"nvidia-pytriton", "triton"}
    assert {k for k in gpu if gpu[k] != serve[k]} == {"transformers", "fastapi", "uvicorn"}


def test_gpu_config_turns_both_engines_to_cuda(tmp_path):
    repo = tmp_path / "model_repository"
    shutil.copytree(ROOT / "model_repository", repo)
    done = subprocess.run([sys.executable, str(ROOT / "docker" / "gpu_config.py"), str(repo)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for name in ("llm", "llm_dynamic"):
        config = text_format.Parse((repo / name / "config.pbtxt").read_text(), mc.ModelConfig())
        assert [g.kind for g in config.instance_group] == [mc.ModelInstanceGroup.KIND_GPU]
        assert config.parameters["device"].string_value == "cuda"
    # The tokenizer-only steps stay on the CPU.
    pre = text_format.Parse((repo / "preprocessing" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert [g.kind for g in pre.instance_group] == [mc.ModelInstanceGroup.KIND_CPU]
    # Run again on the converted repository: nothing left to convert is an error, not a silent pass.
    again = subprocess.run([sys.executable, str(ROOT / "docker" / "gpu_config.py"), str(repo)],
                           capture_output=True, text=True)
    assert again.returncode == 1 and "expected one KIND_CPU" in again.stderr
