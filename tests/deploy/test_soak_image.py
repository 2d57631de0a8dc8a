"""The soak where users run it: `python -m perf.soak --image` runs the CPU image under podman with two instances of
each engine, drives both A/B arms and the OpenAI API with the image mix (cancels, disconnects, bad inputs, OpenAI
streaming, priorities) while Prometheus scrapes and evaluates the dashboard's alert rules. Five minutes: slow, run
with `pytest --run-slow tests/deploy/test_soak_image.py` after `make test-docker` built the image. The 2-hour
figures are in perf/results (docs/faults.md)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("IMAGE", "llm-triton:cpu")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_five_minutes_in_the_image_with_two_instances_lose_and_leak_nothing(tmp_path):
    exists = shutil.which("podman") and subprocess.run(["podman", "image", "exists", IMAGE]).returncode == 0
    if not exists:
        pytest.fail(f"{IMAGE} is missing: `make test-docker` builds it (docker/build.py cpu)")
    proc = subprocess.run([sys.executable, "-m", "perf.soak", "--image", IMAGE, "--minutes", "5", "--instances", "2",
                           "--prometheus", "--name", "image-5m", "--results-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=1150, cwd=ROOT)
    path = tmp_path / "soak-image-5m" / "summary.json"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(path.read_text())["summary"]
    assert s["requests"] > 100, s
    assert (s["missing_finals"], s["duplicate_finals"], s["failed_outcomes"]) == (0, 0, 0), s
    assert s["leaked_blocks"] == 0 and s["quiescence_problems"] == [], s
    assert [a for a in s["alerts"] if a["state"] == "firing"] == [], s["alerts"]
    assert s["leftovers"] == [], s["leftovers"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
