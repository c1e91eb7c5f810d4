"""Facts: what a host is and runs, gathered in one SSH round trip, and its identity check."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import DdopsError
from .executor import Executor
from .inventory import Expect, Host
from .probes import probe_source


@dataclass
class Identity:
    """Whether a host is who the inventory says it is; a mismatch stops every change."""

    ok: bool
    hostname: str | None
    gpu_model: str | None
    gpu_count: int | None
    expected: dict[str, Any]
    mismatches: list[str] = field(default_factory=list)


def probe_args(host: Host) -> dict[str, Any]:
    training = asdict(host.training) if host.training else None
    return {"training": training, "services": [asdict(s) for s in host.services]}


def gather(executor: Executor, host: Host) -> dict[str, Any]:
    """Run the facts probe on host and return its parsed JSON."""
    result = executor.run(host, ["python3", "-I", "-S", "-c", probe_source("facts"), json.dumps(probe_args(host))])
    if not result.ok:
        detail = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise DdopsError(f"facts probe failed on {host.name} (exit {result.exit_code}): {detail}",
                         fix="the host needs python3 on its PATH")
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        raise DdopsError(f"facts probe on {host.name} printed something that is not JSON: "
                         f"{result.stdout[:120]!r}", fix="check the login shell prints nothing") from None


def check_identity(expect: Expect, facts: dict[str, Any]) -> Identity:
    """Compare observed hostname and GPUs with `expect`; every difference is named."""
    gpu_list = facts.get("gpus", {}).get("list", [])
    names = sorted({g["name"] for g in gpu_list})
    observed_model = " + ".join(names) if names else None
    identity = Identity(ok=True, hostname=facts.get("hostname"), gpu_model=observed_model,
                        gpu_count=len(gpu_list), expected={k: v for k, v in asdict(expect).items() if v is not None})
    gpu_error = facts.get("gpus", {}).get("error")
    if expect.hostname is not None and identity.hostname != expect.hostname:
        identity.mismatches.append(f"hostname is {identity.hostname!r}, expected {expect.hostname!r}")
    if expect.gpu_model is not None:
        wanted = expect.gpu_model.lower()
        wrong = [n for n in names if wanted not in n.lower()]
        if gpu_error:
            identity.mismatches.append(f"cannot read GPUs ({gpu_error}), expected {expect.gpu_model!r}")
        elif not names or wrong:
            identity.mismatches.append(f"GPU model is {observed_model or 'none'!r}, expected {expect.gpu_model!r}")
    if expect.gpu_count is not None and identity.gpu_count != expect.gpu_count:
        if not (gpu_error and expect.gpu_model is not None):  # already reported above
            identity.mismatches.append(f"GPU count is {identity.gpu_count}, expected {expect.gpu_count}")
    identity.ok = not identity.mismatches
    return identity
