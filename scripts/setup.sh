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

# Everything goes into the project's own virtual environment: Debian 12 and Ubuntu 23.04+ mark their
# python3 as externally managed (PEP 668), so pip into it is refused, and we never override that.
venv=.venv
if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    pyver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    echo "--> apt: installing python${pyver}-venv (python3 has no venv/ensurepip)"
    with_heartbeat "apt-get update" apt-get update -qq
    with_heartbeat "apt-get install" quietly env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python${pyver}-venv"
  fi
  echo "--> venv: $venv (python3 -m venv)"
  rm -rf "$venv"
  python3 -m venv "$venv"
fi

# torch is pinned to the CPU wheel that pip's find-links holds: a plain `torch` pulls a multi-GB CUDA build.
echo "--> pip: ddops, the runtime and the test tools (into $venv)"
with_heartbeat "pip install" "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" -e "./runtime" -e "./runtime/devtools" -e ".[test]"
echo "--> ready: $venv/bin/ddops ($("$venv/bin/ddops" --version)); put it on PATH with: . $venv/bin/activate"
