"""Identity check from facts fixtures: the A6000 eval box must never pass as the Pro6000 box."""

from __future__ import annotations

from ddops.facts import check_identity
from ddops.inventory import Expect

PRO6000 = Expect(hostname="llm-two", gpu_model="RTX PRO 6000 Blackwell", gpu_count=2)


def facts(hostname: str, names: list[str], error: str | None = None) -> dict:
    gpus = [{"index": i, "name": n, "memory_used_mib": 0, "memory_total_mib": 1} for i, n in enumerate(names)]
    return {"hostname": hostname, "gpus": {"error": error, "list": gpus}}


def test_matching_host_passes() -> None:
    ident = check_identity(PRO6000, facts("llm-two", ["NVIDIA RTX PRO 6000 Blackwell Workstation Edition"] * 2))
    assert ident.ok and ident.mismatches == [] and ident.gpu_count == 2


def test_a6000_box_never_passes_as_pro6000_even_with_the_right_hostname() -> None:
    ident = check_identity(PRO6000, facts("llm-two", ["NVIDIA RTX A6000"] * 2))
    assert not ident.ok
    assert ident.mismatches == ["GPU model is 'NVIDIA RTX A6000', expected 'RTX PRO 6000 Blackwell'"]


def test_every_difference_is_named() -> None:
    ident = check_identity(PRO6000, facts("eval-a6000", ["NVIDIA RTX A6000"] * 3))
    assert not ident.ok and len(ident.mismatches) == 3
    assert "hostname is 'eval-a6000'" in ident.mismatches[0]
    assert "GPU count is 3, expected 2" in ident.mismatches[2]


def test_mixed_gpus_fail_the_model_check() -> None:
    ident = check_identity(PRO6000, facts("llm-two", ["NVIDIA RTX PRO 6000 Blackwell", "NVIDIA RTX A6000"]))
    assert not ident.ok and "RTX A6000" in ident.mismatches[0]


def test_missing_nvidia_smi_is_a_mismatch_when_gpus_are_expected() -> None:
    ident = check_identity(PRO6000, facts("llm-two", [], error="nvidia-smi: command not found"))
    assert not ident.ok and ident.mismatches == [
        "cannot read GPUs (nvidia-smi: command not found), expected 'RTX PRO 6000 Blackwell'"]


def test_no_expectations_always_pass() -> None:
    assert check_identity(Expect(), facts("whatever", [])).ok
