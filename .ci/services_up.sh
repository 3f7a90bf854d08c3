#!/usr/bin/env bash
# The services the test suite uses, on this host: headless Chromium (the report test opens
# the workflow's HTML report), debootstrap (the image's root filesystem) and a two-node
# Slurm cluster (.ci/slurm_up.sh). Needs root, or sudo for the package installs and the
# daemons. Idempotent and quick once they run.
set -euo pipefail
cd "$(dirname "$0")/.."
as_root() { if ((EUID == 0)); then "$@"; else sudo "$@"; fi; }
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi
as_root bash .ci/slurm_up.sh
