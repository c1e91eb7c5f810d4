"""Tensor parallelism's ddops side on the real lab (issue 27), as dry runs: llm-two-ddtree16 with the tiny
hybrid pair in place of Qwen3.6-27B plans llm-two's unit over both of its GPUs in sglang-qwen's place,
through the real probes, systemd and the shipped runtime's own --help; more ranks than GPUs and a size
that does not divide the target's heads are refused at preflight. Only dry runs: the lab's runtime is
CPU-only, and serving over two ranks is the runtime's part of the issue."""

from __future__ import annotations

import json

import pytest
import yaml
from test_pivot import REPO, ddops

pytestmark = pytest.mark.lab

SNAPSHOT = r"""
for p in /etc/systemd/system /etc/ddops /var/lib/ddops /root/models; do
  [ -e "$p" ] && find "$p" -type f -o -type l | sort | xargs -r sha256sum
done
systemctl show sglang-qwen.service -p ActiveState -p MainPID
"""


def tiny_llm_two(tmp_path, size: int) -> str:
    """llm-two-ddtree16 over the tiny hybrid pair (2 KV heads), at tensor_parallel `size` on GPUs 0 to size-1."""
    doc = yaml.safe_load((REPO / "playbooks" / "llm-two-ddtree16.yaml").read_text())
    doc["models"] = {role: {"path": f"/root/models/tiny-hybrid-{role}",
                            "from": {"host": "local", "path": f"${{DDOPS_CACHE}}/tiny-hybrid-seed0/{role}"}}
                     for role in ("target", "draft")}
    doc["gpus"], doc["serve"]["tensor_parallel"] = list(range(size)), size
    # a CUDA build, as on the fleet: the lab's own torch (/opt/wheels) is a CPU build, which preflight refuses
    # for a profile on the GPU (issue 37)
    del doc["runtime"]["packages"]["torch"]
    doc["runtime"]["torch"] = {"version": "2.7.1", "cuda": "12.8"}
    doc["serve"]["served_model_name"] = "tiny-hybrid"
    del doc["serve"]["max_context"]   # the tiny target's own positions
    path = tmp_path / f"tp{size}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def test_two_ranks_on_llm_twos_two_gpus_plan_in_sglang_qwens_place(lab, tiny_hybrid_models, tmp_path):
    before = lab.ssh("llm-two", SNAPSHOT).stdout
    done = ddops(lab, "pivot", "--deploy", tiny_llm_two(tmp_path, 2), "--dry-run")
    out = " ".join(done.stdout.split())   # the plan's table wraps its cells
    assert done.returncode == 0 and "DRY-RUN: nothing was changed" in out, done.stdout + done.stderr
    assert "ExecStart=/opt/ddtree/venv/bin/ddtree-serve " in out and " --tensor-parallel 2 " in out
    assert "+CUDA_VISIBLE_DEVICES=0,1 " in out and "stop conflicting sglang-qwen.service" in out
    assert "one of the 2 tensor-parallel GPUs of a server" in out
    assert "torch 2.7.1+cu128 (runtime.torch (" in out and "fits the driver and GPUs" in out
    assert lab.ssh("llm-two", SNAPSHOT).stdout == before


def test_four_ranks_are_refused_for_the_gpus_and_the_heads(lab, tiny_hybrid_models, tmp_path):
    before = lab.ssh("llm-two", SNAPSHOT).stdout
    done = ddops(lab, "pivot", "--deploy", tiny_llm_two(tmp_path, 4), "--dry-run", "--json")
    report, _ = json.JSONDecoder().raw_decode(done.stdout)
    assert (done.returncode, report["failed_step"]) == (2, "preflight"), report
    error = report["error"]
    assert "llm-two has 2 GPU(s), and one server needs 4 (serve.tensor_parallel 4): ddtree.service on GPU 0,1,2,3" in error
    assert "'s KV heads (2) and linear-attention key heads (2): each rank takes an equal share" in error
    assert "\n" not in error and lab.ssh("llm-two", SNAPSHOT).stdout == before
