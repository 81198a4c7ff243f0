#!/usr/bin/env bash
# Install everything shoal and its tests need on a fresh Debian machine (as root):
# Debian packages with apt, Python packages into .venv/ at the repo root.
# Idempotent and quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  containerd runc docker-registry   # the runtime and the origin registry used in tests
  zstd gzip tar busybox-static      # reference compressors, test image contents
  fuse3 pkg-config                  # FUSE (fusermount; shoal-fs speaks /dev/fuse itself)
  gcc linux-libc-dev                # tests/test_fuse_protocol.py checks our FUSE layouts against <linux/fuse.h>
  skopeo podman                     # zstd:chunked interop checks
  apache2-utils openssl             # htpasswd and token auth for the registry tests
  iproute2                          # network namespaces for swarm tests
  aria2                             # a stock BitTorrent client for the swarm interop test
  debootstrap                       # the Debian base of the torch test/bench image
  golang-go golang-github-containerd-containerd-dev  # containerd's snapshotter conformance suite (tests/conformance)
  systemd                           # systemd-analyze verify on deploy/systemd/ (tests/test_deploy.py)
  slurmctld slurmd slurm-client munge  # Slurm hostlists (scontrol) and the job-launch hook test (deploy/slurm/)
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install: apt packages: ${missing[*]}" >&2
  if [ "$(id -u)" != 0 ]; then
    echo "install: need root to install Debian packages" >&2
    exit 1
  fi
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "install: creating .venv with $($PY --version)" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.shoal-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "install: Python packages into .venv" >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -e '.[node,test]' 2>&1 | grep -v -i -e warning -e '^ *$' -e '!!' -e wheel_obj >&2 || true
  .venv/bin/python -c 'import builder, cli.main, zstandard, pyfastcdc, fastcrc, aiohttp, boto3, grpc'
  touch "$stamp"
fi
