"""The CPU image (docker/Dockerfile) run with podman as a platform team would: ports published on loopback,
N instances of each engine, the image's own serve.py, probes and model files. Used by the soak in the image
(perf/soak) and the container tests (tests/deploy).

The instance count comes from a copy of the image's model_repository/ (relative model paths kept, so it still
finds /opt/llm/models) mounted read-only and named by MODEL_REPOSITORY. The container's processes are read
from the host's /proc: rootful podman runs them in the host's pid space as well (other numbers inside).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from .quiescence import http_status
from .server import LoopbackEndpoints, free_ports

MOUNT = "/opt/llm/soak_repository"  # beside /opt/llm/models, so ../models/... resolves as in the image
ENGINES = ("llm", "llm_dynamic")


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done


def repository_with(source: Path, dest: Path, instances: int, params: Mapping[str, str] | None = None) -> Path:
    """A copy of `source` whose engines have `instances` instances each and `params` set (existing keys only)."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ENGINES:
        path = dest / name / "config.pbtxt"
        config = text_format.Parse(path.read_text(), mc.ModelConfig())
        for group in config.instance_group:
            group.count = instances
        for key, value in (params or {}).items():
            if key not in config.parameters:
                raise KeyError(f"parameter {key}={value!r} is not in {name}'s config")
            config.parameters[key].string_value = str(value)
        path.write_text(text_format.MessageToString(config))
    for path in [dest, *dest.rglob("*")]:  # the server runs as uid 1000 inside
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and fields[1] == str(pid):
                out.append(int(entry.name))
    return out


@dataclass
class ImageServer(LoopbackEndpoints):
    """One container of `image`; start() waits until ready through the published port."""
    image: str
    repository: Path | None = None  # mounted as the served repository (None: the image's own)
    env: Mapping[str, str] = field(default_factory=dict)
    name: str = field(default_factory=lambda: f"llm-soak-{uuid.uuid4().hex[:8]}")
    shm_size: str = "1g"
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self.http_port, self.grpc_port, self.metrics_port, self.openai_port = free_ports(4)

    @property
    def openai_base(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    def start(self) -> "ImageServer":
        args = ["run", "-d", "--name", self.name, f"--shm-size={self.shm_size}",
                "-p", f"127.0.0.1:{self.http_port}:8000", "-p", f"127.0.0.1:{self.grpc_port}:8001",
                "-p", f"127.0.0.1:{self.metrics_port}:8002", "-p", f"127.0.0.1:{self.openai_port}:9000"]
        if self.repository is not None:
            args += ["-v", f"{self.repository}:{MOUNT}:ro", "-e", f"MODEL_REPOSITORY={MOUNT}"]
        for key, value in self.env.items():
            args += ["-e", f"{key}={value}"]
        podman(*args, self.image)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if (http_status(f"{self.http_base}/v2/health/ready") == 200
                    and http_status(f"{self.openai_base}/health") == 200):
                return self
            if not self.running():
                raise RuntimeError(f"container {self.name} exited before ready:\n{self.logs()[-3000:]}")
            time.sleep(1)
        raise RuntimeError(f"container {self.name} not ready after {self.ready_timeout_s:.0f} s:\n"
                           f"{self.logs()[-3000:]}")

    def running(self) -> bool:
        done = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return done.stdout.strip() == "true"

    def logs(self) -> str:
        done = podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def exec(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return podman("exec", self.name, *command, timeout=timeout, check=False)

    def processes(self) -> dict[str, int]:
        """Host pids: "serve.py", "tritonserver", "openai" and one per stub by Triton instance name (llm_0_1)."""
        init = int(podman("inspect", "--format", "{{.State.Pid}}", self.name).stdout.strip())
        found: dict[str, int] = {}
        todo = [init]
        while todo:
            pid = todo.pop()
            todo += _children(pid)
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode(errors="replace") for a in argv if a]
            if not args:
                continue
            exe = os.path.basename(args[0])
            if exe == "tritonserver":
                found["tritonserver"] = pid
            elif exe == "triton_python_backend_stub" and len(args) > 8:
                found[args[8]] = pid
            elif any(a.endswith("serve.py") for a in args[:3]):
                found["serve.py"] = pid
            elif "openai_frontend" in args:
                found["openai"] = pid
        return found

    def stop(self, timeout_s: int = 90) -> dict:
        """podman stop (SIGTERM to tini, then serve.py stops tritonserver); the exit code and whether serve.py
        found nothing left behind. The container is removed."""
        t0 = time.monotonic()
        podman("stop", "--time", str(timeout_s), self.name, timeout=timeout_s + 30, check=False)
        stop_s = time.monotonic() - t0
        state = json.loads(podman("inspect", self.name).stdout)[0]["State"]
        logs = self.logs()
        podman("rm", "--force", "--time", "10", self.name, check=False)
        return {"exit_code": state.get("ExitCode"), "stop_s": round(stop_s, 1),
                "stopped_cleanly": "stopped cleanly" in logs, "log_tail": logs[-2000:]}
