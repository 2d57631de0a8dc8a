"""The OpenAI frontend as its own process, and a direct streaming gRPC call to compare it against."""
from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


from .server import free_ports
from .stream_client import make_inputs

class FrontendProcess:
    """`python -m openai_frontend` on a free loopback port, stopped by its own pid."""

    def __init__(self, triton_grpc: str, log_path: Path, extra_args: tuple[str, ...] = ()):
        self.triton_grpc = triton_grpc
        self.log_path = log_path
        self.extra_args = extra_args
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "FrontendProcess":
        self.port = free_ports(1)[0]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "openai_frontend", "--triton-grpc", self.triton_grpc, "--host", "127.0.0.1",
                 "--port", str(self.port), *self.extra_args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.log_path.parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"openai frontend did not become ready:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "FrontendProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def grpc_stream(url: str, model: str, prompt: str, **values: Any) -> tuple[list[str], dict[str, Any]]:
    """The direct path: one streaming gRPC request. Returns (text deltas, final response's extra outputs)."""
    from tritonclient.grpc.aio import InferenceServerClient

    values = {"stream": True, "return_finish_reason": True, "return_num_input_tokens": True,
              "return_num_output_tokens": True, **values}
    inputs = make_inputs(prompt, values)

    async def requests():
        yield {"model_name": model, "inputs": inputs}

    client = InferenceServerClient(url)
    deltas, final = [], {}
    try:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(error.message())
            deltas.append(result.as_numpy("text_output").reshape(-1)[0].decode())
            reason = result.as_numpy("finish_reason")
            if reason is not None and reason.reshape(-1)[0] != b"None":  # "None" until the last response
                final = {"finish_reason": reason.reshape(-1)[0].decode(),
                         "num_input_tokens": int(result.as_numpy("num_input_tokens").reshape(-1)[0])}
            # No break at the final response: read on to the server's end of stream, which follows at once.
            # Closing the client before it came would cancel a finished stream, and Triton 2.51 then keeps
            # the model referenced until shutdown, which waits out its whole exit timeout.
    finally:
        await client.close()
    return deltas, final


def grpc_generate(url: str, model: str, prompt: str, **values: Any) -> tuple[str, dict[str, Any]]:
    deltas, final = asyncio.run(grpc_stream(url, model, prompt, **values))
    return "".join(deltas), final


def scrape(metrics_url: str, model: str) -> dict[str, float]:
    """Triton's /metrics for one model: metric name -> value (labels other than the model dropped)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^([\w:]+)\{([^}]*)\}\s+(\S+)$', line)
        if m and f'model="{model}"' in m.group(2):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out
