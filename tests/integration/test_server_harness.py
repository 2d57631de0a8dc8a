"""The TritonServer harness against the real tritonserver: a torch-importing echo model
answers, and stop() leaves no stub process and no shared memory behind (or reports it)."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from server_harness.server import SHM_DIR, TritonServer, python_stubs, shm_regions

ECHO_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "TORCH_VERSION" data_type: TYPE_STRING dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

# Importing torch inside the stub is the point: it fails when the wrapper's LD_LIBRARY_PATH
# lacks the venv interpreter's LIBDIR, which a numpy-only toy model would not notice.
ECHO_MODEL = '''
import numpy as np
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            y = torch.from_numpy(x.copy()).numpy()
            version = np.array([torch.__version__.encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", y.astype(np.float32)),
                pb_utils.Tensor("TORCH_VERSION", version),
            ]))
        return responses
'''


@pytest.fixture
def echo_repo(tmp_path: Path) -> Path:
    model = tmp_path / "repo" / "echo"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(textwrap.dedent(ECHO_CONFIG))
    (model / "1" / "model.py").write_text(ECHO_MODEL)
    return tmp_path / "repo"


def echo(server: TritonServer, values: list[float]) -> tuple[np.ndarray, str]:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        x = np.array(values, dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("echo", [inp])
        return result.as_numpy("OUTPUT0"), result.as_numpy("TORCH_VERSION")[0].decode()
    finally:
        client.close()


def test_echo_round_trip_and_clean_stop(triton_server_factory, echo_repo: Path) -> None:
    server = triton_server_factory(echo_repo)
    assert server.is_running()
    out, torch_version = echo(server, [1.5, -2.0, 3.25])
    np.testing.assert_array_equal(out, np.array([1.5, -2.0, 3.25], dtype=np.float32))
    assert torch_version == torch.__version__
    assert "successfully loaded 'echo'" in server.log_text()

    stubs = [pid for pid, argv in python_stubs() if argv[5] == str(server.pid)]
    assert len(stubs) == 1, "one instance of echo -> one stub process"

    server.stop()
    assert not server.is_running()
    assert server.leftovers() == []
    assert all(not os.path.exists(f"/proc/{pid}") for pid in stubs)


def test_leftovers_are_reported_then_cleaned(triton_server_factory, echo_repo: Path) -> None:
    """SIGKILL the server while its stub is frozen: the stub and its shm region must stay,
    be reported by leftovers(), and then be gone (the harness cleans up what it reports)."""
    server = triton_server_factory(echo_repo, check_leftovers=False, leftover_settle_s=1.0)
    ((stub_pid, argv),) = [(p, a) for p, a in python_stubs() if a[5] == str(server.pid)]
    region = argv[2]
    assert region in shm_regions()

    os.kill(stub_pid, signal.SIGSTOP)  # a frozen stub cannot notice its parent dying
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    started = time.monotonic()
    server.stop()
    problems = server.leftovers()

    assert any(f"stub pid {stub_pid}" in p for p in problems), problems
    assert any(region in p for p in problems), problems
    assert time.monotonic() - started < 30
    assert not (SHM_DIR / region).exists()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{stub_pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{stub_pid}")
