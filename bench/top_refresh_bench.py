"""What one `ddops top` refresh costs on the control side, over 8 lab hosts.

A refresh is one facts probe per host (with each runtime's /metrics read in the same round trip), all
hosts at once, over SSH connections kept open between refreshes as `ddops top` keeps them. Prints the
first (connecting) refresh, then the wall time, control-side CPU time and per-host round trip of the
warm ones, and writes JSON (default bench/results/top-refresh.json).

Needs the lab with 8 hosts: `ddops lab up --extra 4` (its inventory: /var/lib/ddops/lab/inventory.yaml).

    python3 bench/top_refresh_bench.py [--refreshes 20] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from ddops.executor import Executor
from ddops.inventory import load_inventory
from ddops.top import sample_host

LAB_INVENTORY = Path("/var/lib/ddops/lab/inventory.yaml")


def refresh(executor: Executor, hosts) -> tuple[float, float, dict[str, float | None]]:
    """(wall s, control CPU s, each host's round trip s) of one refresh over every host."""
    wall, cpu = time.perf_counter(), time.process_time()
    outcomes = executor.fan_out(hosts, lambda h: sample_host(executor, h, {}, timeout=30))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    failed = [name for name, o in outcomes.items() if o.error or o.value.facts is None]
    if failed:
        sys.exit(f"no answer from {failed}: is the lab up with --extra 4?")
    return wall, cpu, {name: o.value.probe_s for name, o in outcomes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refreshes", type=int, default=20)
    parser.add_argument("--inventory", type=Path, default=LAB_INVENTORY)
    parser.add_argument("--out", type=Path, default=Path("bench/results/top-refresh.json"))
    args = parser.parse_args()
    inventory = load_inventory(args.inventory)
    hosts = inventory.select(None)
    if len(hosts) < 8:
        sys.exit(f"{len(hosts)} host(s) in {args.inventory}: `ddops lab up --extra 4` makes 8")
    hosts = hosts[:8]
    with Executor(inventory) as executor:
        first_wall, first_cpu, _ = refresh(executor, hosts)
        walls, cpus, trips = [], [], {h.name: [] for h in hosts}
        for _ in range(args.refreshes):
            wall, cpu, each = refresh(executor, hosts)
            walls.append(wall)
            cpus.append(cpu)
            for name, seconds in each.items():
                trips[name].append(seconds)
            time.sleep(0.5)
    result = {
        "hosts": [h.name for h in hosts], "refreshes": args.refreshes,
        "first_refresh_s": round(first_wall, 3), "first_refresh_cpu_s": round(first_cpu, 3),
        "wall_s": {"median": round(statistics.median(walls), 3), "max": round(max(walls), 3)},
        "control_cpu_s": {"median": round(statistics.median(cpus), 3), "max": round(max(cpus), 3)},
        "round_trip_s_median": {name: round(statistics.median(t), 3) for name, t in trips.items()},
    }
    print(f"{len(hosts)} hosts, {args.refreshes} warm refreshes: wall median {result['wall_s']['median']}s "
          f"(max {result['wall_s']['max']}s), control CPU median {result['control_cpu_s']['median']}s; "
          f"first (connecting) refresh {result['first_refresh_s']}s")
    for name, seconds in result["round_trip_s_median"].items():
        print(f"  {name:<12} round trip median {seconds}s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
