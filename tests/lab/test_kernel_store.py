"""The kernel store on the real lab: ct200's deploy keeps the Triton cache it has and harvests it into the
store for its GPU model; eval-a6000, as itself (another GPU model, no store of its own), starts its first
deploy with the runtime's compile record from that store and nothing else; made to imitate ct200's GPU
model, it starts with the whole cache seeded (root's, as the unit needs it).

The lab's runtime runs on the CPU and compiles no Triton kernel, so ct200's cache is written the way a GPU
warm-up leaves it (a folder per kernel hash: its binary, metadata, group file, an autotune result).
eval-a6000 gets ct200's runtime venv copied in (the lab's hosts are overlay mounts here), which saves the
~70 s pip would take to fill it: what is tested is the cache, not the install.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml
from test_pivot import PROFILE, pivot, pivot_lab, step  # noqa: F401 (pivot_lab: ct200 training, no unit)

from ddops import kernels
from ddops.lab.paths import host_dir

pytestmark = [pytest.mark.lab, pytest.mark.slow]

CACHE = "/var/cache/ddtree/triton"
SERVER = "NVIDIA RTX PRO 6000 Blackwell Server Edition"   # ct200's imitated GPUs
A6000 = "NVIDIA RTX A6000"                                # eval-a6000's
ENTRIES = {   # what a GPU warm-up leaves in the cache: (path, bytes)
    "Q2ZDVLYXK4JBWFPN/fused_recurrent_gated_delta_rule_fwd_kernel.cubin": 48_312,
    "Q2ZDVLYXK4JBWFPN/fused_recurrent_gated_delta_rule_fwd_kernel.json": 1_204,
    "Q2ZDVLYXK4JBWFPN/__grp__fused_recurrent_gated_delta_rule_fwd_kernel.json": 388,
    "7TNRKD3MFQ5XH2AZ/chunk_fwd_kernel_o.autotune.json": 2_210,
    kernels.RECORD: 48_867,   # the runtime's record of what its warm-up compiled
}
EVAL_RESET = ("systemctl disable --now ddtree.service; rm -rf /etc/systemd/system/ddtree.service /etc/ddops/ddtree.env "
              f"/var/lib/ddops/backups/ddtree.service /var/lib/ddops/pivot.lock /opt/ddtree /var/cache/ddtree "
              "/root/models/kc-target /root/models/kc-draft; systemctl daemon-reload; systemctl reset-failed")


def eval_profile(tmp_path) -> str:
    """lab-ddtree16 on eval-a6000 (its own port: the lab's hosts share one network), models from here."""
    doc = yaml.safe_load(PROFILE.read_text())
    doc.update(host="eval-a6000", port=8210)
    doc["models"] = {role: {"path": f"/root/models/kc-{role}",
                            "from": {"host": "local", "path": f"${{DDOPS_CACHE}}/tiny-models-seed0/{role}"}}
                     for role in ("target", "draft")}
    doc["smoke"].update(prompts=doc["smoke"]["prompts"][:1], lossless_check=False)
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def as_server(lab, tmp_path) -> str:
    """An inventory in which eval-a6000 is expected to have ct200's GPUs."""
    doc = yaml.safe_load(lab.inventory_path.read_text())
    doc["hosts"]["eval-a6000"]["expect"]["gpu_model"] = "RTX PRO 6000 Blackwell"
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def imitate(lab, model: str) -> None:
    """eval-a6000's imitation nvidia-smi names its GPUs `model`."""
    done = lab.ssh("eval-a6000", ["python3", "-m", "ddops_lab_gpu", "set", f"model={json.dumps(model)}"])
    assert done.returncode == 0, done.stderr


def listing(lab, host: str) -> str:
    """The cache's files with size, owner and mode, as the unit sees them."""
    return lab.ssh(host, f"cd {CACHE} && find . -type f -printf '%P %s %u:%g %m\\n' | sort").stdout


@pytest.fixture
def kernel_lab(pivot_lab):
    """No store for the lab's GPU models; ct200's cache as a GPU warm-up leaves it; eval-a6000 as lab up made it."""
    def clean() -> None:
        for model in (SERVER, A6000):
            shutil.rmtree(kernels.store_dir(model), ignore_errors=True)
        pivot_lab.ssh("ct200", f"rm -rf {CACHE}")
        pivot_lab.ssh("eval-a6000", EVAL_RESET, timeout=120)
        imitate(pivot_lab, A6000)

    clean()
    history = pivot_lab.ssh("eval-a6000", "cat /var/lib/ddops/history.jsonl 2>/dev/null").stdout
    writes = "; ".join(f"mkdir -p {CACHE}/$(dirname {p}) && head -c {n} /dev/urandom > {CACHE}/{p}"
                       for p, n in ENTRIES.items())
    assert pivot_lab.ssh("ct200", writes).returncode == 0
    yield pivot_lab
    clean()
    if history:
        pivot_lab.ssh("eval-a6000", ["bash", "-c", "cat > /var/lib/ddops/history.jsonl"], input=history)
    else:
        pivot_lab.ssh("eval-a6000", "rm -f /var/lib/ddops/history.jsonl")


def test_a_host_of_the_same_gpu_model_starts_with_the_harvested_cache(kernel_lab, tmp_path):
    lab = kernel_lab
    mine = listing(lab, "ct200")
    size = kernels.mib(sum(ENTRIES.values()))
    done, report = pivot(lab)   # ct200: its own cache kept, then harvested
    assert done.returncode == 0 and report["outcome"] == "ok", report
    assert report["kernel_cache"]["line"] == f"kept (host has its own); harvested (5 files, {size})"
    assert step(report, "kernels")["status"] == "skipped" and listing(lab, "ct200") == mine
    store = kernels.read_store(SERVER)
    assert (store.host, store.files, store.bytes) == ("ct200", 5, sum(ENTRIES.values()))

    # eval-a6000 as itself: another GPU model with no store, so ct200's compile record alone (the
    # runtime compiles those kernels at once for its own GPU); with ct200's runtime venv, as pip would fill it
    profile = eval_profile(tmp_path)
    roots = {h: host_dir(h).root for h in ("ct200", "eval-a6000")}

    def copy_venv() -> None:
        (roots["eval-a6000"] / "opt/ddtree").mkdir(parents=True)
        subprocess.run(["cp", "-a", str(roots["ct200"] / "opt/ddtree/venv"), str(roots["eval-a6000"] / "opt/ddtree/")],
                       check=True, timeout=300)

    copy_venv()
    done, report = pivot(lab, profile=profile)
    assert done.returncode == 0 and report["outcome"] == "ok", report
    record = ENTRIES[kernels.RECORD]
    assert report["kernel_cache"]["line"] == (
        f"seeded with the compile record of {SERVER} (harvested from ct200 at {store.harvested_at}): the first "
        f"warm-up compiles those kernels at once; harvested (1 files, {kernels.mib(record)})")
    assert listing(lab, "eval-a6000") == f"{kernels.RECORD} {record} root:root 644\n"
    assert lab.ssh("eval-a6000", "systemctl is-active ddtree.service").stdout.strip() == "active"

    lab.ssh("eval-a6000", EVAL_RESET, timeout=120)   # a fresh host again, now of ct200's model
    imitate(lab, SERVER)
    copy_venv()
    done, report = pivot(lab, profile=profile, inventory=as_server(lab, tmp_path))
    assert done.returncode == 0 and report["outcome"] == "ok", report
    cache = report["kernel_cache"]
    assert cache["line"] == (f"seeded from store (5 files, {size}, harvested from ct200 at {store.harvested_at}); "
                             f"harvested (5 files, {size})")
    assert step(report, "kernels")["status"] == "done" and step(report, "deps")["status"] == "skipped"
    seeded = listing(lab, "eval-a6000")
    assert seeded == "".join(f"{p} {n} root:root 644\n" for p, n in sorted(ENTRIES.items()))
    assert seeded.replace("root:root 644", "") == mine.replace("root:root 644", "")
    assert lab.ssh("eval-a6000", "systemctl is-active ddtree.service").stdout.strip() == "active"
