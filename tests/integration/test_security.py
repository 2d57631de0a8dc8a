"""`make serve`'s defaults, checked on the running server: it listens on loopback only, admin APIs (model
repository, shared memory, logging, trace) answer only with the admin key on HTTP and gRPC, models cannot be
loaded or unloaded even with the key (--model-control-mode=none), and inference, health and metadata stay
open. See docs/security.md."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from engine_helpers import MODEL_REPOSITORY
from server_harness.repository import make_model_repository
from server_harness.server import free_ports
from serve_script import serve_script

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
KEY = "test-admin-key-5f3a"

pytestmark = pytest.mark.timeout(300)


def _listening_addresses(pid: int) -> set[str]:
    """host:port of every TCP socket the process listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            host_hex, port_hex = local.split(":")
            if width == 8:
                host = ".".join(str(int(host_hex[i:i + 2], 16)) for i in (6, 4, 2, 0))
            elif host_hex[:24] == "0000000000000000FFFF0000":  # IPv4-mapped ::ffff:a.b.c.d
                host = ".".join(str(int(host_hex[24:][i:i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                host = "::1" if host_hex == "0" * 24 + "01000000" else f"[{host_hex}]"
            found.add(f"{host}:{int(port_hex, 16)}")
    return found


def _http(method: str, url: str, key: str | None = None, body: dict | None = None) -> tuple[int, str]:
    headers = {"admin-key": key} if key else {}
    data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not (TINY / "config.json").exists():
        pytest.skip(f"{TINY} missing: run `make setup`")
    tmp = tmp_path_factory.mktemp("security")
    repo = make_model_repository(MODEL_REPOSITORY, tmp / "repo",
                                 {"llm": {"model": TINY, "num_kv_blocks": 64, "max_model_len": 128}})
    http, grpc, metrics = free_ports(3)
    env = {**os.environ, "MODEL_REPOSITORY": str(repo), "HTTP_PORT": str(http), "GRPC_PORT": str(grpc),
           "METRICS_PORT": str(metrics), "EXIT_TIMEOUT_SECS": "5", "OPENAI_PORT": "off", "ADMIN_KEY": KEY}
    env.pop("BIND_ADDRESS", None)  # the default is what is under test
    log_path = tmp / "serve.log"
    with serve_script(env, log_path, "Ctrl-C stops the server") as proc:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        server_pid = next(int(c) for c in children if b"tritonserver" in Path(f"/proc/{c}/cmdline").read_bytes())
        yield {"http": f"http://127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc}", "ports": (http, grpc, metrics),
               "pid": server_pid}
    assert "stopped cleanly" in log_path.read_text()


def test_listens_on_loopback_only(served):
    addresses = _listening_addresses(served["pid"])
    assert {f"127.0.0.1:{p}" for p in served["ports"]} <= addresses
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


@pytest.mark.parametrize("method,path", [
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/repository/models/llm/unload"),
    ("POST", "/v2/repository/models/llm/load"),
    ("GET", "/v2/logging"),
    ("GET", "/v2/trace/setting"),
    ("GET", "/v2/systemsharedmemory/status"),
    ("GET", "/v2/cudasharedmemory/status"),
])
def test_admin_http_endpoints_need_the_key(served, method, path):
    status, body = _http(method, served["http"] + path)
    assert status == 403, (status, body)


def test_with_the_key_admin_reads_work_but_models_stay_put(served):
    status, body = _http("GET", served["http"] + "/v2/logging", KEY)
    assert status == 200 and "log_verbose_level" in body
    status, body = _http("POST", served["http"] + "/v2/repository/index", KEY)
    assert status == 200 and '"llm"' in body
    # --model-control-mode=none: no load or unload, key or not.
    for action in ("unload", "load"):
        status, body = _http("POST", served["http"] + f"/v2/repository/models/llm/{action}", KEY)
        assert status != 200 and "not allowed" in body, (action, status, body)
    assert _http("GET", served["http"] + "/v2/models/llm/ready")[0] == 200


def test_admin_grpc_calls_need_the_key(served):
    client = grpcclient.InferenceServerClient(served["grpc"])
    try:
        for call in (client.get_log_settings, client.get_trace_settings, client.get_model_repository_index,
                     client.get_system_shared_memory_status):
            with pytest.raises(InferenceServerException) as info:
                call()
            assert "admin-key" in str(info.value) or "PERMISSION_DENIED" in str(info.value), call.__name__
        # Triton 2.51 prefixes the gRPC key header: "admin-key" becomes "triton-grpc-protocol-admin-key".
        with pytest.raises(InferenceServerException, match="triton-grpc-protocol-admin-key"):
            client.get_log_settings(headers={"admin-key": KEY})
        admin = {"triton-grpc-protocol-admin-key": KEY}
        assert client.get_log_settings(headers=admin) is not None
        with pytest.raises(InferenceServerException, match="not allowed"):
            client.unload_model("llm", headers=admin)
        assert client.is_model_ready("llm")
    finally:
        client.close()


def test_inference_health_and_metadata_stay_open(served):
    assert _http("GET", served["http"] + "/v2/health/ready")[0] == 200
    assert _http("GET", served["http"] + "/v2/models/llm")[0] == 200
    status, body = _http("POST", served["http"] + "/v2/models/llm/generate", body={
        "text_input": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and "text_output" in body
