"""Render the unit: template -> unit text + environment file; diff; backup; atomic write. A replicated
profile's template unit brings its per-replica env files, HAProxy's config and the replicas manifest,
installed and backed up with it.

The unit file never holds a secret: the environment (and API key) lives in an EnvironmentFile with
mode 0600. Diffs show secret values as `***`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2

from ..backups import new_backup_id
from ..bundled import SETTINGS
from ..errors import ConfigError, StepFailed
from ..facts import Inspection
from ..paths import BACKUP_ROOT, backup_root, env_path, replicas_manifest, triton_cache, unit_cache, unit_path
from ..plan import Operation, PlanContext, RunContext, Undo
from ..profile import Profile, Replica
from ..remote import check, run_probe
from ..undo import RestoreBackup
from ..yamlsrc import CONTROL_CHARS

# Used with fullmatch: `$` would also match before a trailing newline, which would end the line.
_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_ENV_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]*")
# In a quoted ExecStart= word systemd undoes C escapes; these need one (and \r, \0 would end the line).
_C_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def templates_dir() -> Path:
    return Path(os.environ.get("DDOPS_TEMPLATES") or Path(__file__).resolve().parents[2] / "templates")


def systemd_quote(arg: str) -> str:
    """Quote one ExecStart argument the way systemd parses it: `%` (specifiers) and `$` (variables)
    doubled; anything else unusual inside double quotes, with C escapes for quotes, backslashes and
    every control character, so no value can end the line or the word."""
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if _SAFE.fullmatch(escaped):
        return escaped
    return '"' + "".join(_c_escape(c) for c in escaped) + '"'


def _c_escape(char: str) -> str:
    if char in _C_ESCAPES:
        return _C_ESCAPES[char]
    if CONTROL_CHARS.match(char):  # a C0 control or DEL as \xNN, a Unicode line separator as \uNNNN
        return f"\\x{ord(char):02x}" if ord(char) < 0x80 else f"\\u{ord(char):04x}"
    return char


class FromEnvironment(str):
    """An ExecStart= word written as it is, for systemd to expand: a replica's port comes from its
    instance's env file. Only ddops puts one in an argv; a profile value is always a plain str."""


REPLICA_PORT = FromEnvironment("${DDOPS_REPLICA_PORT}")


def exec_start(argv: list[str]) -> str:
    return " ".join(a if isinstance(a, FromEnvironment) else systemd_quote(a) for a in argv)


def exec_argv(profile: Profile) -> list[str]:
    """The runtime's command line, from the profile (a replica listens on loopback, on its own port)."""
    target, draft = profile.model("target"), profile.model("draft")
    if profile.engine == "sglang":
        sg = profile.sglang
        argv = [sg.python, "-m", "sglang.launch_server", "--model-path", target.path,
                "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft.path,
                "--speculative-num-draft-tokens", str(sg.num_draft_tokens), "--tp-size", str(sg.tp_size),
                "--host", profile.bind, "--port", str(profile.port)]
        if sg.mamba_scheduler_strategy:
            argv += ["--mamba-scheduler-strategy", sg.mamba_scheduler_strategy]
        if profile.serve.served_model_name:
            argv += ["--served-model-name", profile.serve.served_model_name]
        return argv + list(sg.extra_args)
    host, port = ("127.0.0.1", REPLICA_PORT) if profile.replicated else (profile.bind, str(profile.port))
    # the settings a profile sets outside `serve:`: always passed
    placed = {"target_dir": target.path, "draft_dir": draft.path if draft is not None else None, "host": host,
              "port": port, "device": profile.device, "dtype": profile.dtype}
    argv = [f"{profile.runtime.venv}/bin/ddtree-serve"]
    for setting in SETTINGS.SERVE_SETTINGS:
        if setting.name in placed:
            argv += [setting.flag, placed[setting.name]] if placed[setting.name] is not None else []
        elif setting.profile:
            argv += serve_flag(setting, profile.serve)
    return argv + list(profile.serve.extra_args)


def serve_flag(setting, serve) -> list[str]:
    """A `serve:` setting's flag and value, when the profile sets it or it differs from the runtime's
    default (else the runtime's default holds, and the unit does not spell it out)."""
    value = getattr(serve, setting.name)
    if setting.name not in serve.given and value == setting.default:
        return []
    if setting.type is bool:
        return [setting.flag] if value != setting.default else []
    if setting.type is dict:
        return [setting.flag, json.dumps(value, sort_keys=True)]
    return [setting.flag, str(value)] if value is not None else []


@dataclass(frozen=True)
class ManagedFile:
    """A file a replicated profile installs beside its unit (backed up and restored with it)."""

    path: str
    text: str
    mode: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class Rendered:
    unit_text: str
    env_text: str          # holds secret values: written to the host, never shown
    env_masked: str        # what may be shown
    files: tuple[ManagedFile, ...] = ()    # replicas: instance env files, the balancer's config, the manifest

    @property
    def unit_sha256(self) -> str:
        return hashlib.sha256(self.unit_text.encode()).hexdigest()

    @property
    def env_sha256(self) -> str:
        return hashlib.sha256(self.env_text.encode()).hexdigest()


def env_lines(profile: Profile, secret_values: dict[str, str], *, masked: bool) -> str:
    cache = unit_cache(profile.engine)  # the unit's CacheDirectory=: kept across restarts and pivots
    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": f"{cache}/hf"}
    if profile.engine == "ddtree":
        # compiled kernels and (TRITON_CACHE_AUTOTUNING) autotune choices survive a restart, and travel to a
        # host of the same GPU model (ddops.kernels): the warm-up then loads them, not compiles and times them
        env |= {"TRITON_CACHE_DIR": triton_cache(profile.engine), "TRITON_CACHE_AUTOTUNING": "1",
                "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor"}
    if profile.gpus is not None and not profile.replicated:  # a replica's GPUs are in its instance env
        env["CUDA_VISIBLE_DEVICES"] = profile.gpus
    env.update(profile.env)
    lines = [f"# Managed by ddops (profile {profile.name}); mode 0600: may hold secrets."]
    for key, value in env.items():
        lines.append(f"{key}={_env_quote(value)}")
    for key in profile.secrets:
        value = "***" if masked else secret_values.get(key, "")
        lines.append(f"{key}={value if masked else _env_quote(value)}")
    return "\n".join(lines) + "\n"


def _env_quote(value: str) -> str:
    """An EnvironmentFile= value: plain, or in double quotes with backslash, quote, dollar and backtick
    escaped, as systemd reads them (inside the quotes a line break belongs to the value, so not even a
    secret from the control machine's environment can add a line)."""
    if _ENV_SAFE.fullmatch(value):
        return value
    return '"' + re.sub(r'([\\"$`])', r"\\\1", value) + '"'


def _one_line(value, template: str):
    """Every value a template writes stays on its line: the profile validates and exec_start escapes
    what reaches the templates today; this refuses what a field added to a template later might carry."""
    if isinstance(value, str) and CONTROL_CHARS.search(value):
        raise ConfigError(f"template {template} would write a line break or control character from {value!r}",
                          where=str(templates_dir() / template),
                          fix="render only validated profile fields, or escape the value for the unit file")
    return value


def _haproxy_word(value, template: str):
    """A value in HAProxy's config is one word its parser reads as it is: no space, `#`, quote,
    backslash or `$` (a comment, a quote, an escape, a variable). The profile validates what gets here."""
    if isinstance(value, str) and not _HAPROXY_SAFE.fullmatch(value):
        raise ConfigError(f"template {template} would write {value!r}, which HAProxy would not read as one word",
                          where=str(templates_dir() / template), fix="render only validated profile fields")
    return value


_HAPROXY_SAFE = re.compile(r"[A-Za-z0-9@/_.~:+=,\[\]-]+")


def render_template(name: str, finalize, **values) -> str:
    """One template of templates/ (StrictUndefined: a missing variable is an error); every error is one line."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
                             finalize=lambda value: finalize(value, name))
    try:
        return env.get_template(name).render(**values)
    except jinja2.TemplateNotFound:
        raise ConfigError(f"unit template {name} not found in {templates_dir()}",
                          fix="set DDOPS_TEMPLATES to the templates folder") from None
    except jinja2.TemplateSyntaxError as exc:
        where = f"{exc.filename or templates_dir() / name}:{exc.lineno}"
        raise ConfigError(f"template {exc.name or name}: {exc.message}", where=where,
                          fix="fix the template's syntax") from None
    except jinja2.UndefinedError as exc:
        raise ConfigError(f"template {name}: {exc.message}", where=str(templates_dir() / name),
                          fix="the template uses a variable the profile does not define") from None


def render(profile: Profile, secret_values: dict[str, str]) -> Rendered:
    """Render the profile's unit template, its env file and (replicas) the files beside them."""
    if profile.replicated:
        return render_replicated(profile, secret_values)
    name = "sglang.service.j2" if profile.engine == "sglang" else "ddtree.service.j2"
    unit_text = render_template(name, _one_line, profile=profile, exec_start=exec_start(exec_argv(profile)))
    return Rendered(unit_text=unit_text, env_text=env_lines(profile, secret_values, masked=False),
                    env_masked=env_lines(profile, secret_values, masked=True))


# -- replicas behind HAProxy (issue 17) ----------------------------------------------------------------

def instance_env(profile: Profile, replica: Replica) -> str:
    """A replica's own env file: its index, port and GPUs (read after the shared one, so these win)."""
    lines = [f"# Managed by ddops (profile {profile.name}): replica {replica.index} of {profile.replicas.count}.",
             f"DDOPS_REPLICA={replica.index}", f"DDOPS_REPLICA_PORT={replica.port}"]
    if replica.gpus:
        lines.append("CUDA_VISIBLE_DEVICES=" + ",".join(str(g) for g in replica.gpus))
    return "\n".join(lines) + "\n"


def manifest(profile: Profile) -> dict:
    """What the host keeps about a replicated deployment (status and rollback read it there)."""
    b = profile.balancer
    return {"profile": profile.name, "template": profile.unit, "health_path": profile.health.path,
            "balancer": {"unit": b.unit, "port": profile.port, "bind": profile.bind, "backend": b.backend,
                         "socket": b.socket, "config": b.config, "drain_timeout_s": b.drain_timeout_s,
                         "ready_timeout_s": b.ready_timeout_s},
            "replicas": [{"index": r.index, "unit": r.unit, "port": r.port, "gpus": list(r.gpus), "server": r.server}
                         for r in profile.replicas.members]}


def render_replicated(profile: Profile, secret_values: dict[str, str]) -> Rendered:
    members, balancer = profile.replicas.members, profile.balancer
    instance_pattern = env_path(profile.unit.replace("@.service", "@%i.service"))
    unit_text = render_template("ddtree@.service.j2", _one_line, profile=profile, exec_start=exec_start(exec_argv(profile)),
                                template_name=profile.unit, instance_example=members[0].unit,
                                instance_env_pattern=instance_pattern)
    haproxy = render_template("haproxy.cfg.j2", _haproxy_word, profile=profile, replicas=members, balancer=balancer,
                              bind=profile.bind, health_path=profile.health.path,
                              timeout_ms=str(int(balancer.timeout_s * 1000)),
                              check_ms=str(int(balancer.check_interval_s * 1000)))
    files = tuple(ManagedFile(env_path(r.unit), instance_env(profile, r), 0o600) for r in members) + (
        ManagedFile(balancer.config, haproxy, 0o644),
        ManagedFile(replicas_manifest(profile.unit), json.dumps(manifest(profile), indent=1) + "\n", 0o644))
    return Rendered(unit_text=unit_text, env_text=env_lines(profile, secret_values, masked=False),
                    env_masked=env_lines(profile, secret_values, masked=True), files=files)


def diff(old: str | None, new: str, path: str) -> str:
    return "".join(difflib.unified_diff((old or "").splitlines(True), new.splitlines(True),
                                        fromfile=f"{path} (installed)" if old is not None else "/dev/null",
                                        tofile=f"{path} (rendered)"))


def plan_unit(profile: Profile, rendered: Rendered, installed: Inspection) -> list[Operation]:
    """Writes from the installed files: nothing when both checksums agree. Both files are installed
    together (one backup, one daemon-reload), so either write brings the other along if it differs."""
    upath, epath = unit_path(profile.unit), profile.env_file
    unit_now, env_now = installed.file(upath), installed.file(epath)
    operations = []
    if unit_now.sha256 != rendered.unit_sha256:
        operations.append(Operation(f"write {upath}" + (" (new)" if not unit_now.exists else ""),
                                    detail=diff(unit_now.text, rendered.unit_text, upath)))
    if env_now.sha256 != rendered.env_sha256:
        operations.append(Operation(f"write {epath} (mode 0600)" + (" (new)" if not env_now.exists else ""),
                                    detail=diff(env_now.text, rendered.env_masked, epath)))
    for managed in rendered.files:
        now = installed.file(managed.path)
        if now.sha256 != managed.sha256:
            operations.append(Operation(f"write {managed.path}" + (" (new)" if not now.exists else ""),
                                        detail=diff(now.text, managed.text, managed.path)))
    return operations


def install_spec(profile: Profile, rendered: Rendered, backup_id: str, meta: dict) -> dict:
    """The unitfile probe's stdin for an install (pinned by the unit tests)."""
    spec = {"action": "install", "unit": profile.unit, "unit_path": unit_path(profile.unit),
            "env_path": profile.env_file, "unit_text": rendered.unit_text, "env_text": rendered.env_text,
            "backup_root": backup_root(profile.unit), "backup_id": backup_id, "meta": meta}
    if rendered.files:
        spec["files"] = [{"path": f.path, "text": f.text, "mode": f.mode} for f in rendered.files]
    return spec


def check_haproxy_config(ctx: RunContext) -> None:
    """HAProxy reads the rendered config (`haproxy -c`) before it replaces the one in place."""
    config = next(f for f in ctx.rendered.files if f.path == ctx.profile.balancer.config)
    result = ctx.executor.run(ctx.host, ["bash", "-c", 'f=$(mktemp) && cat > "$f" && haproxy -c -q -f "$f"; '
                                         'rc=$?; rm -f "$f"; exit $rc'], stdin=config.text, timeout=60)
    check(result, "haproxy -c (checking the rendered balancer config)")


class UnitStep:
    name = "unit"
    title = "Render the unit"

    def plan(self, ctx: PlanContext) -> list[Operation]:
        return plan_unit(ctx.profile, ctx.rendered, ctx.facts.dest)

    def prepare(self, ctx: RunContext, operations: list[Operation]) -> list[Undo]:
        """Before the pivot changes anything: back up the files this step will replace, with what runs
        now (the training job and conflicts the pivot will stop, the replicas serving). A backup that
        cannot be written (a full disk) stops the pivot here, with nothing changed."""
        profile, units, training = ctx.profile, ctx.facts.dest, ctx.facts.host.training
        stopping = [training.unit] if training.running and training.unit else []
        running = [c for c in profile.conflicts if units.unit(c).active_state in ("active", "activating")]
        meta = {"profile": profile.name, "reason": "pivot", "restart_after_rollback": stopping + running}
        if profile.replicated:
            # what runs now: rollback restarts these (and stops any other replica); a replica this pivot
            # drops is still running when the backup is taken
            members = [r.unit for r in profile.replicas.members]
            meta["replicas_before"] = [u for u in members if units.unit(u).active] + [
                u for u in units.installed_replicas(profile.unit) if u not in members]
        backup_id = new_backup_id()
        spec = {**install_spec(profile, ctx.rendered, backup_id, meta), "action": "backup"}
        out = run_probe(ctx.executor, ctx.host, "unitfile", stdin=spec)
        if "error" in out:
            raise StepFailed(f"{out['error']} on {ctx.host.name}: nothing was stopped or changed",
                             fix=f"free space under {BACKUP_ROOT} on {ctx.host.name}")
        ctx.journal.backup_id = backup_id
        return [RestoreBackup(profile.unit, backup_id)]

    def apply(self, ctx: RunContext, operations: list[Operation]) -> str:
        journal, profile = ctx.journal, ctx.profile
        if profile.replicated:
            check_haproxy_config(ctx)
        backup_id = journal.backup_id
        # Recorded before the action runs: an install that fails half-way is rolled back from its backup too.
        journal.undo.append(RestoreBackup(profile.unit, backup_id))
        out = run_probe(ctx.executor, ctx.host, "unitfile",
                        stdin={**install_spec(profile, ctx.rendered, backup_id, {}), "backup_taken": True})
        if out["daemon_reload"]["rc"] != 0:
            raise StepFailed(f"systemctl daemon-reload failed on {ctx.host.name}: {out['daemon_reload']['stderr']}")
        journal.change(self.name)
        journal.unit_files = {"backup_id": backup_id, "before": out["before"], "after": out["after"]}
        return f"installed; backup {backup_id} in {BACKUP_ROOT}/{profile.unit}"
