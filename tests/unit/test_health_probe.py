"""The model's is-it-still-served probe (backend_src/serving/health_probe.py) against a real local HTTP
server: 200 ready, 400 not ready, connection refused = stopping, 403 (restricted) disables the probe."""
import http.server
import threading

import pytest

from serving.health_probe import HealthProbe, base_url_from_cmdline
from server_harness.server import free_ports


@pytest.mark.parametrize("args,url", [
    ([], "http://127.0.0.1:8000"),
    (["--http-port=8123", "--http-address=0.0.0.0"], "http://127.0.0.1:8123"),
    (["--http-address", "10.1.2.3", "--http-port", "9000"], "http://10.1.2.3:9000"),
    (["--allow-http=false"], None),
])
def test_address_from_the_tritonserver_command_line(args, url):
    assert base_url_from_cmdline(["--model-repository=/m", *args]) == url


class _Handler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - http.server's name
        self.paths.append(self.path)
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    handler = type("H", (_Handler,), {"paths": []})
    httpd = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd, handler
    httpd.shutdown()
    httpd.server_close()


def test_answers_map_to_ready_not_ready_and_no_answer(server):
    httpd, handler = server
    probe = HealthProbe(f"http://127.0.0.1:{httpd.server_port}", "llm", "1")
    assert probe() is True
    assert handler.paths == ["/v2/models/llm/versions/1/ready"]
    handler.status = 400  # Triton: {"error": "Model version not ready"}
    assert probe() is False
    handler.status = 403  # a restricted health API: the probe cannot help, so it stops asking
    assert probe() is None and probe.disabled
    handler.status = 200
    assert probe() is None


def test_connection_refused_means_the_server_is_stopping():
    port, = free_ports(1)
    assert HealthProbe(f"http://127.0.0.1:{port}", "llm")() is False
