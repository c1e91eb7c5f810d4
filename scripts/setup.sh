#!/usr/bin/env bash
# Install what ddops, its lab and its tests need on a fresh Debian/Ubuntu machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(debootstrap systemd-container rsync openssh-client)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "--> apt: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# torch is pinned to the CPU wheel that pip's find-links holds: a plain `torch` pulls a multi-GB CUDA build.
echo "--> pip: ddops, the runtime and the test tools"
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "torch==2.13.0" -e "./runtime" -e ".[test]"
