"""The CPU image (docker/Dockerfile), built by `make test-docker` (docker/build.py) before these tests: run it
with podman, ports published on loopback, and check what a user relies on: ready through the published port,
tokens streamed over gRPC, the OpenAI port, a non-root server, the HEALTHCHECK, a clean stop, and no
container or host setting left behind."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from perf.probes.large_prompts import LARGE, refused_requests
from server_harness.server import free_ports

IMAGE = os.environ.get("IMAGE", "llm-triton:cpu")
READY_TIMEOUT_S = 420  # SmolLM2 in both arms loads in 20-60 s alone; a busy 2-core machine takes longer


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None or podman("image", "exists", IMAGE, check=False).returncode != 0:
        pytest.fail(f"{IMAGE} is missing: `make test-docker` builds it (docker/build.py cpu)")
    return IMAGE


def in_image(image: str, code: str) -> str:
    return podman("run", "--rm", "--entrypoint", "python", image, "-c", code).stdout.strip()


def test_image_holds_no_build_host_settings_and_a_cpu_torch(image):
    size_gb = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout) / 1e9
    print(f"{image}: {size_gb:.2f} GB")
    assert size_gb < 3.0, "over 3 GB: a CUDA torch or the build tools got into the image?"
    found = json.loads(in_image(image, (
        "import json, os, subprocess, sys, torch; print(json.dumps({"
        "'cuda': torch.version.cuda, 'uid': os.getuid(),"
        "'leftovers': [p for p in ('/etc/pip.conf', '/opt/wheels', '/opt/pypi', '/run/build-ca.crt',"
        " '/opt/llm/.cache', '/etc/xdg/pip') if os.path.exists(p)],"
        "'pip_config': subprocess.run([sys.executable, '-m', 'pip', 'config', 'list'], capture_output=True,"
        " text=True).stdout}))")))
    assert found == {"cuda": None, "uid": 1000, "leftovers": [], "pip_config": ""}
    inspected = json.loads(podman("image", "inspect", image).stdout)[0]
    # podman shows the HEALTHCHECK next to Config (a docker-format image; the OCI format would drop it).
    assert inspected["Healthcheck"]["Test"][-2:] == ["/opt/llm/scripts/health.py", "ready"], inspected["Healthcheck"]
    assert {"8000/tcp", "8001/tcp", "8002/tcp", "9000/tcp"} <= set(inspected["Config"]["ExposedPorts"])
    assert inspected["Config"]["User"] == "1000:1000"


def test_image_carries_the_native_decode_step_built_and_no_compiler(image):
    """The image has no C compiler, so the native CPU decode step must come built (docker/Dockerfile's native
    stage) for this source: found without building, and loadable by the server's user."""
    found = json.loads(in_image(image, (
        "import ctypes, json, shutil; from inflight.model import native_decode as n; path = n.build_library();"
        " ctypes.CDLL(path); print(json.dumps({'cc': shutil.which('cc'), 'path': path}))")))
    assert found["cc"] is None
    assert found["path"].startswith("/opt/llm/native/decode_step-")


def test_container_serves_streams_runs_unprivileged_turns_healthy_and_stops_clean(image):
    name = f"llm-test-{uuid.uuid4().hex[:8]}"
    http, grpc, metrics, openai = free_ports(4)
    t0 = time.monotonic()
    podman("run", "-d", "--name", name, "--shm-size=1g",
           "-p", f"127.0.0.1:{http}:8000", "-p", f"127.0.0.1:{grpc}:8001",
           "-p", f"127.0.0.1:{metrics}:8002", "-p", f"127.0.0.1:{openai}:9000", image)
    try:
        ready_s = wait_ready(name, f"http://127.0.0.1:{http}/v2/health/ready", t0)
        print(f"start to ready: {ready_s:.1f} s")

        text = stream_greedy(f"127.0.0.1:{grpc}", "The capital of France is", max_tokens=8)
        assert text.startswith("Paris."), text  # SmolLM2's known greedy continuation (scripts/prepare_models.py)

        # Every process in the container (tini, serve.py, tritonserver, stubs, OpenAI frontend) is uid 1000.
        uids = json.loads(podman("exec", name, "python", "-c", (
            "import json, pathlib; print(json.dumps({p.name: [l.split()[1] for l in (p / 'status').read_text()"
            ".splitlines() if l.startswith('Uid:')][0] for p in pathlib.Path('/proc').iterdir() if p.name.isdigit()}))"
        )).stdout)
        assert len(uids) >= 5 and set(uids.values()) == {"1000"}, uids

        # tritonserver runs on jemalloc (scripts/install_tritonserver.sh): glibc's malloc let its RSS climb.
        mapped = podman("exec", name, "python", "-c", (
            "import pathlib; print(sorted({p.parent.name for p in pathlib.Path('/proc').glob('[0-9]*/maps')"
            " if 'libjemalloc' in p.read_text() and 'tritonserver' in (p.parent / 'comm').read_text()}))"
        )).stdout.strip()
        assert mapped not in ("", "[]"), "tritonserver does not map libjemalloc"
        # ... with a background thread that gives freed pages back (the wrapper's MALLOC_CONF): without it a
        # burst of large prompts stays resident.
        threads = podman("exec", name, "python", "-c", (
            "import pathlib; print(sorted({t.parent.name for p in pathlib.Path('/proc').glob('[0-9]*/comm')"
            " if p.read_text().strip() == 'tritonserver' for t in p.parent.glob('task/*/comm')"
            " if t.read_text().startswith('jemalloc_bg')}))"
        )).stdout.strip()
        assert threads not in ("", "[]"), "tritonserver has no jemalloc background thread"

        # What a burst of 2 MiB prompts took, tritonserver gives back: serve.py turns off Triton's pool of gRPC
        # request states (each kept the capacity of the largest request it held) and the background thread
        # purges freed pages after 1 s. With the pool on, ~18 MB stayed (perf/results/malloc-tritonserver).
        before = tritonserver_private_mb(name)
        refused = refused_requests(f"127.0.0.1:{grpc}", [LARGE], count=36, clients=6, tag="large")
        assert refused == 36, refused
        time.sleep(4)
        after = tritonserver_private_mb(name)
        print(f"tritonserver private RSS {before} MB before 36 prompts of 2 MiB, {after} MB 4 s after")
        assert after - before < 10, (before, after)

        chat = post_json(f"http://127.0.0.1:{openai}/v1/chat/completions",
                         {"model": "llm", "max_tokens": 8, "temperature": 0,
                          "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert "Paris" in chat["choices"][0]["message"]["content"], chat

        shm = podman("exec", name, "du", "-sh", "/dev/shm").stdout.split()[0]
        print(f"/dev/shm in use after the requests: {shm}")  # docker/README.md's --shm-size advice

        # No systemd here to schedule it: run the image's HEALTHCHECK once by hand, as the timer would.
        podman("healthcheck", "run", name)
        assert health_status(name) == "healthy"

        t_stop = time.monotonic()
        podman("stop", "--time", "60", name, timeout=90)
        print(f"stop: {time.monotonic() - t_stop:.1f} s")
        state = json.loads(podman("inspect", name).stdout)[0]["State"]
        logs = podman("logs", name).stdout + podman("logs", name).stderr
        assert state["ExitCode"] == 0 and "stopped cleanly" in logs, log_summary(name)
    finally:
        podman("rm", "--force", "--time", "10", name, check=False)
    assert podman("ps", "--all", "--quiet", "--filter", f"name={name}").stdout.strip() == ""


def log_summary(name: str) -> str:
    """Triton's error lines (E...) and the tail of the container's log, for a failure message."""
    done = podman("logs", name, check=False)
    lines = (done.stdout + done.stderr).splitlines()
    errors = [line[:600] for line in lines if line[:1] == "E" and line[1:5].isdigit()]
    return "\n".join(errors[:20] + ["..."] + lines[-15:])


def wait_ready(name: str, url: str, t0: float) -> float:
    while time.monotonic() - t0 < READY_TIMEOUT_S:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        running = podman("inspect", "--format", "{{.State.Running}}", name, check=False).stdout.strip()
        if running != "true":
            raise AssertionError(f"container exited before ready:\n{log_summary(name)}")
        time.sleep(1)
    raise AssertionError(f"not ready after {READY_TIMEOUT_S} s:\n{log_summary(name)}")


def stream_greedy(url: str, prompt: str, max_tokens: int) -> str:
    """One streamed request (tokens arrive as several responses) on the published gRPC port."""
    chunks, done = [], []
    client = grpcclient.InferenceServerClient(url)

    def on_response(result=None, error=None):
        if error is not None:
            done.append(error)
            return
        chunks.append(result.as_numpy("text_output")[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.append(None)

    inputs = []
    for name, value, dtype, wire in (("text_input", prompt.encode(), np.object_, "BYTES"),
                                     ("max_tokens", max_tokens, np.int32, "INT32"),
                                     ("temperature", 0.0, np.float32, "FP32"), ("stream", True, np.bool_, "BOOL")):
        tensor = grpcclient.InferInput(name, [1], wire)
        tensor.set_data_from_numpy(np.array([value], dtype=dtype))
        inputs.append(tensor)
    client.start_stream(callback=on_response)
    try:
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
        deadline = time.monotonic() + 120
        while not done and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.stop_stream()
        client.close()
    assert done == [None], f"no clean final: {done}"
    assert len([c for c in chunks if c]) > 1, f"not streamed: {chunks}"
    return "".join(chunks).strip()


def tritonserver_private_mb(name: str) -> int:
    """RssAnon of the container's tritonserver, in MB."""
    return int(podman("exec", name, "python", "-c", (
        "import pathlib; print(next(int(l.split()[1]) // 1024 for p in pathlib.Path('/proc').glob('[0-9]*/comm')"
        " if p.read_text().strip() == 'tritonserver' for l in (p.parent / 'status').read_text().splitlines()"
        " if l.startswith('RssAnon:')))")).stdout)


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def health_status(name: str) -> str:
    state = json.loads(podman("inspect", name).stdout)[0]["State"]
    return (state.get("Health") or state.get("Healthcheck") or {}).get("Status", "")
