"""The runtime's CUDA stack matched to the host before anything changes: the torch the deps step would
install (or the one the venv holds, which it keeps) must be built for a CUDA the driver supports and for
the architecture of every GPU the profile uses, and the profile must not ask a GPU for what it cannot do.

What is relied on, since neither can be read from a wheel without installing it:
- MIN_DRIVER: the minimum Linux driver of each CUDA toolkit, from NVIDIA's CUDA Toolkit release notes
  (Table 3, "CUDA Toolkit and Corresponding Driver Versions", the GA release of each). A torch wheel bundles
  its CUDA runtime, so the driver must be at least that toolkit's.
- WHEEL_ARCHS: the GPU architectures PyTorch's own Linux x86_64 wheels are built for, per CUDA version, from
  PyTorch's build script (.ci/manywheel/build_cuda.sh, TORCH_CUDA_ARCH_LIST) of its 2.8-2.9 releases; `+PTX`
  on the last one means newer GPUs can JIT-compile its kernels. A GPU of capability X.Y runs the kernels
  built for X.Z with Z <= Y (same major), or JIT from PTX built for an older one.
- FIRST_TORCH: the first torch release published for each CUDA version (for the fix a refusal names).
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

Cuda = tuple[int, int]

MIN_DRIVER: dict[Cuda, str] = {
    (11, 8): "520.61.05", (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03", (12, 3): "545.23.06",
    (12, 4): "550.54.14", (12, 5): "555.42.02", (12, 6): "560.28.03", (12, 8): "570.26", (12, 9): "575.51.03",
    (13, 0): "580.65.06",
}
WHEEL_ARCHS: dict[Cuda, str] = {
    (11, 8): "3.7;5.0;6.0;7.0;7.5;8.0;8.6;9.0",
    (12, 1): "5.0;6.0;7.0;7.5;8.0;8.6;9.0",
    (12, 4): "5.0;6.0;7.0;7.5;8.0;8.6;9.0",
    (12, 6): "5.0;6.0;7.0;7.5;8.0;8.6;9.0",
    (12, 8): "7.0;7.5;8.0;8.6;9.0;10.0;12.0",
    (12, 9): "7.0;7.5;8.0;8.6;9.0;10.0;12.0+PTX",
    (13, 0): "7.5;8.0;8.6;9.0;10.0;12.0+PTX",
}
FIRST_TORCH: dict[Cuda, str] = {(11, 8): "2.0.0", (12, 1): "2.1.0", (12, 4): "2.4.0", (12, 6): "2.6.0",
                                (12, 8): "2.7.0", (12, 9): "2.8.0", (13, 0): "2.9.0"}
BF16_MIN_CAPABILITY = 8.0   # bfloat16 tensor cores: Ampere and later
# The torch a kernel library installed beside it needs, where pip does not enforce it: fla-core 0.6.0's
# wheel asks torch>=2.7 and triton>=3.3 only under its `cuda` extra, and profiles install plain
# `fla-core` (each torch Linux wheel pins its own triton: torch 2.7 ships triton 3.3, so torch's floor
# carries triton's). Library -> (its first version with the floor, the torch floor).
TORCH_FLOORS: dict[str, tuple[str, str]] = {"fla-core": ("0.6.0", "2.7.0")}
_CUDA_RUNTIME = re.compile(r"^nvidia-cuda-runtime(?:-cu\d+)?$")


def _driver_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def _cuda_tuple(text: str) -> Cuda:
    major, minor = (int(p) for p in text.split(".")[:2])
    return major, minor


def _cuda_text(cuda: Cuda) -> str:
    return f"{cuda[0]}.{cuda[1]}"


@dataclass(frozen=True)
class TorchBuild:
    """A torch build: its version, the CUDA it is built for (None: a CPU build; `cuda_known` False when
    nothing said) and where that was read."""

    version: str
    cuda: Cuda | None
    source: str
    cuda_known: bool = True

    @property
    def label(self) -> str:
        return f"torch {self.version}"

    @property
    def archs(self) -> str | None:
        return WHEEL_ARCHS.get(self.cuda) if self.cuda else None


def cuda_of(version: str, requires: list[str] | None = None) -> tuple[Cuda | None, bool]:
    """The CUDA a torch build is for: its local version (`+cu128`, `+cpu`), else the CUDA runtime it
    requires (`nvidia-cuda-runtime-cu12==12.8.90`); (None, False) when neither says."""
    local = version.partition("+")[2]
    if local == "cpu" or local.startswith("rocm"):
        return None, True
    tag = re.fullmatch(r"cu(\d+)(\d)", local)
    if tag:
        return (int(tag.group(1)), int(tag.group(2))), True
    for line in requires or ():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        pinned = re.match(r"==\s*(\d+)\.(\d+)", str(req.specifier))
        if _CUDA_RUNTIME.match(req.name) and pinned:
            return (int(pinned.group(1)), int(pinned.group(2))), True
    return None, False


def from_pin(pin: Any, where: str) -> TorchBuild:
    """runtime.torch's {version, cuda}."""
    return TorchBuild(version=pin.build, cuda=_cuda_tuple(pin.cuda), source=f"runtime.torch ({where})")


def from_report(report: dict[str, Any], where: str) -> TorchBuild | None:
    """The torch in pip's `install --dry-run --report` (its metadata: version and requirements)."""
    for item in report.get("install") or ():
        meta = item.get("metadata") or {}
        if str(meta.get("name", "")).lower() == "torch":
            cuda, known = cuda_of(meta.get("version", ""), meta.get("requires_dist"))
            return TorchBuild(version=meta.get("version", "?"), cuda=cuda, source=where, cuda_known=known)
    return None


def from_wheelhouse(folder: str, requirement: str) -> TorchBuild | None:
    """The newest torch wheel in a local wheelhouse that the requirement allows (what pip --no-index
    would take there, for this machine's tags aside): its name's version, else its METADATA's requirements."""
    spec = Requirement(requirement).specifier
    wheels = []
    for path in Path(folder).glob("torch-*.whl"):
        try:
            name, version, _, _ = parse_wheel_filename(path.name)
        except (InvalidWheelFilename, InvalidVersion):
            continue
        if name == "torch" and spec.contains(version, prereleases=True):
            wheels.append((version, path))
    if not wheels:
        return None
    version, path = max(wheels)
    cuda, known = cuda_of(str(version))
    if not known:
        cuda, known = cuda_of(str(version), _wheel_requires(path))
    return TorchBuild(version=str(version), cuda=cuda, source=f"wheelhouse file {path.name}", cuda_known=known)


def _wheel_requires(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as wheel:
            meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
            text = wheel.read(meta).decode(errors="replace")
    except (OSError, zipfile.BadZipFile, StopIteration):
        return []
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def from_installed(installed: dict[str, Any] | None, venv: str) -> TorchBuild | None:
    """The torch a venv holds, from its torch/version.py (`__version__`, and `cuda`: None in a CPU build)."""
    if not installed or not installed.get("version"):
        return None
    cuda = _cuda_tuple(installed["cuda"]) if installed.get("cuda") else None
    return TorchBuild(version=installed["version"], cuda=cuda, source=f"installed in {venv}")


# -- the checks ----------------------------------------------------------------------------------------

def covers(archs: str, capability: float) -> bool:
    """Whether a wheel's arch list runs on a GPU of this compute capability (same-major binaries, or PTX)."""
    major, minor = divmod(round(capability * 10), 10)
    for arch in archs.split(";"):
        base, ptx = arch.removesuffix("+PTX"), arch.endswith("+PTX")
        a_major, a_minor = (int(p) for p in base.split("."))
        if (a_major == major and a_minor <= minor) or (ptx and (a_major, a_minor) <= (major, minor)):
            return True
    return False


def driver_ok(driver: str, cuda: Cuda) -> bool | None:
    need = MIN_DRIVER.get(cuda)
    return None if need is None else _driver_tuple(driver) >= _driver_tuple(need)


def suggestion(capabilities: list[float], driver: str | None) -> str:
    """The torch and CUDA to pin for these GPUs and this driver, or the driver to install."""
    fitting = [c for c in sorted(WHEEL_ARCHS) if all(covers(WHEEL_ARCHS[c], cap) for cap in capabilities)]
    runnable = [c for c in fitting if driver is None or driver_ok(driver, c)]
    if runnable:
        best = runnable[-1]
        return (f"pin `runtime.torch: {{version: \"{FIRST_TORCH[best]}\" or newer, cuda: \"{_cuda_text(best)}\"}}` "
                f"(its index: https://download.pytorch.org/whl/cu{best[0]}{best[1]})")
    if fitting:
        first = fitting[0]
        return (f"upgrade the driver to {MIN_DRIVER[first]} or newer and pin `runtime.torch: "
                f"{{version: \"{FIRST_TORCH[first]}\", cuda: \"{_cuda_text(first)}\"}}`")
    return "no PyTorch wheel in ddops's table is built for these GPUs: build torch for them"


def check_build(build: TorchBuild, host: str, driver: str | None, gpus: list[tuple[int, str | None, float | None]],
                driver_cuda: str | None = None) -> list[str]:
    """Problems of running `build` on these GPUs ((index, name, compute capability)) under this driver (its
    version, and the highest CUDA it supports, which decides where MIN_DRIVER has no row)."""
    problems: list[str] = []
    caps = [cap for _, _, cap in gpus if cap is not None]
    where = f"{build.label} ({build.source})"
    if not build.cuda_known:
        return []
    if build.cuda is None:
        return [f"{where} is a CPU build, and the profile runs on {host}'s GPU(s): {suggestion(caps, driver)}"]
    if driver is not None and driver_ok(driver, build.cuda) is False:
        need = MIN_DRIVER[build.cuda]
        problems.append(f"{where} needs CUDA {_cuda_text(build.cuda)}, which needs NVIDIA driver {need} or newer, "
                        f"and {host} has driver {driver}: upgrade the driver to {need}+, or "
                        + suggestion(caps, driver))
    elif (driver is None or build.cuda not in MIN_DRIVER) and driver_cuda and _cuda_tuple(driver_cuda) < build.cuda:
        problems.append(f"{where} needs CUDA {_cuda_text(build.cuda)}, and {host}'s driver"
                        f"{' ' + driver if driver else ''} supports CUDA {driver_cuda} at most: upgrade the driver, or "
                        + suggestion(caps, driver))
    archs = build.archs
    if archs is not None:
        missing = [f"GPU {i} ({name}, sm_{round(cap * 10)})" for i, name, cap in gpus
                   if cap is not None and not covers(archs, cap)]
        if missing:
            problems.append(f"{where} has kernels for sm {archs.replace('.', '')} only, not {host}'s "
                            f"{', '.join(missing)}: {suggestion(caps, driver)}")
    return problems


def check_companions(build: TorchBuild, packages: dict[str, str]) -> list[str]:
    """Problems of installing `packages` (import name -> pip requirement) beside `build`: a library of
    TORCH_FLOORS whose requirement allows a version that needs a newer torch than the build."""
    problems: list[str] = []
    try:
        torch_version = Version(build.version.partition("+")[0])
    except InvalidVersion:
        return []
    for line in packages.values():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        floor = TORCH_FLOORS.get(req.name.lower())
        if floor is None or torch_version >= Version(floor[1]):
            continue
        since, torch_floor = floor
        pinned = [Version(s.version) for s in req.specifier if s.operator in ("==", "===")
                  and not s.version.endswith("*")]
        if (pinned and pinned[0] >= Version(since)) or (not pinned and req.specifier.contains(since)):
            problems.append(f"{req} needs torch {torch_floor} or newer (its own cuda extra, which pip skips "
                            f"here), and {build.label} ({build.source}) would run: pin torch>={torch_floor}, or "
                            f"an older {req.name}")
    return problems


def check_dtype(dtype: str, host: str, gpus: list[tuple[int, str | None, float | None]]) -> list[str]:
    """bfloat16 needs Ampere's tensor cores (compute capability 8.0); older GPUs have no bf16 GEMM."""
    short = [f"GPU {i} ({name}, compute capability {cap})" for i, name, cap in gpus
             if cap is not None and cap < BF16_MIN_CAPABILITY]
    if dtype != "bfloat16" or not short:
        return []
    return [f"dtype bfloat16 needs compute capability {BF16_MIN_CAPABILITY} or more (Ampere and later), and "
            f"{host}'s {', '.join(short)} has less: set `dtype: float16`, or deploy to newer GPUs"]
