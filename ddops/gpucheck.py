"""Preflight's GPU checks, before any change: the runtime's CUDA stack matched to the host (ddops.cudastack)
and the health of every GPU the profile would use (ddops.gpuhealth). Problems refuse the pivot; throttling,
a stranger's memory and faults on GPUs the profile does not use are warnings in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import cudastack, gpuhealth
from .cudastack import TorchBuild
from .facts import HostFacts, Inspection
from .profile import Profile


@dataclass(frozen=True)
class GpuCheck:
    """What preflight found about the GPUs: the torch checked, faults accepted, and the plan's warnings."""

    torch: str | None = None                                  # e.g. "torch 2.7.1+cu128 (runtime.torch (x.yaml:20))"
    installed_torch: str | None = None                        # the venv's torch version (the deps step's)
    accepted: tuple[str, ...] = ()                            # faults --accept-gpu-faults let through
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def note(self) -> str:
        """The preflight summary's tail."""
        parts = [f"{self.torch} fits the driver and GPUs"] if self.torch else []
        if self.accepted:
            parts.append(f"GPU faults accepted (--accept-gpu-faults): {'; '.join(self.accepted)}")
        if self.warnings:
            parts.append(f"GPU warnings: {'; '.join(self.warnings)}")
        return "; ".join(parts)


def used_gpus(profile: Profile, gpu_count: int) -> list[int]:
    """The GPUs the unit would run on: the profile's `gpus` (each replica's), else a cuda:N's N, else the
    first serve.tensor_parallel (SGLang: sglang.tp_size) of the host's; none on the CPU."""
    if profile.replicated and profile.replicas.gpus_each:
        return sorted({g for r in profile.replicas.members for g in r.gpus})
    if profile.gpus is not None:
        return [int(g) for g in profile.gpus.split(",")]
    if profile.engine == "sglang":
        return list(range(min(profile.sglang.tp_size, gpu_count)))
    if not profile.device.startswith("cuda"):
        return []
    _, _, n = profile.device.partition(":")
    return [int(n)] if n else list(range(min(profile.serve.tensor_parallel, gpu_count)))


def checks_stack(profile: Profile) -> bool:
    """The bundled runtime on a GPU: ddops installs its torch (SGLang's is the operator's own)."""
    return profile.engine == "ddtree" and profile.device.startswith("cuda")


def torch_probe_args(profile: Profile, inspected: dict[str, Any]) -> dict[str, Any] | None:
    """The torchwheel probe's arguments (None: nothing to ask): the torch the venv holds and, when the deps
    step would install one from the host's index with no pin to say which, what pip resolves it to."""
    if not checks_stack(profile):
        return None
    keeps = "torch" in Inspection.from_json(inspected).imports.ok   # unpinned, the deps step leaves it as it is
    runtime = profile.runtime
    resolve = None if keeps or runtime.torch is not None or not runtime.index else runtime.packages.get("torch")
    return {"venv": runtime.venv, "resolve": resolve, "keeps": keeps}


def torch_build(profile: Profile, found: dict[str, Any] | None, host: str) -> tuple[TorchBuild | None, str | None]:
    """The torch the pivot would run, and why it is unknown when it is."""
    runtime = profile.runtime
    if runtime.torch is not None:   # the deps step installs the pinned build over any other
        return cudastack.from_pin(runtime.torch, runtime.torch.where), None
    if found and found.get("keeps"):
        build = cudastack.from_installed(found.get("installed"), runtime.venv)
        return build, None if build else f"{runtime.venv} imports torch, but its torch/version.py was not found"
    requirement = runtime.packages.get("torch")
    if requirement is None:
        return None, "runtime.packages installs no torch"
    if not runtime.index:
        build = cudastack.from_wheelhouse(runtime.wheelhouse, requirement)
        return build, None if build else f"no wheel in {runtime.wheelhouse} matches {requirement}"
    report = (found or {}).get("resolved")
    build = cudastack.from_report(report, f"pip --dry-run on {host}") if report else None
    return build, None if build else ((found or {}).get("error") or f"pip on {host} did not resolve {requirement}")


def check_gpus(profile: Profile, host: HostFacts, found: dict[str, Any] | None,
               accept_faults: bool) -> tuple[list[str], GpuCheck]:
    """Refusals (the stack, what the GPUs cannot do, faults on the GPUs used) and what the plan shows."""
    problems: list[str] = []
    used = used_gpus(profile, host.gpu_count)
    on = [(g.index, g.name, g.compute_cap) for g in host.gpus if g.index in used]
    label = None
    warnings: list[str] = []
    if checks_stack(profile) and not host.gpu_error:
        build, unknown = torch_build(profile, found, profile.host)
        driver = gpuhealth.driver(host.raw)
        if build is not None:
            stack = cudastack.check_build(build, profile.host, driver["version"], on, driver["cuda"])
            stack += cudastack.check_companions(build, profile.runtime.packages)
            problems += stack
            label = None if stack or not build.cuda_known else f"{build.label} ({build.source})"
            if not build.cuda_known:
                unknown = f"{build.label} ({build.source}) names no CUDA version"
        if unknown:
            warnings.append(f"the torch to install is unknown ({unknown}): its CUDA was not matched to the driver")
        if driver["version"] is None and driver["cuda"] is None:
            warnings.append("the driver's version is unknown: the torch's CUDA was not matched to it")
    if profile.device.startswith("cuda"):
        problems += cudastack.check_dtype(profile.dtype, profile.host, on)
    units = [profile.unit, *profile.conflicts] + ([r.unit for r in profile.replicas.members] if profile.replicated
                                                  else [])
    faults: list[str] = []
    for health in gpuhealth.assess(host.raw, units):
        where = f"GPU {health.index}" + (f" ({health.bus_id})" if health.bus_id else "")
        if health.index in used:
            faults += [f"{where}: {f}" for f in health.faults]
            warnings += [f"{where}: {w}" for w in health.warnings]
        elif health.faults:
            warnings.append(f"{where}, which this profile does not use: {'; '.join(health.faults)}")
    warnings += gpuhealth.stray_xids(host.raw)
    if faults and not accept_faults:
        problems.append(f"{profile.host} has a faulty GPU the profile would use: {'; '.join(faults)}; drain and reset "
                        "it (or reboot the host), list healthy GPUs in `gpus`, or pass --accept-gpu-faults")
    installed = ((found or {}).get("installed") or {}).get("version")
    return problems, GpuCheck(torch=label, installed_torch=installed, accepted=tuple(faults) if accept_faults else (),
                              warnings=tuple(warnings))
