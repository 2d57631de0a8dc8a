#!/usr/bin/env bash
# Idempotent machine setup for `make test-docker` (root, Debian 12): podman and its tools, a
# containers.conf that works on these hosts, Prometheus, and a local Debian base image (no public
# registry is reachable here). A second run checks and skips; the first takes about 3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-local/debian:bookworm}
PACKAGES=(podman buildah runc debootstrap prometheus)
CONF=/etc/containers/containers.conf

say() { echo "[setup_docker] $*"; }

if [ "$(id -u)" != 0 ]; then
  echo "[setup_docker] needs root (apt-get, /etc/containers, podman's root storage)" >&2
  exit 1
fi

# 1. Packages, only those missing. Prometheus: no recommends (node-exporter), and its service is not
#    started (policy-rc.d exits 101 here; tests start their own Prometheus on a free port).
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
fi

# 2. containers.conf: crun (podman's default) fails on these hosts' hybrid cgroups, and the default
#    ulimits are higher than the host allows. An existing different file is kept as .orig once.
want_conf='# Written by scripts/setup_docker.sh: crun fails on hybrid cgroup hosts; higher ulimits are refused.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"'
if [ "$(cat "$CONF" 2>/dev/null)" != "$want_conf" ]; then
  mkdir -p "$(dirname "$CONF")"
  [ -f "$CONF" ] && [ ! -f "$CONF.orig" ] && cp "$CONF" "$CONF.orig"
  printf '%s\n' "$want_conf" >"$CONF"
  say "wrote $CONF"
fi

# 3. The base image: Debian bookworm minbase from this machine's own Debian mirror (the same release
#    as the public debian:bookworm-slim default of docker/Dockerfile). Built once; podman's image
#    store is the cache.
if ! podman image exists "$BASE_IMAGE"; then
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${MIRROR:-${mirror:-http://deb.debian.org/debian}}
  rootfs=$(mktemp -d /var/tmp/bookworm-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  say "building $BASE_IMAGE with debootstrap from $mirror (about 1.5 minutes)"
  t0=$SECONDS
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  say "$BASE_IMAGE ready in $((SECONDS - t0)) s"
fi
say "ok: $(podman --version), $(prometheus --version 2>&1 | head -n1), base image $BASE_IMAGE"
