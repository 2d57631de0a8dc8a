"""The GPU image (docker/Dockerfile.gpu) runs our code on NVIDIA's tritonserver:24.10-py3, whose Python is 3.10,
while everything else here runs 3.11: check statically (vermin) that the code it copies needs at most 3.10."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERMIN = Path(sys.executable).parent / "vermin"
# vermin reads torch's `tensor.long()` as Python 2's builtin `long`; nothing here uses that builtin.
VERMIN_ARGS = ["-t=3.10-", "--violations", "--no-tips", "--exclude", "long"]


def gpu_image_sources() -> list[Path]:
    """Python files and folders that Dockerfile.gpu COPYs from the build context (not from another image)."""
    paths = []
    for line in (ROOT / "docker" / "Dockerfile.gpu").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            paths += [ROOT / w for w in words[1:-1] if (ROOT / w).is_dir() or w.endswith(".py")]
    return paths


def vermin(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(VERMIN), *VERMIN_ARGS, *map(str, paths)], capture_output=True, text=True, timeout=300)


def test_code_copied_into_the_gpu_image_runs_on_python_310():
    sources = gpu_image_sources()
    names = {p.relative_to(ROOT).as_posix() for p in sources}
    assert {"backend_src", "model_repository", "scripts/serve.py", "docker/gpu_config.py"} <= names, names
    done = vermin(*sources)
    assert done.returncode == 0, done.stdout + done.stderr


def test_vermin_flags_a_python_311_only_call(tmp_path):
    # asyncio.timeout (3.11) once sat in the OpenAI frontend's client; the check must catch its like.
    bad = tmp_path / "uses_311.py"
    bad.write_text("import asyncio\n\nasync def f():\n    async with asyncio.timeout(1):\n        pass\n")
    done = vermin(bad)
    assert done.returncode != 0 and "asyncio.timeout" in done.stdout, done.stdout
