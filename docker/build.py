#!/usr/bin/env python3
"""Build the CPU image (docker/Dockerfile) or the GPU image (docker/Dockerfile.gpu) with podman, giving the
build this machine's pip settings without putting any of them in a layer.

    .venv/bin/python docker/build.py [cpu|gpu] [--image TAG] [--base IMAGE] [--torch-index URL]

The effective `pip config` (index, find-links, constraint, CA bundle) becomes a pip.conf passed as a build
secret (the Dockerfiles mount it at /etc/pip.conf in their pip steps only), the CA bundle another secret.
Local folders it names (a wheel folder, a file:// index) are served read-only over HTTP on 127.0.0.1 for the
length of the build (the build runs with --network host), so they need no mount: podman's build volumes
would leave empty mount points in every stage, the final image included. A user with a Docker engine and
plain internet needs none of this: docker/README.md.

--torch-index "" leaves torch to pip's settings (here: the CPU wheel in the local folder); by default the
Dockerfile's own (PyTorch's CPU index) applies. Standard library only.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = {"cpu": ROOT / "docker" / "Dockerfile", "gpu": ROOT / "docker" / "Dockerfile.gpu"}
SECRET_CA = "/run/build-ca.crt"  # where the Dockerfiles mount the ca.crt secret
# pip config precedence: config files (global < user < site), then environment variables.
RANK = {"global": 0, "user": 1, "site": 2, ":env:": 3}
PATH_KEYS = ("find-links", "extra-index-url", "index-url", "constraint")


def pip_settings(python: str) -> dict[str, str]:
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    settings: dict[str, str] = {}
    for line in sorted(out.splitlines(), key=lambda line: RANK.get(line.split(".", 1)[0], 0)):
        key, _, value = line.partition("=")
        settings[key.split(".", 1)[1]] = value.strip("'\"")
    return settings


def build_pip_conf(settings: dict[str, str], served: Path, base_url: str) -> tuple[str, str | None]:
    """(pip.conf text, CA bundle path or None). Local paths become URLs under base_url; each is a symlink in
    `served` (only those paths are served)."""
    lines, ca = ["[global]"], None
    for key, value in settings.items():
        if key == "cert":
            ca, value = value, SECRET_CA
        elif key in PATH_KEYS:
            items = []
            for item in value.split():
                path = item.removeprefix("file://")
                if path.startswith("/") and os.path.exists(path):
                    link = served / f"p{len(list(served.iterdir()))}"
                    if key.endswith("index-url"):  # a local "simple" index links to files beside it (../../files)
                        link.symlink_to(Path(path).parent)
                        item = f"{base_url}/{link.name}/{Path(path).name}/"
                    else:
                        link.symlink_to(path)
                        item = f"{base_url}/{link.name}" + ("/" if os.path.isdir(path) else "")
                items.append(item)
            value = " ".join(items)
        lines.append(f"{key} = {value}")
    if len(list(served.iterdir())):
        lines.append("trusted-host = 127.0.0.1")  # plain HTTP, on loopback, for the build only
    return "\n".join(lines) + "\n", ca


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("flavor", nargs="?", choices=sorted(DOCKERFILES), default="cpu")
    parser.add_argument("--image", help="tag (default llm-triton:<flavor>)")
    parser.add_argument("--base", help="the BASE build argument (here: local/debian:bookworm)")
    parser.add_argument("--torch-index", help='the TORCH_INDEX build argument ("": pip settings decide)')
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose `pip config` is used")
    parser.add_argument("--no-cache", action="store_true", help="rebuild every layer (a cold build)")
    args = parser.parse_args(argv)
    image = args.image or f"llm-triton:{args.flavor}"
    with tempfile.TemporaryDirectory() as tmp:
        served = Path(tmp) / "served"
        served.mkdir()
        server, base_url = serve(served)
        try:
            conf, ca = build_pip_conf(pip_settings(args.python), served, base_url)
            (Path(tmp) / "pip.conf").write_text(conf)
            cmd = ["podman", "build", "--format", "docker",  # the OCI format has no HEALTHCHECK
                   "--network", "host",  # the build reaches the registries (and our loopback server) as we do
                   "-f", str(DOCKERFILES[args.flavor]), "-t", image,
                   "--secret", f"id=pip.conf,src={Path(tmp) / 'pip.conf'}"]
            if ca:
                cmd += ["--secret", f"id=ca.crt,src={ca}"]
            if args.no_cache:
                cmd.append("--no-cache")
            if args.base is not None:
                cmd += ["--build-arg", f"BASE={args.base}"]
            if args.torch_index is not None:
                cmd += ["--build-arg", f"TORCH_INDEX={args.torch_index}"]
            cmd.append(str(ROOT))
            print(f"[build] {' '.join(cmd)}\n[build] pip.conf for the build:\n{conf}", flush=True)
            t0 = time.monotonic()
            code = subprocess.run(cmd).returncode
        finally:
            server.shutdown()
    if code != 0:
        return code
    size = subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", image], capture_output=True,
                          text=True, check=True).stdout
    print(f"[build] {image} built in {time.monotonic() - t0:.0f} s; {int(size) / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
