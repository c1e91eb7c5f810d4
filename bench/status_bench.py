"""Benchmark `ddops status` over 1, 4 and 8 lab hosts (parallel and serial) against ansible's bare `hostname`.

Needs a lab with at least 8 directly reachable hosts: `ddops lab up --extra 5`. Prints a table and
writes JSON (default bench/results/status.json). Only lab hosts on 127.0.0.1 are contacted.

    python3 bench/status_bench.py [--repeat 5] [--out PATH] [--no-ansible]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddops.executor import Executor
from ddops.inventory import Host, load_inventory
from ddops.status import collect


def timed_status(inventory, hosts: list[Host], parallel: int) -> float:
    started = time.perf_counter()
    with Executor(inventory, max_parallel=parallel) as executor:
        records = collect(executor, hosts)
    elapsed = time.perf_counter() - started
    bad = [r["host"] for r in records if not r["reachable"] or r["error"]]
    if bad:
        sys.exit(f"status failed on {bad}: is the lab up with --extra 5?")
    return elapsed


def ansible_hostname(hosts: list[Host], workdir: Path) -> float | None:
    ansible = shutil.which("ansible")
    if ansible is None:
        print("ansible not found: pip install ansible-core (skipping the comparison)")
        return None
    lines = ["[lab]"]
    for h in hosts:
        lines.append(f"{h.name} ansible_host={h.address} ansible_port={h.port} ansible_user={h.user} "
                     f"ansible_ssh_private_key_file={h.key} ansible_python_interpreter=/usr/bin/python3")
    inventory = workdir / "hosts.ini"
    inventory.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "ANSIBLE_HOST_KEY_CHECKING": "True",
           "ANSIBLE_SSH_ARGS": f"-o UserKnownHostsFile={hosts[0].known_hosts} -o ControlMaster=no",
           "ANSIBLE_GATHERING": "explicit", "ANSIBLE_LOCAL_TEMP": str(workdir)}
    started = time.perf_counter()
    done = subprocess.run([ansible, "all", "-i", str(inventory), "-f", "8", "-m", "shell", "-a", "hostname"],
                          capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"ansible failed:\n{done.stdout}\n{done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inventory", default=str(Path(os.environ.get("DDOPS_LAB_DIR", "/var/lib/ddops/lab"))
                                                   / "inventory.yaml"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="bench/results/status.json")
    parser.add_argument("--no-ansible", action="store_true")
    args = parser.parse_args()

    inventory = load_inventory(args.inventory)
    direct = [h for h in inventory.hosts.values() if h.via is None and h.pct is None]
    if len(direct) < 8:
        sys.exit(f"need 8 directly reachable lab hosts, found {len(direct)}: run `ddops lab up --extra 5`")
    eight = direct[:8]
    results: dict[str, dict] = {}
    for label, hosts, parallel in (("status x1", eight[:1], 16), ("status x4 parallel", eight[:4], 16),
                                   ("status x8 parallel", eight, 16), ("status x8 serial", eight, 1)):
        runs = [timed_status(inventory, hosts, parallel) for _ in range(args.repeat)]
        results[label] = {"hosts": len(hosts), "median_s": statistics.median(runs), "runs_s": runs}
    if not args.no_ansible:
        with tempfile.TemporaryDirectory() as tmp:
            runs = [t for t in (ansible_hostname(eight, Path(tmp)) for _ in range(args.repeat)) if t is not None]
        if runs:
            results["ansible hostname x8 (forks 8)"] = {"hosts": 8, "median_s": statistics.median(runs),
                                                        "runs_s": runs}
    one = results["status x1"]["median_s"]
    eight_parallel = results["status x8 parallel"]["median_s"]
    summary = {"x8_over_x1": eight_parallel / one}
    if "ansible hostname x8 (forks 8)" in results:
        summary["x8_over_ansible"] = eight_parallel / results["ansible hostname x8 (forks 8)"]["median_s"]
    print(f"{'measurement':34} {'hosts':>5} {'median s':>9}")
    for label, r in results.items():
        print(f"{label:34} {r['hosts']:>5} {r['median_s']:>9.3f}")
    for key, value in summary.items():
        print(f"{key:34} {value:>15.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cores": os.cpu_count(), "repeat": args.repeat, "results": results,
                               "summary": summary}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
