#!/usr/bin/env bash
# Install what ddops, its lab and its tests need on a fresh Debian/Ubuntu machine (idempotent: a second
# run checks and says one line). Python packages go into the project's own virtual environment, .venv/:
# Debian 12 and Ubuntu 23.04+ mark their python3 as externally managed (PEP 668), so pip into it is
# refused, and we never override that (no --break-system-packages).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
# torch is pinned to the CPU wheel that pip's find-links holds: a plain `torch` pulls a multi-GB CUDA build.
pip_args=("torch==2.13.0" -e ./runtime -e ./runtime/devtools -e ".[test]")
# z-lab's reference DFlash code, the tests' oracle (tests/runtime/test_drafter_zlab.py): without its
# dependencies, which pin other torch and transformers versions than ours
oracle_args=(--no-deps "dflash==0.1.0")
stamp=$venv/.ddops-setup

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

# What the installs depend on: the three packages' metadata, the pip arguments, the interpreter and
# where the checkout is (editable installs and the venv's scripts hold absolute paths).
wanted_stamp() {
  cat pyproject.toml runtime/pyproject.toml runtime/devtools/pyproject.toml | sha256sum | cut -d' ' -f1
  echo "${pip_args[*]} ${oracle_args[*]}"
  echo "$PWD"
  "$venv/bin/python" -c 'import sys; print(sys.version)'
}

# A venv we can install into: its python runs and has pip (`python3 -m venv` without ensurepip leaves
# one without pip behind, and an interrupted run a half-made one).
venv_usable() { "$venv/bin/python" -m pip --version >/dev/null 2>&1; }

# Everything installed, as the last successful run left it.
venv_ready() {
  venv_usable && [[ -f $stamp && "$(cat "$stamp")" == "$(wanted_stamp)" ]] &&
    "$venv/bin/python" -c 'import ddops, ddtree_runtime, ddtree_devtools, dflash.model, xdist' 2>/dev/null &&
    "$venv/bin/ddops" --version >/dev/null 2>&1
}

apt_packages=(debootstrap systemd-container rsync openssh-client)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ! venv_usable; then
  if ! command -v python3 >/dev/null; then
    missing+=(python3 python3-venv)
  elif ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    missing+=("python$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv")
  fi
fi
if ((${#missing[@]})); then
  echo "--> apt: installing ${missing[*]}"
  with_heartbeat "apt-get update" apt-get update -qq
  with_heartbeat "apt-get install" quietly env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

if venv_ready; then
  echo "--> ready: $venv is up to date ($("$venv/bin/ddops" --version)); put it on PATH with: . $venv/bin/activate"
  exit 0
fi
if ! venv_usable; then
  echo "--> venv: $venv ($(command -v python3) -m venv)"
  rm -rf "$venv"
  python3 -m venv "$venv"
fi
echo "--> pip: ddops, the runtime and the test tools (into $venv)"
rm -f "$stamp"
with_heartbeat "pip install" "$venv/bin/python" -m pip install -q --disable-pip-version-check "${pip_args[@]}"
with_heartbeat "pip install dflash" "$venv/bin/python" -m pip install -q --disable-pip-version-check "${oracle_args[@]}"
"$venv/bin/ddops" --version >/dev/null
wanted_stamp >"$stamp"
echo "--> ready: $venv/bin/ddops ($("$venv/bin/ddops" --version)); put it on PATH with: . $venv/bin/activate"
