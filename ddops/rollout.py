"""Host by host: a profile whose `host` names an inventory group is pivoted on each of its hosts in
turn, and the rollout halts at the first host whose pivot does not succeed; the hosts before it keep
what they got (healthy: their gates passed), the ones after it are not touched.

Within a host, `--batch` replicas are replaced at once (ddops.steps.roll); hosts always go one at a
time, so no more than one host's batch is out of service at any moment.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rich.console import Console

from .executor import Executor
from .inventory import Inventory
from .pivot import Pivot
from .profile import Profile
from .report import SUCCESS


def serving_hosts(profile: Profile, inventory: Inventory) -> list[str]:
    """The host the profile names, or each host of the group it names, in the group's order."""
    return list(inventory.groups.get(profile.host, [profile.host]))


def rollout(profile: Profile, inventory: Inventory, executor: Executor, console: Console,
            **pivot_args: Any) -> dict[str, Any]:
    """Pivot each serving host in turn; one host gives its own report unchanged, several a report of
    reports (`hosts`), with the outcome of the host that halted the rollout, or of the last one."""
    names = serving_hosts(profile, inventory)
    if len(names) == 1 and names[0] == profile.host:
        return Pivot(profile, inventory, executor, console, **pivot_args).execute().as_json()
    reports: list[dict[str, Any]] = []
    for number, name in enumerate(names, 1):
        console.print(f"[bold blue]==>[/] host {number}/{len(names)}: {name} ({profile.name})")
        report = Pivot(replace(profile, host=name), inventory, executor, console, **pivot_args).execute().as_json()
        reports.append(report)
        if report["outcome"] not in SUCCESS:
            break
    last = reports[-1]
    halted = last["outcome"] not in SUCCESS
    not_reached = names[len(reports):]
    done = [r["host"] for r in reports[:-1]] if halted else [r["host"] for r in reports]
    state = (f"halted at {last['host']} ({last['outcome']}: {last['state']})"
             + (f"; done before it: {', '.join(done)}" if done else "")
             + (f"; not reached: {', '.join(not_reached)}" if not_reached else "")) if halted else (
        f"{len(reports)} host(s) one at a time: " + "; ".join(f"{r['host']} {r['outcome']}" for r in reports))
    return {"profile": profile.name, "group": profile.host, "hosts": names, "outcome": last["outcome"],
            "state": state, "halted_at": last["host"] if halted else None, "not_reached": not_reached,
            "reports": reports, "error": last.get("error"), "exit_code": last["exit_code"],
            "wall_s": round(sum(r["wall_s"] for r in reports), 2)}
