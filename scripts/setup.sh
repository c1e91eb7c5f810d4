#!/usr/bin/env bash
# Install what ddops, its lab and its tests need on a fresh Debian/Ubuntu machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

# Run "$@", saying every 8 s that it still runs (pip and apt are quiet here, and a log must never sit silent).
with_heartbeat() {
  local what=$1 start=$SECONDS pid
  shift
  "$@" &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    for _ in 1 2 3 4 5 6 7 8; do
      sleep 1
      kill -0 "$pid" 2>/dev/null || break 2
    done
    echo "    ... $what, $((SECONDS - start))s"
  done
  wait "$pid"
}

quietly() { "$@" >/dev/null; }

apt_packages=(debootstrap systemd-container rsync openssh-client)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "--> apt: installing ${missing[*]}"
  with_heartbeat "apt-get update" apt-get update -qq
  with_heartbeat "apt-get install" quietly env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# torch is pinned to the CPU wheel that pip's find-links holds: a plain `torch` pulls a multi-GB CUDA build.
echo "--> pip: ddops, the runtime and the test tools"
with_heartbeat "pip install" python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "torch==2.13.0" -e "./runtime" -e "./runtime/devtools" -e ".[test]"
