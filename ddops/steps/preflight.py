"""Step 1, preflight: every involved host checked in parallel before anything changes.

Reachable; identity matches `expect`; source model dirs exist; the drafter's config agrees with the
profile and the target; free disk for the sync; the port is free or held by the unit being replaced;
no other ddops run holds the host's lock. Every problem found is reported together.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from ..errors import HostUnreachable, StepFailed
from ..facts import check_identity, gather
from ..probes import probe_source
from ..profile import LOCAL, Profile
from .base import LOCK_PATH, Change, PivotRun, run_probe, unit_path

RELEASE_FILE = "ddtree-release.json"
# target model_types the bundled runtime implements (runtime/ddtree_runtime/model/config.py TARGET_ARCHS)
RUNTIME_TARGETS = {"qwen3": "Qwen3", "qwen3_5": "Qwen3.5/3.6 hybrid", "qwen3_5_text": "Qwen3.5/3.6 hybrid"}


def release_path(profile: Profile) -> str:
    return f"{profile.runtime.venv}/{RELEASE_FILE}"


def serving_args(profile: Profile, training_unit: str | None) -> dict[str, Any]:
    """The inspect probe's arguments for the serving host."""
    dests = [m.path for m in profile.models]
    units = [profile.unit, *profile.conflicts] + ([training_unit] if training_unit else [])
    modules = sorted(profile.runtime.packages) if profile.engine == "ddtree" else []
    return {"trees": dests, "free": dests, "port": profile.port,
            "files": {unit_path(profile.unit): [], profile.env_file: sorted(profile.secrets),
                      release_path(profile): []},
            "imports": {"python": profile.runtime.python, "modules": modules},
            "units": units, "lock": LOCK_PATH}


def source_args(profile: Profile, host: str) -> dict[str, Any]:
    return {"trees": [m.source.path for m in profile.models if m.source and m.source.host == host]}


def inspect_local(args: dict[str, Any]) -> dict[str, Any]:
    """The same probe, run on the control machine (for `from: {host: local}` sources)."""
    done = subprocess.run([sys.executable, "-c", probe_source("inspect"), json.dumps(args)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise StepFailed(f"inspecting local model dirs failed: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout)


def source_tree(run: PivotRun, model) -> dict[str, Any]:
    key = LOCAL if model.source.host == LOCAL else model.source.host
    return run.inspect[key]["trees"][model.source.path]


def check_models(profile: Profile, trees: dict[str, dict], dest: dict[str, Any]) -> list[str]:
    """Problems with the model dirs: missing, or a drafter that disagrees with profile or target.

    `trees` maps role -> the tree the runtime will load (the source when synced, else the dest).
    """
    problems = []
    for model in profile.models:
        tree = trees[model.role]
        where = trees_where(profile, model.role)
        if not tree["exists"]:
            problems.append(f"{model.role} model dir {where} does not exist")
        elif tree["config"] is None:
            problems.append(f"{model.role} model dir {where} has no readable config.json")
    draft, target = trees.get("draft"), trees.get("target")
    if profile.engine == "ddtree" and target and target.get("config"):
        problems += check_target_arch(target["config"], trees_where(profile, "target"))
    if profile.engine == "ddtree" and profile.serve.mode == "ar":
        return problems
    if draft and draft.get("config") and target and target.get("config"):
        # multimodal checkpoints (Qwen3.5/3.6) keep the language model's config under text_config
        dc, tc = draft["config"], target["config"].get("text_config") or target["config"]
        inner = dc.get("dflash_config") or {}
        block = dc.get("block_size", inner.get("block_size"))
        wanted = profile.serve.block_size if profile.engine == "ddtree" else profile.sglang.num_draft_tokens
        if block is None:
            problems.append("drafter config.json has no block_size")
        elif block < wanted:
            problems.append(f"drafter block_size {block} is smaller than the profile's {wanted}")
        if inner.get("mask_token_id", dc.get("mask_token_id")) is None:
            problems.append("drafter config.json has no mask_token_id")
        if not inner.get("target_layer_ids"):
            problems.append("drafter config.json has no dflash_config.target_layer_ids")
        n_target = tc.get("num_hidden_layers")
        if dc.get("num_target_layers") != n_target:
            problems.append(f"drafter num_target_layers {dc.get('num_target_layers')} != target's "
                            f"num_hidden_layers {n_target}")
        ids = inner.get("target_layer_ids") or []
        if n_target and any(not 0 <= i < n_target for i in ids):
            problems.append(f"drafter target_layer_ids {ids} out of range for {n_target} target layers")
    return problems


def trees_where(profile: Profile, role: str) -> str:
    model = next(m for m in profile.models if m.role == role)
    return f"{model.source.host}:{model.source.path}" if model.source else f"{profile.host}:{model.path}"


def check_target_arch(config: dict[str, Any], where: str) -> list[str]:
    """The bundled runtime implements a few target families; anything else would fail at load on the host."""
    kind = config.get("model_type")
    if kind in RUNTIME_TARGETS:
        return []
    known = ", ".join(f"{k} ({v})" for k, v in RUNTIME_TARGETS.items())
    return [f"target model {where} is model_type {kind!r} (architectures {config.get('architectures')}), which "
            f"the bundled DDTree runtime does not implement; it serves {known} — use an SGLang profile "
            f"(engine: sglang) for other models"]


def check_disk(profile: Profile, trees: dict[str, dict], dest: dict[str, Any]) -> list[str]:
    problems = []
    need_by_fs: dict[str, int] = {}
    free_by_fs: dict[str, int] = {}
    for model in profile.models:
        if model.source is None:
            continue
        have = dest["trees"].get(model.path, {}).get("bytes", 0)
        need = max(0, trees[model.role]["bytes"] - have) + int(model.min_free_gib * 2**30)
        fs = dest["free"][model.path]
        need_by_fs[fs["checked"]] = need_by_fs.get(fs["checked"], 0) + need
        free_by_fs[fs["checked"]] = fs["free_bytes"]
    for fs, need in need_by_fs.items():
        if need > free_by_fs[fs]:
            problems.append(f"not enough disk on {profile.host}:{fs}: need {need / 2**30:.2f} GiB, "
                            f"free {free_by_fs[fs] / 2**30:.2f} GiB")
    return problems


def check_port(profile: Profile, dest: dict[str, Any]) -> list[str]:
    holder = dest.get("port")
    if holder is None or holder.get("unit") == profile.unit:
        return []
    return [f"port {profile.port} on {profile.host} is held by "
            f"{holder.get('unit') or 'pid ' + str(holder.get('pid'))} ({(holder.get('cmdline') or '')[:80]})"
            + (" — list it under `conflicts` to stop it" if holder.get("unit") else "")]


def lock_problem(host: str, holder: dict | None) -> str | None:
    if holder is None:
        return None
    who = ", ".join(f"{k}={holder[k]}" for k in ("user", "control_host", "pid", "command", "started_at")
                    if k in holder)
    return (f"{host} is locked by another ddops run ({who or 'unknown holder'}); if that run is dead, "
            f"clear the lock with --break-lock")


class PreflightStep:
    name = "preflight"
    title = "Preflight"

    def __init__(self, break_lock: bool = False) -> None:
        self.break_lock = break_lock

    def hosts(self, run: PivotRun) -> list:
        names = [run.profile.host] + [m.source.host for m in run.profile.models
                                      if m.source and m.source.host not in (LOCAL, run.profile.host)]
        return [run.inventory.host(n) for n in dict.fromkeys(names)]

    def execute(self, run: PivotRun) -> str:
        profile = run.profile
        hosts = self.hosts(run)
        training_unit = run.host.training.unit if run.host.training else None

        def one(host):
            facts = gather(run.executor, host)
            args = serving_args(profile, training_unit) if host.name == profile.host else {"trees": []}
            if host.name == profile.host or any(m.source and m.source.host == host.name for m in profile.models):
                args["trees"] = list(dict.fromkeys(args["trees"] + source_args(profile, host.name)["trees"]))
            return facts, run_probe(run.executor, host, "inspect", args, timeout=300)

        outcomes = run.executor.fan_out(hosts, one)
        problems: list[str] = []
        unreachable = False
        for host in hosts:
            outcome = outcomes[host.name]
            if outcome.error is not None:
                unreachable |= outcome.unreachable
                problems.append(outcome.error.line())
                continue
            facts, inspected = outcome.value
            run.facts[host.name], run.inspect[host.name] = facts, inspected
            identity = check_identity(host.expect, facts)
            if not identity.ok:
                problems.append(f"IDENTITY MISMATCH on {host.name}: {'; '.join(identity.mismatches)}")
        local = [m.source.path for m in profile.models if m.source and m.source.host == LOCAL]
        if local:
            run.inspect[LOCAL] = inspect_local({"trees": local})
        if problems:
            self._fail(problems, unreachable)
        dest = run.inspect[profile.host]
        trees = {m.role: (source_tree(run, m) if m.source else dest["trees"][m.path]) for m in profile.models}
        problems += check_models(profile, trees, dest)
        problems += check_disk(profile, trees, dest)
        problems += check_port(profile, dest)
        training = (run.facts[profile.host].get("training") or {})
        if training.get("running") and not run.kill_training and not run.dry_run:  # a dry run shows the stop
            problems.append(f"training is running on {profile.host} (pid {training.get('pid')}, step "
                            f"{training.get('last_step')}); pass --kill-training to stop it")
        holder = dest.get("lock")
        if holder is not None and not self.break_lock:
            problems.append(lock_problem(profile.host, holder))
        if problems:
            self._fail(problems, False)
        ident = run.facts[profile.host]
        return (f"{len(hosts)} host(s) ok; {profile.host} is {ident.get('hostname')} with "
                f"{len(ident.get('gpus', {}).get('list', []))} GPU(s)")

    @staticmethod
    def _fail(problems: list[str], unreachable: bool) -> None:
        cls = HostUnreachable if unreachable else StepFailed
        raise cls("preflight found " + (f"{len(problems)} problems: " if len(problems) > 1 else "a problem: ")
                  + "; ".join(problems), fix="nothing was changed")


def plan_none(run: PivotRun) -> list[Change]:
    return []
