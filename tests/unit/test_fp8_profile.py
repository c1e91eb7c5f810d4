"""FP8 serving in ddops (issue 25): `serve.quantization: fp8` reaches ddtree-serve's --quantize, and
preflight refuses it in one line on GPUs without FP8 tensor cores (compute capability below 8.9), from
the capability the facts probe reads (nvidia-smi's compute_cap, which the lab's imitation answers too)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_render_safety import BASE, profile_from

from ddops.errors import ConfigError
from ddops.facts import HostFacts
from ddops.preflight import check_fp8_gpus
from ddops.steps.unit import exec_argv

NVIDIA_SMI = Path(__file__).resolve().parents[2] / "ddops" / "lab" / "assets" / "nvidia-smi"


def host(*models: tuple[str, float | None]) -> HostFacts:
    listed = [{"index": i, "name": name, "compute_cap": cap} for i, (name, cap) in enumerate(models)]
    return HostFacts.from_json({"hostname": "h", "gpus": {"list": listed, "error": None}, "training": None})


def test_the_setting_reaches_the_command_line_and_only_its_choices_load(tmp_path):
    assert "--quantize" not in exec_argv(profile_from(tmp_path, BASE))
    argv = exec_argv(profile_from(tmp_path, BASE, {"serve.quantization": "fp8"}))
    assert argv[argv.index("--quantize") + 1] == "fp8"
    with pytest.raises(ConfigError, match="quantization"):
        profile_from(tmp_path, BASE, {"serve.quantization": "int4"})


def test_preflight_refuses_fp8_on_gpus_without_fp8_tensor_cores(tmp_path):
    fp8 = profile_from(tmp_path, BASE, {"serve.quantization": "fp8"})
    assert check_fp8_gpus(fp8, host(("NVIDIA RTX PRO 6000 Blackwell Server Edition", 12.0), ("NVIDIA H200", 9.0))) == []
    assert check_fp8_gpus(profile_from(tmp_path, BASE), host(("NVIDIA RTX A6000", 8.6))) == []  # not asked for
    mixed = host(("NVIDIA H200", 9.0), ("NVIDIA RTX A6000", 8.6), ("old driver", None))
    problem, = check_fp8_gpus(fp8, mixed)
    assert "\n" not in problem and problem.startswith("serve.quantization fp8 needs GPUs of compute capability 8.9")
    assert ("GPU 1 is an NVIDIA RTX A6000 (compute capability 8.6); GPU 2 is an old driver (capability unknown)"
            in problem)
    assert check_fp8_gpus(replace(fp8, gpus="0"), mixed) == []   # the unit is pinned to the H200


@pytest.mark.parametrize("model, cap", [("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 12.0),
                                        ("NVIDIA RTX A6000", 8.6), ("NVIDIA H200", 9.0)])
def test_the_lab_nvidia_smi_answers_compute_cap(tmp_path, model, cap):
    config = tmp_path / "gpus.json"
    config.write_text(json.dumps({"model": model, "count": 1, "memory_mib": 49140, "uuids": ["GPU-0"],
                                  "bus_ids": ["00000000:01:00.0"]}))
    out = subprocess.run([sys.executable, str(NVIDIA_SMI), "--query-gpu=index,name,compute_cap",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
                         env={"DDOPS_GPU_CONFIG": str(config), "DDOPS_GPU_HOLD_DIR": str(tmp_path / "holds"),
                              "PYTHONPATH": str(NVIDIA_SMI.parent)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"0, {model}, {cap}"


def test_the_facts_probe_reads_compute_cap_and_asks_again_without_it_on_old_drivers():
    from ddops.probes import probe_source

    source = probe_source("facts")
    namespace: dict = {}
    exec(source[:source.rindex("main()")], namespace)   # the probe's functions, without running it
    namespace["KMSG"] = "/nonexistent/kmsg"
    asked = []

    def nvidia_smi(argv):
        if argv[0] != "nvidia-smi":
            return 127, "", "not here"
        asked.append(argv[1])
        if "compute_cap" in argv[1]:   # a driver before R510 knows neither it nor the health fields
            return 2, 'Field "compute_cap" is not a valid field to query.', ""
        return 0, "0, NVIDIA RTX A6000, 10, 49140, 0\n", ""

    namespace["run"] = nvidia_smi
    gpus = namespace["gpus"]()
    assert len(asked) == 3 and "remapped_rows.pending" in asked[0] and "compute_cap" not in asked[2]
    first = gpus["list"][0]
    assert gpus["error"] is None and first["compute_cap"] is None and first["name"] == "NVIDIA RTX A6000"
    assert gpus["driver"] == {"version": None, "cuda": None} and "ecc_volatile" not in first
    namespace["run"] = lambda argv: (0, "0, NVIDIA H200, 10, 143771, 0, 9.0\n", "") if "compute_cap" in argv[1] \
        and "driver_version" not in argv[1] else (2, 'Field "remapped_rows.pending" is not a valid field to query.', "")
    assert namespace["gpus"]()["list"][0]["compute_cap"] == 9.0


def test_preflight_refuses_a_quantized_checkpoint_the_runtime_does_not_serve():
    from ddops.preflight import check_quantization

    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
    assert check_quantization({"model_type": "qwen3"}, "target model h:/m") == []
    assert check_quantization({"quantization_config": fp8}, "target model h:/m") == []
    assert check_quantization({"text_config": {"quantization_config": fp8}}, "target model h:/m") == []
    problem, = check_quantization({"quantization_config": {"quant_method": "awq", "bits": 4}}, "target model h:/m")
    assert problem.startswith("target model h:/m is quantized (quant_method 'awq')") and "\n" not in problem
    problem, = check_quantization({"quantization_config": {**fp8, "weight_block_size": [64, 64]}}, "draft model h:/d")
    assert "weight_block_size [64, 64]" in problem
