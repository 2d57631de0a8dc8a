"""The real serving stack for tests and perf: a temporary model repository of `llm` models, the OpenAI
frontend as its own process, and a direct streaming gRPC call to compare against."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from triton_server import free_ports

ROOT = Path(__file__).resolve().parent.parent
LLM_DIR = ROOT / "model_repository" / "llm"


def make_model_repository(dest: Path, models: dict[str, dict[str, Any]]) -> Path:
    """One copy of model_repository/llm per entry: name -> {config parameter: value}. The model.py is a
    symlink (it finds backend_src through it); only parameters the config already has may be overridden,
    so a typo fails here rather than as a load error inside the server."""
    template = (LLM_DIR / "config.pbtxt").read_text()
    for name, overrides in models.items():
        cfg = re.sub(r'^name: "llm"', f'name: "{name}"', template, count=1, flags=re.M)
        for key, value in overrides.items():
            pattern = rf'(key: "{re.escape(key)}"\s*value: \{{ string_value: ")[^"]*(")'
            cfg, n = re.subn(pattern, rf"\g<1>{value}\g<2>", cfg)
            if n != 1:
                raise KeyError(f"config.pbtxt has no parameter {key!r} to override")
        (dest / name / "1").mkdir(parents=True, exist_ok=True)
        (dest / name / "config.pbtxt").write_text(cfg)
        link = dest / name / "1" / "model.py"
        if not link.exists():
            link.symlink_to(LLM_DIR / "1" / "model.py")
    return dest


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
        env = {**os.environ, "PYTHONPATH": str(ROOT / "backend_src")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "openai_frontend", "--triton-grpc", self.triton_grpc, "--host", "127.0.0.1",
                 "--port", str(self.port), *self.extra_args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
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


def grpc_inputs(prompt: str, values: dict[str, Any]) -> list:
    from tritonclient.grpc import InferInput

    types = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32)}
    inputs = []
    for name, value in {"text_input": prompt, **values}.items():
        if isinstance(value, (str, list)):
            items = value if isinstance(value, list) else [value]
            arr, wire = np.array([s.encode() for s in items], dtype=np.object_), "BYTES"
        else:
            wire, np_type = ("UINT64", np.uint64) if name == "seed" else types[type(value)]
            arr = np.array([value], dtype=np_type)
        inp = InferInput(name, list(arr.shape), wire)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


async def grpc_stream(url: str, model: str, prompt: str, **values: Any) -> tuple[list[str], dict[str, Any]]:
    """The direct path: one streaming gRPC request. Returns (text deltas, final response's extra outputs)."""
    from tritonclient.grpc.aio import InferenceServerClient

    values = {"stream": True, "return_finish_reason": True, "return_num_input_tokens": True,
              "return_num_output_tokens": True, **values}
    inputs = grpc_inputs(prompt, values)

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
            if reason is not None:
                final = {"finish_reason": reason.reshape(-1)[0].decode(),
                         "num_input_tokens": int(result.as_numpy("num_input_tokens").reshape(-1)[0])}
                break
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
