#!/usr/bin/env bash
# Build the CPU image (docker/Dockerfile) or the GPU image (docker/Dockerfile.gpu) with podman, passing
# this machine's pip settings into the build stages only: pip.conf and the CA bundle as build secrets,
# local wheel folders and index folders as read-only build volumes. Nothing of them lands in a layer.
#
#   docker/build.sh [cpu|gpu]
#
# Environment: IMAGE (tag; default llm-triton:cpu / llm-triton:gpu), BASE (CPU base image build arg),
# TORCH_INDEX (build arg; unset keeps the Dockerfile's default, empty leaves torch to pip's settings),
# PYTHON (the interpreter whose `pip config` is read; default .venv/bin/python).
# A user with a Docker engine and plain internet needs none of this: see docker/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."

flavor=${1:-cpu}
case $flavor in
  cpu) dockerfile=docker/Dockerfile ;;
  gpu) dockerfile=docker/Dockerfile.gpu ;;
  *) echo "usage: $0 [cpu|gpu]" >&2; exit 2 ;;
esac
IMAGE=${IMAGE:-llm-triton:$flavor}
PYTHON=${PYTHON:-.venv/bin/python}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The host's effective pip settings -> $work/pip.conf (cert pointed at the secret's mount), plus the
# local paths the build must see. Precedence as pip's: global < user < site < environment variables.
"$PYTHON" - "$work" <<'PYEOF' >"$work/args"
import os, subprocess, sys
from pathlib import Path
work = Path(sys.argv[1])
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
rank = {"global": 0, "user": 1, "site": 2, ":env:": 3}
settings = {}
for line in sorted(out.stdout.splitlines(), key=lambda l: rank.get(l.split(".", 1)[0], 0)):
    key, _, value = line.partition("=")
    settings[key.split(".", 1)[1]] = value.strip("'\"")
args, conf = [], ["[global]"]
for key, value in settings.items():
    if key == "cert":
        args += ["--secret", f"id=ca.crt,src={value}"]
        value = "/run/build-ca.crt"  # where docker/Dockerfile mounts that secret
    conf.append(f"{key} = {value}")
    for item in value.split() if key in ("find-links", "extra-index-url", "index-url", "constraint") else ():
        path = item.removeprefix("file://").rstrip("/")
        if key.endswith("index-url"):
            path = os.path.dirname(path)  # a local "simple" index links to files beside it (../../files/...)
        if path.startswith("/") and os.path.exists(path):
            args += ["--volume", f"{path}:{path}:ro"]
(work / "pip.conf").write_text("\n".join(conf) + "\n")
args += ["--secret", f"id=pip.conf,src={work / 'pip.conf'}"]
print("\n".join(args))
PYEOF
mapfile -t pip_args <"$work/args"

build_args=()
[ -n "${BASE+x}" ] && build_args+=(--build-arg "BASE=$BASE")
[ -n "${TORCH_INDEX+x}" ] && build_args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")

# --format docker: the OCI image format has no HEALTHCHECK. --network host: the build reaches the package
# registries the way this machine does.
echo "[build] podman build -f $dockerfile -t $IMAGE ${build_args[*]} (pip settings: ${#pip_args[@]} args)"
t0=$SECONDS
podman build --format docker --network host -f "$dockerfile" -t "$IMAGE" \
  "${build_args[@]}" "${pip_args[@]}" .
echo "[build] $IMAGE built in $((SECONDS - t0)) s; size $(podman image inspect --format '{{.Size}}' "$IMAGE" |
  awk '{printf "%.2f GB", $1 / 1e9}')"
