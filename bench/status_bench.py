"""Benchmark `ddops status` over 1, 8 and 64 lab hosts beside Ansible's fact gathering over the same hosts.

Each run is a fresh process, timed on the wall and in control-side CPU (user + system of it and every
process it waited for: ssh, Ansible's forks; the lab hosts' own CPU is not ours). ddops runs as a user
runs it (`ddops -i INVENTORY --limit HOSTS status --json`); Ansible as `ansible all -m setup -a
gather_subset=min -f N` against an inventory written here with the lab hosts' ports, key and known_hosts
(interpreter given, so no discovery round trip; SSH connection sharing off, as ddops's runs share
nothing either). Ansible comes from PATH, else from a throwaway venv made here (`pip install ansible-core`).

Needs a lab with 64 hosts besides its own: `ddops lab up --extra 64` (then `ddops lab up` to shrink it).
Only lab hosts on 127.0.0.1 are contacted. Prints a table and writes JSON.

    python bench/status_bench.py [--sizes 1,8,64] [--ansible-sizes 8,64] [--repeat 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ddops.inventory import Host, load_inventory
from ddops.lab.paths import lab_dir


@dataclass(frozen=True)
class Run:
    wall_s: float
    cpu_s: float


def timed(argv: list[str], env: dict[str, str], timeout: float) -> tuple[Run, subprocess.CompletedProcess]:
    """Run argv to its end; its wall time and the CPU it and everything it waited for used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(wall, cpu), done


def ddops_status(inventory: Path, hosts: list[Host]) -> Run:
    argv = [sys.executable, "-m", "ddops", "-i", str(inventory), "--limit", ",".join(h.name for h in hosts),
            "status", "--json"]
    run, done = timed(argv, dict(os.environ), timeout=600)
    try:
        records = json.loads(done.stdout)
    except ValueError:
        sys.exit(f"ddops status failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    bad = [r["host"] for r in records if not r["reachable"] or r["error"]]
    if bad or len(records) != len(hosts):
        sys.exit(f"ddops status failed on {bad or 'some hosts'}: {done.stderr.strip()[-500:]}")
    return run


def ansible_inventory(hosts: list[Host], path: Path) -> Path:
    lines = ["[lab]"] + [
        f"{h.name} ansible_host={h.address} ansible_port={h.port} ansible_user={h.user} "
        f"ansible_ssh_private_key_file={h.key} ansible_python_interpreter=/usr/bin/python3" for h in hosts]
    path.write_text("\n".join(lines) + "\n")
    return path


def ansible_setup(ansible: Path, hosts: list[Host], workdir: Path) -> Run:
    inventory = ansible_inventory(hosts, workdir / f"hosts-{len(hosts)}.ini")
    env = {**os.environ, "ANSIBLE_HOST_KEY_CHECKING": "True", "ANSIBLE_LOCAL_TEMP": str(workdir),
           "ANSIBLE_SSH_ARGS": f"-o UserKnownHostsFile={hosts[0].known_hosts} -o ControlMaster=no"}
    argv = [str(ansible), "all", "-i", str(inventory), "-f", str(len(hosts)), "-m", "setup",
            "-a", "gather_subset=min"]
    run, done = timed(argv, env, timeout=900)
    answered = done.stdout.count(" | SUCCESS =>")
    if done.returncode != 0 or answered != len(hosts):
        sys.exit(f"ansible failed (exit {done.returncode}, {answered}/{len(hosts)} hosts):\n"
                 f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return run


def find_ansible(workdir: Path) -> tuple[Path, str]:
    """`ansible` from PATH, else one installed into a throwaway venv under workdir; and its version."""
    found = shutil.which("ansible")
    if found is None:
        venv = workdir / "ansible-venv"
        print(f"ansible not on PATH: installing ansible-core into a throwaway venv ({venv})", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "ansible-core"], check=True)
        found = str(venv / "bin" / "ansible")
    version = subprocess.run([found, "--version"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    return Path(found), version


def summarize(runs: list[Run]) -> dict:
    return {"median_wall_s": statistics.median(r.wall_s for r in runs),
            "median_cpu_s": statistics.median(r.cpu_s for r in runs),
            "runs": [{"wall_s": round(r.wall_s, 3), "cpu_s": round(r.cpu_s, 3)} for r in runs]}


def sizes(text: str) -> list[int]:
    return sorted({int(part) for part in text.split(",") if part.strip()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inventory", type=Path, default=lab_dir() / "inventory.yaml",
                        help="the inventory `ddops lab up --extra N` wrote")
    parser.add_argument("--sizes", type=sizes, default=[1, 8, 64], help="host counts for ddops status")
    parser.add_argument("--ansible-sizes", type=sizes, default=[8, 64], help="host counts for ansible (none: '')")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/status-64.json"))
    args = parser.parse_args()

    inventory = load_inventory(args.inventory)
    # the --extra hosts first: all alike (eval-style, 2 imitation GPUs), and all reached directly
    extra = set(inventory.groups.get("extra", []))
    direct = sorted((h for h in inventory.hosts.values() if h.via is None and h.pct is None),
                    key=lambda h: (h.name not in extra, h.port))
    largest = max(args.sizes + args.ansible_sizes)
    if len(direct) < largest:
        sys.exit(f"need {largest} directly reachable lab hosts, {args.inventory} has {len(direct)}: "
                 f"run `ddops lab up --extra {largest}`")

    results: dict[str, dict] = {}
    for n in args.sizes:
        runs = [ddops_status(args.inventory, direct[:n]) for _ in range(args.repeat)]
        results[f"ddops status x{n}"] = {"hosts": n, **summarize(runs)}
        print(f"ddops status over {n} hosts: {results[f'ddops status x{n}']['median_wall_s']:.2f} s", flush=True)
    ansible_version = None
    if args.ansible_sizes:
        with tempfile.TemporaryDirectory(prefix="status-bench-") as tmp:
            ansible, ansible_version = find_ansible(Path(tmp))
            for n in args.ansible_sizes:
                runs = [ansible_setup(ansible, direct[:n], Path(tmp)) for _ in range(args.repeat)]
                results[f"ansible setup min x{n} (forks {n})"] = {"hosts": n, **summarize(runs)}
                print(f"ansible -m setup over {n} hosts: "
                      f"{results[f'ansible setup min x{n} (forks {n})']['median_wall_s']:.2f} s", flush=True)

    print(f"\n{'measurement':34} {'hosts':>5} {'wall s':>8} {'cpu s':>8}   (median of {args.repeat})")
    for label, r in results.items():
        print(f"{label:34} {r['hosts']:>5} {r['median_wall_s']:>8.2f} {r['median_cpu_s']:>8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cores": os.cpu_count(), "repeat": args.repeat, "ansible": ansible_version,
                                    "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
