"""Preflight: every involved host checked in parallel before anything changes, and its facts read
once, into the typed `PivotFacts` every step plans from.

Reachable; identity matches `expect`; source model dirs exist; the drafter's config agrees with the
profile and the target; free disk for the sync; the port is free or held by the unit being replaced;
a server's tensor-parallel ranks (SGLang's, or the DDTree runtime's times its replicas) fit the
host's GPUs, and the DDTree runtime's split the target's heads evenly; every flag the unit passes exists
in the server that will run it (ddops.serverflags); a training stop that would lose more steps than
allowed has a checkpoint request to try first; no other ddops run holds the host's lock. Every problem
found is reported together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

from . import capacity, kernels
from .bundled import CAPACITY, DRAFTER, SETTINGS
from .errors import HostUnreachable, StepFailed
from .executor import Executor
from .facts import HostFacts, Inspection, PivotFacts, ServerFlags, Training, Tree, check_identity, gather
from .gpucheck import check_gpus, torch_probe_args
from .hostlock import lock_problem, unfinished_problem
from .inventory import Host, Inventory
from .paths import JOURNAL_PATH, LOCK_PATH, env_path, release_path, replicas_manifest, unit_path
from .probes import probe_source
from .profile import LIMITS, LOCAL, Profile, model_dir_problem, venv_dir_problem
from .release import release_id
from .remote import run_probe
from .serverflags import check_flags, host_flags, shipped_flags, ships_server
from .serverflags import summary as flags_summary
from .paths import BACKUP_ROOT, RELEASES, WHEELHOUSE   # where ddops itself writes (own_writes)
from .steps.deps import missing_modules
from .steps.unit import exec_argv
# target model_types the bundled runtime implements (runtime/ddtree_runtime/model/config.py TARGET_ARCHS)
RUNTIME_TARGETS = {"qwen3": "Qwen3", "qwen3_5": "Qwen3.5/3.6 hybrid", "qwen3_5_text": "Qwen3.5/3.6 hybrid"}
# model_types with linear-attention layers (SGLang keeps their state in its mamba cache)
HYBRID_TARGETS = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_next")


def serving_args(profile: Profile, training_unit: str | None) -> dict[str, Any]:
    """The inspect probe's arguments for the serving host."""
    dests = [m.path for m in profile.models]
    units = [profile.unit, *profile.conflicts] + ([training_unit] if training_unit else [])
    modules = sorted(profile.runtime.packages) if profile.engine == "ddtree" else []
    args = {"trees": dests, "free": dests, "port": profile.port,
            "files": {unit_path(profile.unit): [], profile.env_file: sorted(profile.secrets),
                      release_path(profile.runtime.venv): []},
            "imports": {"python": profile.runtime.python, "modules": modules},
            "units": units, "lock": LOCK_PATH, "journal": JOURNAL_PATH}
    if profile.replicated:
        add_replica_args(profile, args)
    args["paths"] = written_paths(profile)
    if profile.engine == "ddtree":   # whether its Triton cache is empty (a seed's condition)
        args["paths"].append(kernels.cache_dir(profile))
    args["free"] = list(dict.fromkeys(args["free"] + [where for where, _ in own_writes(profile)]))
    return args


def source_args(profile: Profile, host: str) -> dict[str, Any]:
    return {"trees": [m.source.path for m in profile.models if m.source and m.source.host == host]}


def inspect_local(args: dict[str, Any]) -> dict[str, Any]:
    """The same probe, run on the control machine (for `from: {host: local}` sources)."""
    done = subprocess.run([sys.executable, "-c", probe_source("inspect"), json.dumps(args)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise StepFailed(f"inspecting local model dirs failed: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout)


def check_models(profile: Profile, trees: dict[str, Tree]) -> list[str]:
    """Problems with the model dirs: missing, or a drafter that disagrees with profile or target.

    `trees` maps role -> the tree the runtime will load (the source when synced, else the dest).
    """
    problems = []
    for model in profile.models:
        tree = trees[model.role]
        where = trees_where(profile, model.role)
        if not tree.exists:
            problems.append(f"{model.role} model dir {where} does not exist")
        elif tree.config is None:
            problems.append(f"{model.role} model dir {where} has no readable config.json")
    draft, target = trees.get("draft"), trees.get("target")
    if profile.engine == "ddtree" and target and target.config:
        problems += check_target_arch(target.config, trees_where(profile, "target"))
        problems += check_heads_split(profile, target.config)
    if profile.engine == "ddtree":
        for role, tree in trees.items():
            if tree.config:
                problems += check_quantization(tree.config, f"{role} model {trees_where(profile, role)}")
    if profile.engine == "sglang" and target and target.config:
        problems += check_mamba_strategy(profile, target.config)
    if profile.engine == "ddtree" and profile.serve.mode == "ar":
        return problems
    if draft and draft.config and target and target.config:
        # multimodal checkpoints (Qwen3.5/3.6) keep the language model's config under text_config
        dc, tc = draft.config, target.config.get("text_config") or target.config
        inner = dc.get("dflash_config") or {}
        if profile.engine == "ddtree":
            # the runtime's loader's own check (drafter_layout.py): layers, fields, architecture
            problem = DRAFTER.drafter_problem(dc)
            if problem:
                problems.append(f"draft model {trees_where(profile, 'draft')}: {problem}")
        block = DRAFTER.draft_value(dc, "block_size")
        wanted = profile.serve.block_size if profile.engine == "ddtree" else profile.sglang.num_draft_tokens
        if block is None:
            problems.append("drafter config.json has no block_size")
        elif wanted is not None and block < wanted:
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


def check_heads_split(profile: Profile, config: dict[str, Any]) -> list[str]:
    """serve.tensor_parallel N gives each rank 1/N of every layer's heads (attention, KV, a hybrid's
    linear-attention heads) and MLP rows, as the runtime splits them (it refuses the rest at start): a
    size that does not divide them all is refused before anything stops, with the sizes that do. A
    config the arithmetic cannot read is the capacity line's to explain."""
    ranks = profile.serve.tensor_parallel
    if ranks == 1:
        return []
    try:
        counts = CAPACITY.Shape.from_config(config).split_counts()
    except (KeyError, TypeError, ValueError):
        return []
    uneven = [f"{name} ({n})" for name, n in counts.items() if n % ranks]
    if not uneven:
        return []
    largest = int(SETTINGS.BY_NAME["tensor_parallel"].maximum)
    sizes = [str(t) for t in range(1, largest + 1) if all(n % t == 0 for n in counts.values())]
    return [f"serve.tensor_parallel {ranks} ({profile.where('serve')}) does not divide target model "
            f"{trees_where(profile, 'target')}'s {_words(uneven)}: each rank takes an equal share of every layer's "
            f"heads and MLP rows; set serve.tensor_parallel to {_words(sizes, 'or')}"]


def _words(items: list[str], last: str = "and") -> str:
    """`a`, `a and b`, `a, b and c`."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def check_quantization(config: dict[str, Any], where: str) -> list[str]:
    """A quantized checkpoint the bundled runtime does not serve (it serves fine-grained FP8 only:
    LIMITS.FP8_CHECKPOINT) would be refused at its start, after the pivot stopped what serves."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    wanted = LIMITS.FP8_CHECKPOINT
    if not qc or all(qc.get(k, "dynamic" if k == "activation_scheme" else None) == v for k, v in wanted.items()):
        return []
    got = ", ".join(f"{k} {qc.get(k)!r}" for k in wanted if k in qc) or "no quant_method"
    return [f"{where} is quantized ({got}), which the bundled DDTree runtime does not serve: it serves 16-bit "
            f"checkpoints and fine-grained fp8 (quant_method fp8, weight_block_size [128, 128], dynamic "
            f"activations) — use such a checkpoint, or an SGLang profile (engine: sglang)"]


def is_hybrid(config: dict[str, Any]) -> bool:
    """A target with linear-attention (Gated DeltaNet / Mamba-style) layers: Qwen3.5/3.6, Qwen3-Next."""
    text = config.get("text_config") or config
    return (config.get("model_type") in HYBRID_TARGETS or text.get("model_type") in HYBRID_TARGETS
            or "linear_attention" in (text.get("layer_types") or []))


def check_mamba_strategy(profile: Profile, config: dict[str, Any]) -> list[str]:
    """SGLang's DFLASH on a hybrid target needs `--mamba-scheduler-strategy extra_buffer` (z-lab's recipe)."""
    strategy = profile.sglang.mamba_scheduler_strategy
    if not is_hybrid(config) or strategy == "extra_buffer":
        return []
    return [f"target model {trees_where(profile, 'target')} is a hybrid ({config.get('model_type')}, linear-attention "
            f"layers) and SGLang's DFLASH on it needs `--mamba-scheduler-strategy extra_buffer`, but the profile "
            f"passes {strategy or 'none (auto)'}; set `sglang.mamba_scheduler_strategy: extra_buffer`"]


def check_disk(profile: Profile, trees: dict[str, Tree], dest: Inspection) -> list[str]:
    """Free space on each filesystem of the serving host for everything the pivot writes there
    together: the models it syncs, and ddops's own writes (backups, venv, wheels: `own_needs`)."""
    needs: list[tuple[str, int, str]] = []   # (path, bytes, what)
    for model in profile.models:
        if model.source is None:
            continue
        have = dest.tree(model.path).bytes
        needs.append((model.path, max(0, trees[model.role].bytes - have) + int(model.min_free_gib * 2**30),
                      f"{model.role} model"))
    needs += own_needs(profile, dest)
    by_fs: dict[object, list[tuple[str, int, str]]] = {}
    for path, need, what in needs:
        fs = dest.free.get(path)
        if fs is not None and need > 0:
            by_fs.setdefault(fs.device if fs.device is not None else fs.checked, []).append((path, need, what))
    problems = []
    for entries in by_fs.values():
        fs = dest.free[entries[0][0]]
        total = sum(need for _, need, _ in entries)
        if total > fs.free_bytes:
            parts = ", ".join(f"{what} {size(need)} in {path}" for path, need, what in entries)
            problems.append(f"not enough disk on {profile.host}:{fs.checked}: need {size(total)} ({parts}), "
                            f"free {size(fs.free_bytes)}")
    return problems


def size(n: int) -> str:
    """Bytes for a person: `0 B`, `512 KiB`, `1.5 GiB`: three figures at most, in the unit that fits."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.3g} {unit}"


def check_port(profile: Profile, holder: dict[str, Any] | None) -> list[str]:
    """The port must be free, or held by the unit the pivot replaces or one it stops first (a conflict)."""
    if holder is None or holder.get("unit") in (profile.unit, *profile.conflicts):
        return []
    return [f"port {profile.port} on {profile.host} is held by {holder_words(holder)}"
            + (" — list it under `conflicts` to stop it" if holder.get("unit") else "")]


def holder_words(holder: dict[str, Any]) -> str:
    """Who listens on a port, in what is known: its unit and command, its pid, or (a listener whose
    process this host cannot see: another container sharing its network) that much."""
    command = (holder.get("cmdline") or "").strip()[:80]
    if holder.get("unit"):
        return f"{holder['unit']} (pid {holder.get('pid')}: {command})" if command else holder["unit"]
    if holder.get("pid") is not None:
        return f"pid {holder['pid']} ({command})" if command else f"pid {holder['pid']}"
    return ("a process this host cannot see (another container or namespace sharing its network, or one "
            "ddops may not inspect)")


def check_tensor_parallel(profile: Profile, host: HostFacts) -> list[str]:
    """A server starts one rank per GPU (SGLang's `sglang.tp_size`, the DDTree runtime's
    `serve.tensor_parallel` in each replica) and never comes up with fewer GPUs visible to it: the host's,
    or those of the profile's `gpus` (CUDA_VISIBLE_DEVICES) the host has. Refused here, before the pivot
    stops what serves for a unit that cannot start. GPUs the facts probe could not list are not taken for
    none (no count is known); the health gate still sees such a start fail."""
    if host.gpu_error:
        return []
    if profile.engine == "ddtree":
        return check_server_gpus(profile, host)
    wanted, have = profile.sglang.tp_size, host.gpu_count
    pinned = [int(g) for g in profile.gpus.split(",")] if profile.gpus is not None else None
    visible = have if pinned is None else len({g for g in pinned if g < have})
    if wanted <= visible:
        return []
    given = "" if pinned is None else (f" and the profile's `gpus: [{', '.join(map(str, pinned))}]` "
                                       f"gives SGLang {visible} of them")
    fixes = [f"set `sglang.tp_size` to at most {visible}"] if visible else []
    fixes.append(f"list {wanted} of its GPUs (0 to {have - 1}) in `gpus`" if pinned is not None and have >= wanted
                 else f"deploy it to a host with at least {wanted} GPU(s)")
    return [f"{profile.host} has {have} GPU(s){given}, but the profile's sglang.tp_size is {wanted}: SGLang needs "
            f"one GPU per tensor-parallel rank and would never come up; {', or '.join(fixes)}"]


def check_server_gpus(profile: Profile, host: HostFacts) -> list[str]:
    """The DDTree runtime's GPUs: serve.tensor_parallel of them for each replica (or for the one unit, on
    a GPU device), each on the host."""
    ranks, have = profile.serve.tensor_parallel, host.gpu_count
    if profile.replicated and profile.replicas.gpus_each:
        units = [(r.unit, r.gpus) for r in profile.replicas.members]
        asked = f"{len(units)} replica(s) x {profile.replicas.gpus_each} GPU(s) need"
    elif not profile.replicated and ranks > 1 and profile.device.startswith("cuda"):
        units = [(profile.unit, tuple(int(g) for g in profile.gpus.split(",")))]
        asked = "one server needs"
    else:
        return []
    needed = sum(len(gpus) for _, gpus in units)
    if needed <= have and all(g < have for _, gpus in units for g in gpus):
        return []
    placed = "; ".join(f"{unit} on GPU {','.join(map(str, gpus))}" for unit, gpus in units)
    split = f" (serve.tensor_parallel {ranks})" if ranks > 1 else ""
    if needed <= have:
        fix = f"list GPUs 0 to {have - 1} only in `gpus`"
    else:
        fewer = " or serve.tensor_parallel" if ranks > 1 else ""
        fix = (f"lower serve.replicas{fewer}" if profile.replicated else "lower serve.tensor_parallel")
        fix += f", or deploy to a host with at least {needed} GPUs"
    return [f"{profile.host} has {have} GPU(s), and {asked} {needed}{split}: {placed} "
            f"({profile.where('serve')}); {fix}"]


def check_fp8_gpus(profile: Profile, host: HostFacts) -> list[str]:
    """`serve.quantization: fp8` needs FP8 tensor cores (compute capability 8.9 or more: Ada, Hopper,
    Blackwell) on every GPU the unit may use: the profile's `gpus`, or all the host's. An older card has
    no FP8 GEMM for the runtime to run, so the profile is refused before anything stops."""
    if profile.serve.quantization != "fp8" or host.gpu_error:
        return []
    pinned = [int(g) for g in profile.gpus.split(",")] if profile.gpus is not None else range(host.gpu_count)
    wanted = LIMITS.FP8_MIN_COMPUTE_CAPABILITY
    short = [f"GPU {i} is an {name} ({'capability unknown' if cap is None else f'compute capability {cap}'})"
             for i, (name, cap) in enumerate((g.name or "?", g.compute_cap) for g in host.gpus)
             if i in pinned and (cap is None or cap < wanted)]
    if not short:
        return []
    return [f"serve.quantization fp8 needs GPUs of compute capability {wanted} or more (FP8 tensor cores) on "
            f"{profile.host}, and {'; '.join(short)}: drop `serve.quantization`, or deploy to such GPUs"]


# -- replicas behind the balancer (issue 17) -----------------------------------------------------------

def add_replica_args(profile: Profile, args: dict[str, Any]) -> None:
    """What the inspect probe reads for replicas: every replica's port and unit, the balancer's unit,
    config and command, the per-replica env files and the replicas manifest."""
    members, balancer = profile.replicas.members, profile.balancer
    args["ports"] = [r.port for r in members]
    args["units"] = list(dict.fromkeys(args["units"] + [r.unit for r in members] + [balancer.unit]))
    args["files"].update({env_path(r.unit): [] for r in members})
    args["files"].update({balancer.config: [], replicas_manifest(profile.unit): []})
    args["commands"] = ["haproxy"]


def check_replicas(profile: Profile, facts: PivotFacts) -> list[str]:
    """The public port free or the balancer's (or a unit the pivot stops); each replica's port free or
    held by that replica. (Their GPUs: check_tensor_parallel.)"""
    replicas, dest, problems = profile.replicas, facts.dest, []
    holder = dest.port_holder
    if holder is not None and holder.get("unit") not in (profile.balancer.unit, *profile.conflicts):
        problems += check_port(profile, holder)
    for replica in replicas.members:
        holder = dest.ports.get(replica.port)
        if holder is not None and holder.get("unit") not in (replica.unit, *profile.conflicts):
            problems.append(f"replica port {replica.port} on {profile.host} (for {replica.unit}) is held by "
                            f"{holder_words(holder)}")
    return problems


def involved_hosts(profile: Profile, inventory: Inventory) -> list[Host]:
    """The serving host, then every host a model syncs from."""
    names = [profile.host] + [m.source.host for m in profile.models
                              if m.source and m.source.host not in (LOCAL, profile.host)]
    return [inventory.host(n) for n in dict.fromkeys(names)]


def check_kill_cost(profile: Profile, training: Training, accepted: float | None) -> list[str]:
    """A kill that loses more steps than this run allows, with no checkpoint request to try first, is
    refused here (with a request, the stop_training action decides after trying it)."""
    limit = profile.training_stop.limit(accepted)
    if not training.running or profile.training_stop.request or not training.over(limit):
        return []
    how = f"--accept-lost-steps {training.lost_steps}" if training.lost_steps is not None else "--accept-lost-steps all"
    return [f"stopping training on {profile.host} costs more than the {limit} lost step(s) this run allows "
            f"(training.max_lost_steps or --accept-lost-steps): at step {training.last_step}, {training.cost()}; "
            f"pass {how}, name a checkpoint request (training.checkpoint_signal or checkpoint_command), or wait "
            "for its next checkpoint"]


def preflight(profile: Profile, inventory: Inventory, executor: Executor, *, kill_training: bool = False,
              dry_run: bool = False, break_lock: bool = False,
              accept_lost_steps: float | None = None, accept_gpu_faults: bool = False) -> tuple[PivotFacts, str]:
    """Gather and check; returns the facts and a one-line summary, or raises naming every problem found."""
    hosts = involved_hosts(profile, inventory)
    serving = inventory.host(profile.host)
    training_unit = serving.training.unit if serving.training else None

    def one(host: Host) -> tuple[dict, dict, ServerFlags | None, dict | None]:
        facts = gather(executor, host, cuda_version=host.name == profile.host)
        args = serving_args(profile, training_unit) if host.name == profile.host else {"trees": []}
        if host.name == profile.host or any(m.source and m.source.host == host.name for m in profile.models):
            args["trees"] = list(dict.fromkeys(args["trees"] + source_args(profile, host.name)["trees"]))
        inspected = run_probe(executor, host, "inspect", args, timeout=300)
        # the installed server's own --help, unless the pivot ships the release that will run
        flags = host_flags(executor, host, profile) if host.name == profile.host and not ships_server(profile) else None
        torch_args = torch_probe_args(profile, inspected) if host.name == profile.host else None
        torch = run_probe(executor, host, "torchwheel", torch_args, timeout=900) if torch_args else None
        return facts, inspected, flags, torch

    outcomes = executor.fan_out(hosts, one)
    server_flags: ServerFlags | None = None
    torch: dict | None = None
    problems: list[str] = []
    unreachable = False
    host_facts: dict[str, HostFacts] = {}
    inspections: dict[str, Inspection] = {}
    for host in hosts:
        outcome = outcomes[host.name]
        if outcome.error is not None:
            unreachable |= outcome.unreachable
            problems.append(outcome.error.line())
            continue
        facts, inspected, flags, found = outcome.value
        torch = found or torch
        host_facts[host.name], inspections[host.name] = HostFacts.from_json(facts), Inspection.from_json(inspected)
        server_flags = flags or server_flags
        identity = check_identity(host.expect, facts)
        if not identity.ok:
            problems.append(f"IDENTITY MISMATCH on {host.name}: {'; '.join(identity.mismatches)}")
    local = [m.source.path for m in profile.models if m.source and m.source.host == LOCAL]
    if local:
        inspections[LOCAL] = Inspection.from_json(inspect_local({"trees": local}))
    if problems:
        _fail(problems, unreachable)
    release = release_id(profile.runtime.ship) if profile.runtime.ship is not None else None
    if ships_server(profile):
        server_flags = shipped_flags(profile.runtime.ship, release)
    model = kernels.gpu_model(host_facts[profile.host]) if profile.engine == "ddtree" else None
    store = kernels.read_store(model)
    record = kernels.read_record_store(model) if store is None else None
    facts = PivotFacts(serving=profile.host, hosts=host_facts, inspections=inspections, release=release,
                       server_flags=server_flags, kernel_store=store, kernel_record=record)
    dest = facts.dest
    trees = {m.role: (facts.source_tree(m) if m.source else dest.tree(m.path)) for m in profile.models}
    problems += check_models(profile, trees)
    facts = replace(facts, pool=capacity.estimate(profile, facts.host, trees))
    problems += capacity.check_fits(profile, facts.pool)
    problems += check_disk(profile, trees, dest)
    problems += check_confinement(profile, dest)
    problems += check_replicas(profile, facts) if profile.replicated else check_port(profile, dest.port_holder)
    argv = exec_argv(profile)
    problems += check_flags(profile, argv, server_flags)
    problems += check_tensor_parallel(profile, facts.host)
    problems += check_fp8_gpus(profile, facts.host)
    gpu_problems, gpu_check = check_gpus(profile, facts.host, torch, accept_gpu_faults)
    problems += gpu_problems
    facts = replace(facts, gpu_check=gpu_check)
    training = facts.host.training
    if training.running and not kill_training and not dry_run:  # a dry run shows the stop
        problems.append(f"training is running on {profile.host} (pid {training.pid}, step "
                        f"{training.last_step}); pass --kill-training to stop it")
    elif not dry_run:  # a dry run shows the cost and what a real run needs
        problems += check_kill_cost(profile, training, accept_lost_steps)
    # A journal under a lock may be a pivot in progress: the lock speaks first (with --break-lock, taking
    # the lock decides whether its run is dead, and then the journal refuses the pivot).
    if dest.lock_holder is not None:
        if not break_lock:
            problems.append(lock_problem(profile.host, dest.lock_holder))
    elif dest.journal is not None:
        problems.append(unfinished_problem(profile.host, dest.journal))
    if problems:
        _fail(problems, False)
    flags_note = flags_summary(server_flags, argv)
    return facts, (f"{len(hosts)} host(s) ok; {profile.host} is {facts.host.hostname} with "
                   f"{facts.host.gpu_count} GPU(s)" + (f"; {flags_note}" if flags_note else "")
                   + (f"; {gpu_check.note()}" if gpu_check.note() else ""))


def _fail(problems: list[str], unreachable: bool) -> None:
    cls = HostUnreachable if unreachable else StepFailed
    raise cls("preflight found " + (f"{len(problems)} problems: " if len(problems) > 1 else "a problem: ")
              + "; ".join(problems), fix="nothing was changed")


# -- where ddops writes (issue 36): paths confined once their symlinks are resolved, and space there --

VENV_FLOOR = 2**30          # a pip install into the venv, when the index decides its size: at least this
STATE_FLOOR = 64 * 2**20    # backups, history and the lock under /var/lib/ddops
RELEASES_FLOOR = 256 * 2**20   # a shipped runtime wheel, kept beside the earlier ones


def written_paths(profile: Profile) -> list[str]:
    """Every path on the serving host a pivot writes into: its dirs (models, venv) and files (unit,
    environment, release record, a replicated profile's env files, manifest and balancer config)."""
    paths = [*(m.path for m in profile.models), unit_path(profile.unit), profile.env_file]
    if profile.engine == "ddtree":   # its venv and release record (an SGLang profile's venv is SGLang's own)
        paths += [profile.runtime.venv, release_path(profile.runtime.venv)]
    if profile.replicated:
        paths += [env_path(r.unit) for r in profile.replicas.members]
        paths += [replicas_manifest(profile.unit), profile.balancer.config]
    return list(dict.fromkeys(paths))


def own_writes(profile: Profile) -> list[tuple[str, str]]:
    """Where ddops itself writes on the serving host, beside the models: (path, what)."""
    writes = [(BACKUP_ROOT, "backups")]
    if profile.engine == "ddtree":
        writes.append((profile.runtime.venv, "venv"))
        if profile.runtime.ship is not None:
            writes.append((RELEASES, "runtime wheels"))
        if not profile.runtime.index:
            writes.append((WHEELHOUSE, "wheelhouse"))
    return writes


def own_needs(profile: Profile, dest: Inspection) -> list[tuple[str, int, str]]:
    """How much ddops's own writes need, where they go: (path, bytes, what). The venv needs room only
    when packages are missing: the wheelhouse's size twice (pushed, then installed) offline, else a floor."""
    needs = []
    missing = missing_modules(profile, dest.imports)
    for path, what in own_writes(profile):
        if what == "backups":
            needs.append((path, STATE_FLOOR, what))
        elif what == "runtime wheels":
            needs.append((path, RELEASES_FLOOR, what))
        elif what == "wheelhouse" and missing:
            needs.append((path, local_size(profile.runtime.wheelhouse), what))
        elif what == "venv" and missing:
            offline = not profile.runtime.index
            needs.append((path, local_size(profile.runtime.wheelhouse) if offline else VENV_FLOOR,
                          "venv (pip install)"))
    return needs


def local_size(folder: str | None) -> int:
    """Bytes of the files under a folder on the control machine (0 when absent)."""
    total = 0
    for top, _, names in os.walk(folder or ""):
        total += sum(os.path.getsize(os.path.join(top, n)) for n in names if os.path.isfile(os.path.join(top, n)))
    return total


def check_confinement(profile: Profile, dest: Inspection) -> list[str]:
    """Paths the profile names, with symlinks resolved on the host: the venv and model dirs stay out of
    system directories, a venv is made only in a new or empty dir (or over a venv), and the files ddops
    writes are not links to somewhere else."""
    problems = []
    where = profile.where("runtime")
    # the venv ddops makes and pip-installs into (an SGLang profile's is SGLang's own, only read)
    dirs = {profile.runtime.venv: (venv_dir_problem, "runtime.venv")} if profile.engine == "ddtree" else {}
    dirs.update({m.path: (model_dir_problem, f"models.{m.role}.path") for m in profile.models})
    for path, (problem_of, key) in dirs.items():
        fact = dest.paths.get(path)
        if fact is None:
            continue
        problem = problem_of(fact.real) if fact.real != path else None
        if problem:
            problems.append(f"{key} {path} on {profile.host} leads to {fact.real} (a symlink), which is {problem} "
                            f"({profile.where(key.split('.')[0])}); name a directory of its own")
        elif fact.exists and not fact.dir:
            problems.append(f"{key} {path} on {profile.host} is a file, not a directory "
                            f"({profile.where(key.split('.')[0])})")
    venv = dest.paths.get(profile.runtime.venv)
    if (profile.engine == "ddtree" and venv is not None and venv.dir and venv.entries and not venv.venv
            and not dest.imports.venv):
        problems.append(f"runtime.venv {profile.runtime.venv} on {profile.host} holds {venv.entries} file(s) and is not "
                        f"a venv ({where}): ddops makes a venv only in a new or empty directory; empty it, or name "
                        "another")
    written = set(written_paths(profile)) - set(dirs)
    for path in sorted(written):
        fact = dest.paths.get(path)
        if fact is not None and fact.link:
            problems.append(f"{path} on {profile.host} is a symlink to {fact.real}: ddops writes that file and "
                            "follows no link out of its folder; remove the link (`systemctl disable` or `rm`) first")
    return problems
