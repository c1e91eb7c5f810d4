#!/usr/bin/env bash
# The wheels an H200 call needs that the device image lacks (its python is 3.12; it has torch, triton,
# transformers, einops, httpx, prometheus-client), fetched here into .whl/ at this venv's versions.
# Each call then names ".whl" in carry and runs `bash runtime/bench/h200.sh ...`, which installs them.
#
#     bash runtime/bench/device_wheels.sh          # from the repository root, once a session
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pip=(.venv/bin/python -m pip)
names=(fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions
       annotated-doc opentelemetry-api)
pins=("fla-core==$(sed -n 's/.*"fla-core==\([^"]*\)".*/\1/p' runtime/pyproject.toml)")   # the cuda extra's
for name in "${names[@]}"; do
    version=$("${pip[@]}" show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    pins+=("$name${version:+==$version}")
done
platforms=()
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35 2_39; do platforms+=(--platform "manylinux_${n}_x86_64"); done
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
ls .whl
